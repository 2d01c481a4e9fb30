"""One runner per engine that `edgec eval` and `edgec bench` drive: an edgec bundle (the runtime), a Hugging Face
folder or GGUF file run by transformers + torch (eval's reference), an onnxruntime-genai model folder (bench's
``--vs``). Each heavy library is imported only by the runner that needs it, when it is opened."""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from edgec.errors import BundleError, EdgecError, one_line

Logits = Iterator[tuple[int, np.ndarray]]  # (first position, logits [n, vocab]) pieces of one sequence


def kind_of(path: Path) -> str:
    """``bundle`` (a manifest.json), ``genai`` (a genai_config.json), ``source`` (a .gguf file or a folder with a
    config.json: run by transformers), or an error naming what was expected."""
    if (path / "manifest.json").is_file():
        return "bundle"
    if (path / "genai_config.json").is_file():
        return "genai"
    if (path.is_file() and path.suffix == ".gguf") or (path / "config.json").is_file():
        return "source"
    if not path.exists():
        raise BundleError(f"{one_line(path)} does not exist")
    raise BundleError(
        f"{one_line(path)} is neither an edgec bundle (manifest.json), an onnxruntime-genai folder "
        "(genai_config.json), a Hugging Face folder (config.json) nor a .gguf file"
    )


class BundleRunner:
    """An edgec bundle through the runtime (``edgec.runtime.Model``)."""

    kind = "bundle"

    def __init__(self, path: Path, threads: int | None = None) -> None:
        from edgec.runtime import Model

        self.path = Path(path)
        self.model = Model.load(self.path, threads=threads)
        self.vocab_size = self.model.vocab_size
        self.context = self.model.context
        self.eos_token_ids = set(self.model.eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.model.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode(ids)

    def logits(self, ids: Sequence[int], prompt_tokens: int | None = None) -> Logits:
        """Every position's logits; the first ``prompt_tokens`` read as a prompt, the rest as decode steps."""
        return self.model.iter_logits(ids, prompt_tokens)

    def logprobs(self, ids: Sequence[int]) -> np.ndarray:
        return self.model.logprobs(ids)

    def greedy(self, ids: Sequence[int], new_tokens: int, eos_token_ids: set[int] | None = None) -> list[int]:
        """Greedy tokens after ``ids`` (the runtime stops at the bundle's own EOS tokens)."""
        return list(self.model.generate_ids(list(ids), max_new_tokens=new_tokens))

    def kv_bytes(self, tokens: int) -> int:
        return self.model.cache_spec.bytes_for(tokens)


class TorchRunner:
    """A Hugging Face folder or GGUF file in fp32 through transformers + torch (``edgec.load``, offline): the
    source a bundle was built from, as a reference."""

    kind = "source"
    CHUNK = 256  # tokens per forward when teacher forcing: the logits of a whole long text would not fit

    def __init__(self, path: Path, threads: int | None = None) -> None:
        from edgec.load import load_model, quiet_progress_environment

        quiet_progress_environment()
        loaded = load_model(path)
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.path = Path(path)
        self.model = loaded.causal_lm.eval()
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.context = int(getattr(loaded.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids: set[int] = set()

    def _forward(self, ids: Sequence[int], cache):
        # transformers 5 renames past_key_values to cache (the old name warns, then goes): whichever this one takes
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        out = self.model(self.torch.tensor([list(ids)]), use_cache=True, **{name: cache})
        return out.logits[0].float().numpy(), getattr(out, name)

    def logits(self, ids: Sequence[int], prompt_tokens: int | None = None) -> Logits:
        """Every position's logits, in chunks through the model's own cache (exact whichever way it is fed)."""
        with self.torch.no_grad():
            cache = None
            for start in range(0, len(ids), self.CHUNK):
                logits, cache = self._forward(ids[start : start + self.CHUNK], cache)
                yield start, logits

    def logprobs(self, ids: Sequence[int]) -> np.ndarray:
        """log P(ids[i+1] | ids[:i+1]), reduced chunk by chunk with the runtime's own log-softmax."""
        from edgec.runtime.model import _log_softmax_at

        targets = np.append(np.asarray(ids[1:], dtype=np.int64), 0)  # the last position predicts nothing known
        pieces = [_log_softmax_at(logits, targets[start : start + len(logits)]) for start, logits in self.logits(ids)]
        return np.concatenate(pieces)[:-1]

    def greedy(self, ids: Sequence[int], new_tokens: int, eos_token_ids: set[int] | None = None) -> list[int]:
        """Greedy tokens after ``ids``, stopping after one of ``eos_token_ids`` (the compared bundle's)."""
        tokens: list[int] = []
        with self.torch.no_grad():
            feed, cache = list(ids), None
            while len(tokens) < new_tokens:
                logits, cache = self._forward(feed, cache)
                tokens.append(int(logits[-1].argmax()))
                if tokens[-1] in (eos_token_ids or ()):
                    break
                feed = tokens[-1:]
        return tokens


def genai_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "genai_config.json").read_text())
        return config["model"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise BundleError(f"{one_line(folder)}/genai_config.json cannot be read ({one_line(error)})") from None


def require_genai(folder: Path) -> None:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        raise EdgecError(
            f"{one_line(folder)} is an onnxruntime-genai model; running it needs onnxruntime_genai, which is not "
            "installed: pip install onnxruntime-genai"
        ) from None


class GenaiRunner:
    """An onnxruntime-genai model folder (the comparison bench runs against)."""

    kind = "genai"

    def __init__(self, path: Path, threads: int | None = None) -> None:
        require_genai(path)
        import onnxruntime_genai as og

        self.og, self.path = og, Path(path)
        config = genai_config(self.path)
        self.vocab_size = int(config.get("vocab_size", 0))
        self.context = int(config.get("context_length", 0))
        og_config = og.Config(str(self.path))
        if threads:  # as the folder's genai_config.json would say it, without changing the file
            session = {"intra_op_num_threads": int(threads)}
            og_config.overlay(json.dumps({"model": {"decoder": {"session_options": session}}}))
        self.model = og.Model(og_config)


def open_runner(path: Path, threads: int | None = None):
    """The runner for what ``path`` is (``kind_of``)."""
    kind = kind_of(path)
    if kind == "bundle":
        return BundleRunner(path, threads)
    if kind == "genai":
        return GenaiRunner(path, threads)
    return TorchRunner(path, threads)
