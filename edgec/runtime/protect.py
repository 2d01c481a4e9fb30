"""Which prompt tokens a compressed cache must never evict.

A caller names them by token index, by a predicate over token strings, or with the built-in heuristics
(``"numbers"``: tokens with a digit; ``"names"``: capitalised words that do not start a sentence). Why: a
pruned cache that drops the one rare word a question hinges on ("warfarin") answers about something else.

Protected slots are bounded to ``Compression.max_protected`` per head (a share of the evictable capacity) so
that the sinks, the recent window and fresh tokens always have room. When more tokens qualify, the earliest
ones are protected and the rest are scored like any other token; a warning says how many were left out.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence

import numpy as np

from edgec.errors import GenerationError

Protect = str | Sequence[int] | Callable[[str], bool] | None
HEURISTICS = ("numbers", "names")
_SENTENCE_END = re.compile(r"[.!?:\n]\s*$")


def protect_flags(protect: Protect, ids: np.ndarray, token_strings: Callable[[Sequence[int]], list[str]], limit: int):
    """Flags [len(ids)] bool, at most ``limit`` set (None when nothing is protected)."""
    if protect is None:
        return None
    if isinstance(protect, str):
        flags = _heuristic_flags(protect, token_strings(ids.tolist()))
    elif callable(protect):
        flags = np.array([bool(protect(text)) for text in token_strings(ids.tolist())], bool)
    else:
        indices = np.asarray(list(protect), dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= len(ids)):
            raise GenerationError(f"protect indices must lie in [0, {len(ids)}) (positions in the prompt)")
        flags = np.zeros(len(ids), bool)
        flags[indices] = True
    chosen = np.flatnonzero(flags)
    if len(chosen) > limit:
        warnings.warn(
            f"{len(chosen)} prompt tokens asked for protection but the cache allows {limit}: protecting the "
            f"first {limit}, scoring the other {len(chosen) - limit} like any token",
            stacklevel=3,
        )
        flags[chosen[limit:]] = False
    return flags


def _heuristic_flags(spec: str, pieces: list[str]) -> np.ndarray:
    kinds = [kind.strip() for kind in spec.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in HEURISTICS]
    if unknown or not kinds:
        raise GenerationError(f"unknown protect heuristic {', '.join(unknown) or spec!r}; use {','.join(HEURISTICS)}")
    flags = np.zeros(len(pieces), bool)
    previous = "\n"
    for index, piece in enumerate(pieces):
        word = piece.replace("Ġ", " ").replace("▁", " ")  # BPE / SentencePiece word-start markers
        stripped = word.strip()
        if "numbers" in kinds and any(ch.isdigit() for ch in stripped):
            flags[index] = True
        starts_word = word[:1] == " " or previous.endswith((" ", "\n"))
        if "names" in kinds and stripped[:1].isupper() and starts_word and not _SENTENCE_END.search(previous):
            flags[index] = True
        previous = word
    return flags
