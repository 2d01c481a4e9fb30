"""H2O (heavy hitters): the attention a token has received, accumulated over steps with a decay so that old
fame fades; the least-attended token is evicted."""

from __future__ import annotations

from edgec.kvcache.policies.base import accumulate, accumulate_onnx

name = "h2o"
needs = ("total",)
prunes = False
DECAY = 0.99


def update(score, stats, key_pos, new):
    return accumulate(score, stats["total"], DECAY)


def update_onnx(body, score, stats, key_pos, new) -> str:
    return accumulate_onnx(body, score, stats["total"], DECAY, new)
