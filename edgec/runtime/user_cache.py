"""What the runtime keeps per user between runs, outside any bundle (bundles may be read-only, signed or shared):
TensorRT-RTX runtime caches and thread calibrations, under ``$EDGEC_CACHE_DIR`` (default ``~/.cache/edgec``)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    return Path(os.environ.get("EDGEC_CACHE_DIR") or Path.home() / ".cache" / "edgec")
