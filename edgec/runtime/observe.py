"""Which chunks of a prompt observe: the compressed op's ``observe`` input.

A policy whose prompt update replaces every score (``prompt_overwrites``: snapkv, tova, streaming) makes a
chunk's observation — its last queries' attention over every slot — worthless when another chunk follows and
nothing was evicted in between: the next chunk's scores replace it. That holds while the whole prompt fits the
state the runtime reads it into (an ``end`` prompt's temporary state always does; a ``chunk`` prompt only when
it is no longer than the capacity), so then only the chunk holding the prompt's last token observes. The cache
ends the prompt in the same state either way (tests/runtime/test_prompt_observe.py).
"""

from __future__ import annotations

from edgec.kvcache import policies
from edgec.kvcache.compression import Compression
from edgec.kvcache.policies.base import prompt_overwrites


class PromptObservation:
    """Per cache state: ``begin`` at a prompt's start, ``observes`` per chunk, ``end`` after it."""

    def __init__(self) -> None:
        self._last: int | None = None  # the prompt's last position while earlier chunks may skip observing

    def begin(self, compression: Compression | None, length: int) -> None:
        fits = compression is not None and (compression.prefill_compress == "end" or length <= compression.capacity)
        overwrites = fits and prompt_overwrites(policies.get(compression.policy))
        self._last = length - 1 if overwrites else None

    def observes(self, newest: int) -> bool:
        """Whether a chunk whose newest position is ``newest`` observes."""
        return self._last is None or newest >= self._last

    def end(self) -> None:
        self._last = None
