"""GPU check: each TensorRT-RTX bundle against the cpu bundle of the same model (logits, greedy tokens), tok/s, VRAM.

bash benchmarks/gpu_check.sh [BUNDLE ...]    # default: benchmarks/out/smol.rtx*.edgec vs smollm2-cpu-fp32.edgec
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "out"


def vram_used_mib() -> float:
    import pynvml

    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used / 2**20


def main() -> None:
    from edgec.runtime import Model

    bundles = [Path(p) for p in sys.argv[1:]] or sorted(OUT.glob("smol.rtx*.edgec"))
    reference = Model.load(OUT / "smollm2-cpu-fp32.edgec")
    prompt = reference.encode("The capital of France is Paris. The capital of Germany is")
    want_logits = reference.next_token_logits(prompt)
    want_tokens = list(reference.generate_ids(prompt, max_new_tokens=32))
    for bundle in bundles:
        before = vram_used_mib()
        model = Model.load(bundle)
        got = model.next_token_logits(prompt).astype(np.float32)
        tokens = list(model.generate_ids(prompt, max_new_tokens=32))
        start = time.perf_counter()
        steps = sum(1 for _ in model.generate_ids(prompt, max_new_tokens=129)) - 1
        speed = steps / (time.perf_counter() - start)
        print(
            f"{bundle.name}: max |Δlogit| vs cpu {np.abs(got - want_logits).max():.3e}, "
            f"top-1 {'same' if got.argmax() == want_logits.argmax() else 'DIFFERENT'}, "
            f"greedy 32 tokens {'identical' if tokens == want_tokens else 'differ'}, "
            f"{speed:.1f} tok/s (incl. prefill), VRAM +{vram_used_mib() - before:.0f} MiB"
        )


if __name__ == "__main__":
    main()
