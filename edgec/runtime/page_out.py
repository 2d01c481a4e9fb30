"""The pages of a quantized bundle's weights file that its sessions no longer read, handed back after they open.

ONNX Runtime maps a bundle's data file (``model.onnx.data``) privately and reads each weight from the mapping. A
quantized weight's kernel (MatMulNBits and its kin) packs a form of its own from it when the session opens; where
another kernel reads the same stored tensor (the 8-bit tied table's gather reads the lm_head's codes) the mapping
stays, and every page the packing touched stays resident with it (SmolLM2's table: 27 MB, all of it, for a lookup
that reads one row a token). ``madvise(MADV_PAGEOUT)`` over the bundle's mappings takes those pages back: a page
read again later comes back from the file, and a page a kernel wrote to (a private copy) is never dropped — the
call reclaims, it does not discard. The pages a step reads are back after its first call.

Only for bundles whose weights ONNX Runtime packs into forms of its own (``shared_weights.PACKED_OWN_FORM``): a
float bundle's MatMuls read their mapped weights at every step (its shared mappings are the runtime's own), so
handing its pages back would only mean reading them again. Linux only (elsewhere nothing happens).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from pathlib import Path
from typing import Any

MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21)  # Linux ≥ 5.4; Python names it only where its headers do


def page_out_mapped_files(folder: Path, maps: Path = Path("/proc/self/maps")) -> int:
    """Advise the system to reclaim every page of this process's mappings of files in ``folder``; returns the bytes
    of the mappings it was asked for and took (0 where it cannot: not Linux, an older kernel, no ``madvise``)."""
    if not sys.platform.startswith("linux") or (advise := madvise()) is None:
        return 0
    inside = str(folder.resolve()) + os.sep
    advised = 0
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith(inside):
            continue
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        if advise(start, end - start, MADV_PAGEOUT) == 0:
            advised += end - start
    return advised


@functools.cache
def madvise() -> Any:
    """The C library's ``madvise``, loaded once; None where it cannot be."""
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return function
