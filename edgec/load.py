"""Model folder or GGUF file on local disk → torch model + tokenizer. Never touches a hub.

Everything a user can get wrong (missing path, no config, pickle-only weights, damaged safetensors, an
architecture edgec cannot compile) is caught here *before* the heavy load, with an error that says what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgec.bundle import sha256_file
from edgec.errors import ModelLoadError, UnsupportedModelError
from edgec.hub import resolve_source
from edgec.shape import GGUF_ARCHITECTURES, ModelShape, check_config_values, gguf_architecture, gguf_config

# model_type → the transformers class that edgec traces. Families join as their parity tests pass.
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",  # Gemma 3 text-only (270m, 1b); "gemma3" is the multimodal family
}
# why some well-known families are refused, so the message says more than "unsupported"
UNSUPPORTED_KINDS = {
    "mixture-of-experts": (
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "deepseek_v2",
        "deepseek_v3",
        "dbrx",
        "olmoe",
        "granitemoe",
        "jamba",
        "phimoe",
        "gpt_oss",
    ),
    "encoder-decoder": ("t5", "mt5", "bart", "mbart", "pegasus", "marian", "whisper", "umt5", "longt5"),
    "encoder-only": ("bert", "roberta", "distilbert", "deberta", "deberta-v2", "electra", "xlm-roberta", "modernbert"),
    "multimodal": (
        "llava",
        "llava_next",
        "idefics",
        "idefics2",
        "idefics3",
        "mllama",
        "qwen2_vl",
        "qwen2_5_vl",
        "paligemma",
        "gemma3",
        "pixtral",
        "smolvlm",
        "blip-2",
    ),
}


@dataclass
class LoadedModel:
    """A loaded source model and what the bundle must record about where it came from."""

    causal_lm: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers PreTrainedTokenizerFast
    config: Any
    source: dict[str, Any] = field(default_factory=dict)
    source_path: Path | None = None  # the model folder or GGUF file it was loaded from


def _set_offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def quiet_progress_environment() -> None:
    """The environment switches that turn off tqdm and huggingface_hub bars; they count only when set before
    those libraries are imported, so the CLI sets them first (cheap: nothing is imported)."""
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"


def silence_third_party_progress() -> None:
    """No tqdm bars from the libraries a build uses (the CLI shows its own progress): in a log they are carriage-
    return-joined noise. TQDM_DISABLE only counts if set before tqdm is first imported, and transformers' GGUF
    reader calls plain tqdm (not transformers' switchable one), so that module's tqdm is wrapped as well."""
    quiet_progress_environment()
    import functools

    import transformers

    transformers.utils.logging.disable_progress_bar()  # its logging.tqdm ("Writing model shards", ...)
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without its GGUF reader
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None and not isinstance(bar, functools.partial):
        gguf_utils.tqdm = functools.partial(bar, disable=True)


def _supported_names() -> str:
    return ", ".join(sorted(SUPPORTED_MODEL_TYPES))


def check_model_type(model_type: str | None, architectures: list[str] | None = None) -> None:
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    kind = next((kind for kind, types in UNSUPPORTED_KINDS.items() if model_type in types), None)
    what = f"a {kind} model" if kind else "not a family edgec has been tested on"
    raise UnsupportedModelError(
        f"architecture {model_type!r} ({', '.join(architectures or []) or 'unknown class'}) is {what}; "
        f"edgec compiles decoder-only text models of these families: {_supported_names()}"
    )


# config features that change the maths in ways KVAttention does not implement: refused, never ignored
UNSUPPORTED_FEATURES = {
    "attn_logit_softcapping": "attention logit soft-capping (Gemma 2)",
    "use_bidirectional_attention": "bidirectional attention (an embedding model, not a decoder)",
}


def check_model_features(config: dict[str, Any]) -> None:
    """Refuse a supported family configured with a feature edgec cannot compile (final logit soft-capping is
    honoured by the traced step; attention soft-capping is not)."""
    used = [what for key, what in UNSUPPORTED_FEATURES.items() if config.get(key)]
    if used:
        raise UnsupportedModelError(
            f"this {config.get('model_type')} model uses {', '.join(used)}, which edgec does not compile yet"
        )


def inspect_source(path: str | Path, allow_pickle: bool = False) -> dict[str, Any]:
    """Validate a model path (or a Hub id in the local cache) without loading weights; returns what kind of source
    it is."""
    path = resolve_source(path)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; give a Hugging Face model folder or a .gguf file")
        return _inspect_gguf(path)
    if not path.is_dir():  # a named pipe, a socket, a device
        raise ModelLoadError(f"{path} is neither a file nor a folder; give a Hugging Face model folder or a .gguf file")
    return _inspect_folder(path, allow_pickle)


def _inspect_gguf(path: Path) -> dict[str, Any]:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        architecture = gguf_architecture(reader)
    except Exception as error:  # any parse failure is a damaged or foreign file
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(error).__name__}: {error})") from None
    if architecture not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {architecture!r} in {path.name} is not supported; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    shape = _shape(lambda: gguf_config(path, reader), path.stem, path)
    return {"kind": "gguf", "path": path, "model_type": GGUF_ARCHITECTURES[architecture], "shape": shape}


def _shape(config, name: str, where: Path) -> ModelShape:
    """The model's shape from its config (a dict, or a function reading one), or one line saying what is wrong."""
    try:
        config = config() if callable(config) else config
        check_config_values(config, f"the config of {name}")
        return ModelShape.from_config(config, name)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
        raise ModelLoadError(f"{where} does not describe a usable model ({type(error).__name__}: {error})") from None


def _inspect_folder(path: Path, allow_pickle: bool) -> dict[str, Any]:
    try:
        entries = sorted(path.iterdir())
    except OSError as error:
        raise ModelLoadError(f"cannot read the model folder {path}: {error.strerror or error}") from None
    for entry in entries:
        # transformers opens the folder's files by name: a named pipe's open waits for a writer forever
        if not (entry.is_file() or entry.is_dir()):
            raise ModelLoadError(
                f"{entry.name} in {path} is not a regular file (a named pipe, socket or device, or a link to "
                "nothing): a model folder holds files; re-download or re-save it"
            )
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path} has no config.json; give a Hugging Face model folder or a .gguf file")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{config_path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path} must be a JSON object, not {type(config).__name__}")
    architectures = config.get("architectures")
    check_model_type(config.get("model_type"), architectures if isinstance(architectures, list) else None)
    check_model_features(config)
    safetensors_files = sorted(path.glob("*.safetensors"))
    pickle_files = sorted(path.glob("*.bin")) + sorted(path.glob("*.pt")) + sorted(path.glob("*.pth"))
    if not safetensors_files:
        if not pickle_files:
            raise ModelLoadError(f"{path} has no weights (*.safetensors)")
        if not allow_pickle:
            raise ModelLoadError(
                f"{path} has only pickle weights ({pickle_files[0].name}); loading pickle can run arbitrary code. "
                "Convert them to safetensors, or pass --allow-pickle if you trust the source"
            )
    for weights in safetensors_files:
        _check_safetensors(weights)
    return {
        "kind": "folder",
        "path": path,
        "model_type": config["model_type"],
        "weights": safetensors_files or pickle_files,
        "shape": _shape(config, path.name, config_path),
    }


