"""TOVA: the token the current query attends to least is evicted; only the latest query counts (no history)."""

from __future__ import annotations

name = "tova"
needs = ("last",)
prunes = False
prompt_overwrites = True  # a prompt chunk's scores replace the old ones


def update(score, stats, key_pos, new):
    return stats["last"]


def update_onnx(body, score, stats, key_pos, new) -> str:
    return stats["last"]
