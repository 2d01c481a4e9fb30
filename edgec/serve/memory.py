"""What the server may spend on sessions: ``--memory`` minus what the loaded model takes, measured once.

The planner (edgec/plan.py) estimates weights + activations from a model's config; a running server can do
better and measure them: after loading, it reads the longest prompt the bundle takes once (so ONNX Runtime's
arena has grown to its largest step: the activations) and reads the process's resident memory. That figure
holds the weights, the runtime libraries and the activations of one step at a time (the engine runs one step at
a time). Each session then costs exactly its cache state (``Model.session_bytes``: CacheSpec sizes), and a fixed
headroom covers the HTTP side (requests, responses, Python objects).
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

    @property
    def session_budget(self) -> int | None:
        """Bytes the sessions' cache states may take together."""
        return None if self.limit is None else self.limit - self.model_bytes - HEADROOM

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"session_budget": self.session_budget, "headroom": HEADROOM}


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
    memory = ServerMemory(limit, resident_bytes(), weights)
    if limit is not None and memory.session_budget < smallest_session:
        need = memory.model_bytes + HEADROOM + smallest_session
        raise BuildSettingsError(
            f"--memory {limit / 2**20:.0f} MiB is too small: the loaded model takes {memory.model_bytes / 2**20:.0f} "
            f"MiB (weights {weights / 2**20:.0f} MiB, runtime and activations included), the server keeps "
            f"{HEADROOM / 2**20:.0f} MiB, and one session needs {smallest_session / 2**20:.1f} MiB; give at least "
            f"{need / 2**20:.0f} MiB"
        )
    return memory
