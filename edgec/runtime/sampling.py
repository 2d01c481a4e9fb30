"""Next-token choice from one row of logits (numpy only)."""

from __future__ import annotations

import numpy as np


def choose_token(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> int:
    """Greedy when ``temperature`` is 0; otherwise sample after temperature, top-k and top-p (nucleus) filtering."""
    if temperature == 0:
        return int(np.argmax(logits))
    # shift before dividing: a tiny temperature then sends the others to -inf (greedy), never to inf - inf = NaN
    with np.errstate(over="ignore"):
        scaled = (logits.astype(np.float64) - logits.max()) / temperature
    if 0 < top_k < scaled.shape[-1]:
        candidates = np.argpartition(scaled, -top_k)[-top_k:]
    else:
        candidates = np.arange(scaled.shape[-1])
    candidates = candidates[np.argsort(-scaled[candidates], kind="stable")]
    probs = np.exp(scaled[candidates] - scaled[candidates[0]])
    probs /= probs.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
        candidates, probs = candidates[:keep], probs[:keep] / probs[:keep].sum()
    return int(candidates[rng.choice(len(candidates), p=probs)])


def penalize_repeats(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """Logits with every token in ``seen`` (ids; duplicates are harmless) made less likely by ``penalty`` (the
    CTRL / Hugging Face rule: a positive logit is divided by it, a negative one multiplied, so the token always
    moves away from being chosen when ``penalty`` > 1). Returns a new array; ``logits`` is left as it is."""
    penalized = logits.astype(np.float32, copy=True)
    if penalty == 1.0 or len(seen) == 0:
        return penalized
    picked = penalized[seen]
    penalized[seen] = np.where(picked > 0, picked / penalty, picked * penalty)
    return penalized


class SeenTokens:
    """The distinct token ids of a prompt and its continuation so far, for the repetition penalty: a vocab-sized
    mask answers "seen already?" in O(1) and the ids live in a preallocated array, so each step costs O(1) here
    plus one vectorised gather/scatter over the seen ids (never a Python loop over the vocabulary)."""

    def __init__(self, prompt: np.ndarray, vocab_size: int, room: int) -> None:
        self._mask = np.zeros(vocab_size, dtype=bool)
        unique = np.unique(prompt)
        self._mask[unique] = True
        self._ids = np.empty(len(unique) + room, dtype=np.int64)
        self._ids[: len(unique)] = unique
        self._count = len(unique)

    def add(self, token: int) -> None:
        if not self._mask[token]:
            self._mask[token] = True
            self._ids[self._count] = token
            self._count += 1

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self._count]
