"""What the benchmarks measure the same way: peak memory, and the prefill time + decode rate of one generation."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import numpy as np


def peak_rss_gb() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss it is not inherited from the parent across fork/exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def time_edgec(model, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) of an edgec ``Model`` generating ``new_tokens`` greedily after ``ids``."""
    start = time.perf_counter()
    tokens = model.generate_ids(ids, max_new_tokens=new_tokens + 1)
    next(tokens)
    prefilled = time.perf_counter()
    produced = sum(1 for _ in tokens)
    assert produced == new_tokens, f"stopped early after {produced}"
    return prefilled - start, new_tokens / (time.perf_counter() - prefilled)


def time_genai(og, model, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """The same for an onnxruntime-genai model (``og`` is the imported module)."""
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + new_tokens + 8, do_sample=False)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(np.asarray([ids], dtype=np.int32))
    generator.generate_next_token()
    prefilled = time.perf_counter()
    for _ in range(new_tokens):
        generator.generate_next_token()
    assert not generator.is_done()
    return prefilled - start, new_tokens / (time.perf_counter() - prefilled)
