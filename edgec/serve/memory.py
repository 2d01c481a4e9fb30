"""What the server may spend on sessions: ``--memory`` minus what the loaded model takes, measured once.

The planner (edgec/plan.py) estimates weights + activations from a model's config; a running server can do
better and measure them: after loading, it reads the longest prompt the bundle takes once (so ONNX Runtime's
arena has grown to its largest step: the activations) and reads the process's resident memory. That figure
holds the weights, the runtime libraries and the activations of one step at a time (the engine runs one step at
a time). Each session then costs exactly its cache state (``Model.session_bytes``: CacheSpec sizes), and a fixed
headroom covers the HTTP side (requests, responses, Python objects).

On a bundle whose cache states live on a GPU (TensorRT-RTX, ONNX Runtime's CUDA provider) the sessions cost GPU
memory, so the budget is the GPU's: after the warm-up, what is in use on it (every process counted: the driver can
only say device-wide) is subtracted from ``--memory`` — or, without ``--memory``, from the GPU's total — and a
session never gets more than the GPU has free. Host memory is then not budgeted: a GPU session's host side is its
request and a step's logits.
"""

from __future__ import annotations

import dataclasses

from edgec.errors import BuildSettingsError
from edgec.runtime.model import Model

HEADROOM = 32 * 2**20  # the web stack, per-request Python objects, the allocator's slack


def resident_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


@dataclasses.dataclass(frozen=True)
class ServerMemory:
    limit: int | None  # --memory, bytes (None: no limit)
    model_bytes: int  # resident after loading and one longest step (weights + runtime + activations)
    weights_bytes: int  # the bundle's weight files (part of model_bytes)
    device_total: int | None = None  # the GPU holding the sessions' states (None: they live in host memory)
    device_used: int | None = None  # in use on that GPU after the warm-up, by every process

    @property
    def budget_on(self) -> str:
        return "host" if self.device_total is None else "gpu"

    @property
    def session_budget(self) -> int | None:
        """Bytes the sessions' cache states may take together (GPU bytes where they live on a GPU)."""
        if self.device_total is not None:
            ceiling = self.device_total if self.limit is None else min(self.limit, self.device_total)
            return ceiling - self.device_used - HEADROOM
        return None if self.limit is None else self.limit - self.model_bytes - HEADROOM

    def to_json(self) -> dict:
        extra = {"session_budget": self.session_budget, "budget_on": self.budget_on, "headroom": HEADROOM}
        return dataclasses.asdict(self) | extra


def warm_up(model: Model, prompt_tokens: int) -> None:
    """One generation of the longest prompt the server takes (its activations are the largest a step has)."""
    for _ in model.generate_ids([0] * max(1, prompt_tokens), max_new_tokens=2):
        pass


def measure(model: Model, limit: int | None, smallest_session: int, prompt_tokens: int) -> ServerMemory:
    """Warm the model up on a ``prompt_tokens`` prompt, measure it, and check that ``limit`` leaves room for one
    session of the smallest size."""
    warm_up(model, prompt_tokens)
    files = model.manifest["files"]
    weights = sum(entry["size"] for name, entry in files.items() if name.endswith((".data", ".onnx", ".trt")))
    if model.device_memory() is not None:  # the warm-up's state, kept for reuse, is a session's: not the model's
        model.close_idle_states()
    device = model.device_memory()
    if device is None:
        memory = ServerMemory(limit, resident_bytes(), weights)
    else:
        free, total = device
        memory = ServerMemory(limit, resident_bytes(), weights, total, total - free)
    if memory.session_budget is None or memory.session_budget >= smallest_session:
        return memory
    session_mib = smallest_session / 2**20
    if memory.device_total is not None:
        used, total = memory.device_used / 2**20, memory.device_total / 2**20
        if limit is None or limit >= memory.device_total:
            raise BuildSettingsError(
                f"the GPU has {total - used:.0f} MiB free after loading the model ({used:.0f} of {total:.0f} MiB in "
                f"use, every process counted), the server keeps {HEADROOM / 2**20:.0f} MiB, and one session needs "
                f"{session_mib:.1f} MiB: free GPU memory or serve a bundle with a smaller cache"
            )
        need = memory.device_used + HEADROOM + smallest_session
        raise BuildSettingsError(
            f"--memory {limit / 2**20:.0f} MiB is too small: the GPU holds this bundle's sessions and has "
            f"{used:.0f} MiB in use after loading the model (every process counted), the server keeps "
            f"{HEADROOM / 2**20:.0f} MiB, and one session needs {session_mib:.1f} MiB; give at least "
            f"{need / 2**20:.0f} MiB"
        )
    need = memory.model_bytes + HEADROOM + smallest_session
    raise BuildSettingsError(
        f"--memory {limit / 2**20:.0f} MiB is too small: the loaded model takes {memory.model_bytes / 2**20:.0f} "
        f"MiB (weights {weights / 2**20:.0f} MiB, runtime and activations included), the server keeps "
        f"{HEADROOM / 2**20:.0f} MiB, and one session needs {session_mib:.1f} MiB; give at least "
        f"{need / 2**20:.0f} MiB"
    )
