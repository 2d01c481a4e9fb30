"""What an eviction policy is: a rule that scores every candidate of one attention call (the cached slots and
the call's new tokens) from what that call's attention saw. The op does the rest the same way for all of them:
sinks, the recent window and protected tokens are never evicted; empty slots go first; the lowest scores go
next. A policy has two equal halves: ``update`` in numpy (the meaning) and ``update_onnx`` (the graph).

Attention statistics available to a policy, each [B, Hkv, C + T] (old slots first, then the new tokens):
  total     attention received, summed over the KV head's query heads and every query of the call
  observed  the same, over the last ``observe`` queries only (the end of a prompt: its question)
  last      attention received from the call's last query, averaged over the KV head's query heads
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from edgec.kvcache.onnx_body import Body

STATISTICS = ("total", "observed", "last")


class Policy(Protocol):
    name: str
    needs: tuple[str, ...]  # which statistics the update reads
    # optional: ``prompt_needs``, the statistics a call of T > 1 tokens reads where fewer than ``needs``
    # optional: ``prompt_overwrites`` True, a call of T > 1 tokens replaces every score (reads no old one)
    prunes: bool  # evicts below a threshold when the cache is full, not just what the new tokens need

    def update(self, score: np.ndarray, stats: dict[str, np.ndarray], key_pos: np.ndarray, new: int) -> np.ndarray:
        """score [B,Hkv,C] float32 (the state) → scores of all C + new candidates [B,Hkv,C+new]."""

    def update_onnx(self, body: Body, score: str, stats: dict[str, str], key_pos: str, new: str | None) -> str:
        """The same in graph nodes; ``new`` names an int64 tensor holding T, or is None in the one-token
        decode branch (T = 1 known when the graph is written); returns the result's name."""


def prompt_needs(policy: Policy) -> tuple[str, ...]:
    """The statistics a multi-token call's update reads: ``needs`` unless the policy declares fewer. A policy
    that needs no ``total`` there (snapkv, tova, streaming) lets the op attend with a fused kernel and score
    from the last ``observe`` query rows alone, never the call's whole score matrix."""
    return getattr(policy, "prompt_needs", policy.needs)


def prompt_overwrites(policy: Policy) -> bool:
    """Whether a multi-token call's update replaces every score without reading the old ones (snapkv, tova,
    streaming): then a prompt chunk followed by another one need not observe (the op's ``observe`` input), as
    the next chunk's scores replace its own."""
    return bool(getattr(policy, "prompt_overwrites", False))


def accumulate(score: np.ndarray, received: np.ndarray, decay: float) -> np.ndarray:
    """Old scores decay, then every candidate adds what it received (new tokens start at zero)."""
    pad = np.zeros(score.shape[:2] + (received.shape[-1] - score.shape[-1],), np.float32)
    return (np.concatenate([score * np.float32(decay), pad], axis=-1) + received).astype(np.float32)


def accumulate_onnx(body: Body, score: str, received: str, decay: float, new: str | None) -> str:
    """``new``: as in ``update_onnx`` (None: one token, known when the graph is written)."""
    decayed = body.op("Mul", score, body.f32(decay))
    # pad the new tokens' part with zeros: Pad on the last axis by T
    zeros = body.i64([0, 0, 0, 0, 0, 1]) if new is None else body.op("Concat", body.i64([0, 0, 0, 0, 0]), new, axis=0)
    padded = body.op("Pad", decayed, zeros, body.f32(0.0))
    return body.op("Add", padded, received)