def _check_safetensors(path: Path) -> None:
    """Header parses and every tensor lies inside the file: catches truncation and garbage early."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError("header length out of range")
            header = json.loads(handle.read(header_len))
        if not isinstance(header, dict):
            raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
        end = max((meta["data_offsets"][1] for name, meta in header.items() if name != "__metadata__"), default=0)
        if not isinstance(end, int):
            raise ValueError("a tensor's data_offsets are not whole numbers")
        if 8 + header_len + end != size:
            raise ValueError(f"data ends at byte {8 + header_len + end} but the file has {size}")
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError, RecursionError) as error:
        raise ModelLoadError(
            f"{path.name} is not a valid safetensors file ({error}); re-download or re-save it"
        ) from None


@contextlib.contextmanager
def gguf_tensors_reported(report: Callable[[str, int, int], None] | None):
    """transformers' GGUF reader walks the file's tensors through its module's ``tqdm``: while this is open, that
    walk reports ``("gguf tensors", done, total)`` instead of drawing a bar."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    if report is None or gguf_utils is None or not hasattr(gguf_utils, "tqdm"):
        yield
        return

    def counted(iterable, *args, **kwargs):
        items = list(iterable)
        for done, item in enumerate(items, 1):
            yield item
            report("gguf tensors", done, len(items))

    previous, gguf_utils.tqdm = gguf_utils.tqdm, counted
    try:
        yield
    finally:
        gguf_utils.tqdm = previous


def load_model(
    path: str | Path, allow_pickle: bool = False, report: Callable[[str, int, int], None] | None = None
) -> LoadedModel:
    """Load a model folder or GGUF file in fp32, offline. ``report(step, done, total)``: a GGUF's tensors as they
    are read and dequantized (the long part of loading one)."""
    _set_offline()
    path = resolve_source(path)  # once: inspect_source takes the resolved path as it is
    info = inspect_source(path, allow_pickle)
    silence_third_party_progress()
    import torch
    import transformers

    if info["kind"] == "gguf":
        kwargs = {"gguf_file": path.name}
        where = path.parent
    else:
        kwargs = {}
        where = path
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(where, local_files_only=True, **kwargs)
    except Exception as error:
        raise ModelLoadError(f"cannot load a tokenizer from {path} ({type(error).__name__}: {error})") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"the tokenizer of {path} has no fast (tokenizer.json) form, which the runtime needs")
    try:
        with gguf_tensors_reported(report):
            causal_lm = transformers.AutoModelForCausalLM.from_pretrained(
                where,
                local_files_only=True,
                dtype=torch.float32,
                use_safetensors=None if allow_pickle else True,
                **kwargs,
            )
    except Exception as error:
        raise ModelLoadError(f"cannot load the weights of {path} ({type(error).__name__}: {error})") from None
    config = causal_lm.config
    check_model_type(config.model_type, getattr(config, "architectures", None))
    check_model_features(config.to_dict())
    return LoadedModel(
        causal_lm=causal_lm, tokenizer=tokenizer, config=config, source=_source_record(info, config), source_path=path
    )


def _source_record(info: dict[str, Any], config) -> dict[str, Any]:
    path: Path = info["path"]
    config_json = json.dumps(config.to_diff_dict(), sort_keys=True).encode()
    if info["kind"] == "gguf":
        weights = {path.name: sha256_file(path)}
        config_sha = hashlib.sha256(config_json).hexdigest()
        name = path.stem
    else:
        weights = {file.name: sha256_file(file) for file in info["weights"]}
        config_sha = sha256_file(path / "config.json")
        name = getattr(config, "_name_or_path", "") or path.name
        name = Path(name).name or path.name
    return {
        "name": name,
        "kind": info["kind"],
        "model_type": config.model_type,
        "config_sha256": config_sha,
        "weights_sha256": weights,
    }
