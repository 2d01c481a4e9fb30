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
