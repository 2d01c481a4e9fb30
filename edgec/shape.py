"""The shape of a model (layers, heads, head dim, windows, vocabulary, context) from its config alone: the one
reader of model configs, used by the loader, the export (cache layout), the planner and AWQ.

Sources: a transformers config object, a config.json dict, a model folder, a GGUF file's metadata (no weights
are read), or a bundled config name (``edgec/configs``: llama-2-7b, llama-3-8b, smollm2-135m).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from edgec.errors import BuildSettingsError, ModelLoadError
from edgec.hub import resolve_source

# GGUF general.architecture → transformers model_type (Mistral GGUFs carry the "llama" architecture)
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "phi3": "phi3", "gemma3": "gemma3_text"}


# The numbers of a model config that edgec computes with (the planner, the cache layout), with their bounds: a
# config.json or GGUF from anywhere may hold a string, a zero or a negative number where a count belongs.
# (required?, lowest, highest); an optional key may be absent or null.
CONFIG_NUMBERS: dict[str, tuple[bool, int, int]] = {
    "num_hidden_layers": (True, 1, 1_024),
    "hidden_size": (True, 1, 2**20),
    "intermediate_size": (True, 1, 2**22),
    "num_attention_heads": (True, 1, 4_096),
    "vocab_size": (True, 1, 2**22),
    "num_key_value_heads": (False, 1, 4_096),
    "head_dim": (False, 1, 4_096),
    "max_position_embeddings": (False, 0, 2**24),  # 0: not stated (a GGUF without context_length)
    "sliding_window": (False, 0, 2**24),
    "sliding_window_pattern": (False, 1, 1_024),
}


def check_config_values(config: Any, where: str) -> None:
    """One clear line for the first number in a model config that edgec cannot compute with."""
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where} must be a JSON object, not {type(config).__name__}")
    for key, (required, low, high) in CONFIG_NUMBERS.items():
        value = config.get(key)
        if value is None:
            if required:
                raise ModelLoadError(f"{where} has no {key}; it is not a usable decoder config")
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ModelLoadError(f"{where}: {key} is {value!r:.40}, but must be a whole number in [{low}, {high:,}]")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % kv_heads:
        raise ModelLoadError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    if not config.get("head_dim") and config["hidden_size"] % heads:
        raise ModelLoadError(f"{where}: hidden_size {config['hidden_size']} is not a multiple of {heads} heads")
    layer_types = config.get("layer_types")
    if layer_types is not None and not (
        isinstance(layer_types, list)
        and len(layer_types) == config["num_hidden_layers"]
        and all(isinstance(kind, str) for kind in layer_types)
    ):
        raise ModelLoadError(f"{where}: layer_types must list one string per layer")


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    max_context: int
    windows: tuple[int, ...] = ()  # sliding window per layer (0 = global); empty = all global

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> ModelShape:
        """From a config.json dict or a transformers config object."""
        if not isinstance(config, dict):
            name = name or Path(getattr(config, "_name_or_path", "") or "model").name
            config = config.to_dict()
        heads = config["num_attention_heads"]
        return cls(
            windows=_layer_windows(config),
            name=name or "model",
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
            max_context=config.get("max_position_embeddings") or 0,
        )

    def layer_windows(self) -> tuple[int, ...]:
        """Sliding window of every layer (0 = global attention)."""
        return self.windows or (0,) * self.layers

    def parameters(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (attention + mlp + 2 * self.hidden) + embeddings + self.hidden


def _layer_windows(config: dict[str, Any]) -> tuple[int, ...]:
    """Per ``layer_types`` where the config has them (Gemma 3, Qwen2), else the config's ``sliding_window`` for
    every layer (Mistral) unless ``use_sliding_window`` is off; Gemma 3 configs written before ``layer_types``
    give a pattern instead (every n-th layer global)."""
    layers, window = config["num_hidden_layers"], config.get("sliding_window") or 0
    if not window:
        return ()
    if layer_types := config.get("layer_types"):
        return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)
    if pattern := config.get("sliding_window_pattern"):
        return tuple(0 if (i + 1) % pattern == 0 else window for i in range(layers))
    return (window,) * layers if config.get("use_sliding_window", True) else ()


def model_shape(source: str | Path) -> ModelShape:
    """A config from: a bundled name (llama-2-7b, llama-3-8b, smollm2-135m), a config.json, a model folder, or a
    GGUF file (its metadata; no weights are read)."""
    source_path = Path(source)
    bundled = resources.files("edgec.configs") / f"{source}.json"
    if not source_path.exists() and bundled.is_file():
        return ModelShape.from_config(json.loads(bundled.read_text()), str(source))
    source_path = resolve_source(source)
    if source_path.is_dir():
        source_path = source_path / "config.json"
    if source_path.suffix.lower() == ".gguf" and source_path.is_file():
        config = gguf_config(source_path)
        check_config_values(config, f"the metadata of {source_path.name}")
        return ModelShape.from_config(config, source_path.stem)
    if source_path.is_file():
        try:
            config = json.loads(source_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise BuildSettingsError(f"{source_path} is not a usable model config ({error})") from None
        check_config_values(config, str(source_path))
        return ModelShape.from_config(config, source_path.parent.name)
    names = ", ".join(
        sorted(p.name[:-5] for p in resources.files("edgec.configs").iterdir() if p.name.endswith(".json"))
    )
    raise BuildSettingsError(f"{source} is not a model folder, config.json, .gguf or a known config ({names})")


def gguf_architecture(reader) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def gguf_config(path: Path, reader=None) -> dict[str, Any]:
    """The config.json keys a GGUF's metadata gives (plus ``model_type``)."""
    import gguf

    reader = reader or gguf.GGUFReader(str(path))

    def value(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.parts[field.data[0]][0].item()

    arch = gguf_architecture(reader)
    heads = value(f"{arch}.attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    names = {tensor.name for tensor in reader.tensors}
    config = {
        "model_type": GGUF_ARCHITECTURES.get(arch, arch),
        "num_hidden_layers": value(f"{arch}.block_count"),
        "hidden_size": value(f"{arch}.embedding_length"),
        "intermediate_size": value(f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": value(f"{arch}.attention.head_count_kv", heads),
        "head_dim": value(f"{arch}.attention.key_length"),
        "vocab_size": value(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else 0),
        "tie_word_embeddings": "output.weight" not in names,
        "max_position_embeddings": value(f"{arch}.context_length", 0),
        "sliding_window": value(f"{arch}.attention.sliding_window", 0),
    }
    if arch == "gemma3":  # its GGUF states the window, not the layout: every 6th layer is global
        config["sliding_window_pattern"] = 6
    return config
