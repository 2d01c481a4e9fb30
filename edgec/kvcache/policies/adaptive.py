"""The seeds' adaptive rule: scores accumulate as H2O; whenever the cache is full, every evictable token whose
score is below mean − 0.5·σ of the evictable tokens is dropped, so the kept count adapts to how peaked the
attention is (never above capacity, never below the sinks + recent window + protected tokens)."""

from __future__ import annotations

import numpy as np

from edgec.kvcache.policies.base import accumulate, accumulate_onnx

name = "adaptive"
needs = ("total",)
prunes = True
DECAY = 0.99
SIGMAS = 0.5


def update(score, stats, key_pos, new):
    return accumulate(score, stats["total"], DECAY)


def update_onnx(body, score, stats, key_pos, new) -> str:
    return accumulate_onnx(body, score, stats["total"], DECAY, new)


def prune(score: np.ndarray, evictable: np.ndarray) -> np.ndarray:
    """Which evictable slots fall below the threshold, per head; score/evictable [B,Hkv,C]."""
    count = np.maximum(evictable.sum(-1, keepdims=True), 1)
    values = np.where(evictable, score, 0).astype(np.float64)
    mean = values.sum(-1, keepdims=True) / count
    variance = (np.where(evictable, (score - mean) ** 2, 0)).sum(-1, keepdims=True) / count
    return evictable & (score < mean - SIGMAS * np.sqrt(variance))


def prune_onnx(body, score: str, evictable: str) -> str:
    as_float = body.op("Cast", evictable, to=1)
    count = body.op("Max", body.op("ReduceSum", as_float, body.i64([-1]), keepdims=1), body.f32(1.0))
    values = body.op("Where", evictable, score, body.f32(0.0))
    mean = body.op("Div", body.op("ReduceSum", values, body.i64([-1]), keepdims=1), count)
    deviation = body.op("Sub", score, mean)
    squared = body.op("Where", evictable, body.op("Mul", deviation, deviation), body.f32(0.0))
    sigma = body.op("Sqrt", body.op("Div", body.op("ReduceSum", squared, body.i64([-1]), keepdims=1), count))
    threshold = body.op("Sub", mean, body.op("Mul", sigma, body.f32(SIGMAS)))
    return body.op("And", evictable, body.op("Less", score, threshold))
