"""A loaded bundle gives back the C heap its sessions' building freed (``backend_ort.return_freed_heap``)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

from edgec.build import build
from edgec.runtime import Model, backend_ort
from tests.conftest import build_settings

KV = dict(target="cpu", context=128, prefill_chunk=16, kv_capacity=40, kv_dtype="fp32", kv_window=8)
LINUX_GLIBC = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "malloc_trim")


def _resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not LINUX_GLIBC, reason="glibc's malloc_trim")
def test_freed_heap_blocks_leave_the_process():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 64 MiB of heap blocks (under the mmap threshold), each followed by a small one kept: freeing the large ones
    # leaves holes in the heap, which glibc keeps resident (only a free top of the heap goes back by itself)
    blocks, kept = [], []
    for _ in range(1024):
        blocks.append(libc.malloc(64 * 1024))
        kept.append(libc.malloc(64))
        ctypes.memset(blocks[-1], 1, 64 * 1024)  # resident
    for block in blocks:
        libc.free(block)
    before = _resident_mib()
    assert backend_ort.return_freed_heap()
    assert before - _resident_mib() > 32
    for block in kept:
        libc.free(block)


def test_it_calls_malloc_trim_and_says_false_where_there_is_none(monkeypatch):
    calls = []

    class Trim:  # a ctypes function: typed by attributes, then called
        argtypes = restype = None

        def __call__(self, pad: int) -> int:
            calls.append(pad)
            return 1

    class Libc:
        malloc_trim = Trim()

    monkeypatch.setattr(sys, "platform", "linux")
    assert backend_ort.return_freed_heap(load=lambda name: Libc()) and calls == [0]

    def missing(name: str):
        raise OSError(f"{name}: cannot open shared object file")

    assert not backend_ort.return_freed_heap(load=missing)
    assert not backend_ort.return_freed_heap(load=lambda name: object())  # a C library without malloc_trim
    monkeypatch.setattr(sys, "platform", "darwin")
    assert not backend_ort.return_freed_heap(load=lambda name: Libc()) and calls == [0]


def test_loading_gives_it_back_once_every_session_is_built(tmp_path, tiny_llama, monkeypatch):
    bundle = tmp_path / "fp32-slots.edgec"
    build(tiny_llama, bundle, build_settings(**KV))
    sessions, seen = [], []
    built = backend_ort.OrtGraph.__init__

    def counting(self, *args, **kwargs):
        built(self, *args, **kwargs)
        sessions.append(self)

    monkeypatch.setattr(backend_ort.OrtGraph, "__init__", counting)
    monkeypatch.setattr(backend_ort, "return_freed_heap", lambda: seen.append(len(sessions)) or True)
    Model.load(bundle, threads=1)
    assert len(sessions) == 2  # the decode graph and the prompt-chunk graph
    assert seen == [2]
