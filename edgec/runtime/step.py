"""What a runtime backend provides, whatever runs the graph (ONNX Runtime, TensorRT-RTX, a later one).

A ``Backend`` is the loaded graph or engine: weights, sessions, compiled kernels — loaded once, shared. A
``CacheState`` is one sequence's cache on that backend (what one generation, one chat session or one served
request runs on): any number may be open at once, each used by one thread at a time. ``Model`` keeps a pool of
them and never gives one to two generations at once.

A step feeds tokens at explicit positions (a cache that has evicted tokens must still rotate new tokens by
their true position) and returns logits; the state tensors it reads and writes are those the bundle's
``CacheSpec`` names, allocated through ``CacheSpec.empty_state``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from edgec.kvcache.spec import CacheSpec


class CacheState(Protocol):
    def reset(self) -> None:
        """Empty every slot (a new prompt follows)."""

    def begin_prompt(self, length: int) -> None:
        """Before a prompt of ``length`` tokens (a compressed cache may read it into a larger state)."""

    def run(self, ids: np.ndarray, start: int, last_only: bool, protect: np.ndarray | None = None) -> np.ndarray:
        """Feed ``ids`` at positions ``start, start+1, ...`` (at most ``Backend.max_tokens``); logits [N, vocab]
        of the last (or every) position. ``protect`` flags tokens a compressed cache must never evict. A
        one-token result may be a view of a buffer the next step overwrites: copy it to keep it."""

    def end_prompt(self, newest: int, last_chunk_start: int | None = None) -> None:
        """After the prompt (``newest``: its last position; ``last_chunk_start``: the first of its last step)."""

    def arrays(self) -> dict[str, np.ndarray]:
        """Host copies of the state, by graph input name (inspection, tests, saved prompts)."""

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Set the state to ``arrays()`` taken earlier from a state of the same spec (a saved prompt)."""

    def close(self) -> None:
        """Release what the state holds on the device (idempotent; also done when it is collected)."""


class Backend(Protocol):
    spec: CacheSpec
    vocab_size: int
    max_tokens: int  # tokens one step may take (the prefill chunk); decode steps take one

    @property
    def providers(self) -> list[str]:
        """What executes the graph, e.g. ONNX Runtime's execution providers in priority order."""

    def open_state(self) -> CacheState:
        """A new, empty cache state on this backend."""

    def state_bytes(self, spec: CacheSpec, prompt_tokens: int = 0) -> int:
        """Bytes a state of ``spec`` takes while it reads a ``prompt_tokens``-token prompt (``Model.session_bytes``)."""

    def device_memory(self) -> tuple[int, int] | None:
        """``(free, total)`` bytes of the GPU that holds the cache states, read now; None where the states live in
        host memory (or the GPU cannot be asked)."""

    def close(self) -> None:
        """Release the backend (and save what it keeps between runs, e.g. compiled kernels)."""
