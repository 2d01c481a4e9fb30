"""StreamingLLM: keep the sinks and the most recent tokens; evict the oldest of the rest (score = position)."""

from __future__ import annotations

import numpy as np

name = "streaming"
needs: tuple[str, ...] = ()
prunes = False
prompt_overwrites = True  # a prompt chunk's scores replace the old ones


def update(score, stats, key_pos, new) -> np.ndarray:
    return key_pos.astype(np.float32)


def update_onnx(body, score, stats, key_pos, new) -> str:
    return body.op("Cast", key_pos, to=1)
