"""What the benchmarks measure the same way: peak memory, and the prefill time + decode rate of one generation.
The measuring itself lives in the package (``edgec.bench``, what `edgec bench` runs); these keep the benchmarks'
signatures: GB, and (prefill seconds, decode tokens/s) of exactly ``new_tokens`` decode steps."""

from __future__ import annotations

from edgec.bench import peak_rss_bytes, time_bundle
from edgec.bench import time_genai as _time_genai


def machine() -> str:
    """What a result was measured on: the CPU model (ratios against onnxruntime-genai differ between CPU makes:
    docs/BENCHMARKS.md, issue 21's eleventh round), the cores this process may use and ONNX Runtime's version."""
    from edgec.runtime.calibration import machine_key

    return machine_key().replace(" | ", ", ")


def peak_rss_gb() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss it is not inherited from the parent across fork/exec)."""
    return peak_rss_bytes() / 2**30


def time_edgec(model, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) of an edgec ``Model`` generating ``new_tokens`` greedily after ``ids``."""
    prefill, steps, seconds = time_bundle(model, ids, new_tokens)
    assert steps == new_tokens, f"stopped early after {steps}"
    return prefill, new_tokens / seconds


def time_genai(og, model, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """The same for an onnxruntime-genai model (``og`` is the imported module)."""
    prefill, steps, seconds = _time_genai(og, model, ids, new_tokens)
    assert steps == new_tokens, f"stopped early after {steps}"
    return prefill, new_tokens / seconds
