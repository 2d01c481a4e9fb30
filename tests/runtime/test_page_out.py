"""A quantized bundle's mapped weights file, once its sessions packed their own forms: its pages go back to the
system (``edgec.runtime.page_out``), nothing it computes changes, and a page a kernel wrote to keeps its bytes."""

from __future__ import annotations

import mmap
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from edgec.build import BuildSettings, build
from edgec.bundle import atomic_folder
from edgec.runtime import Model, backend_ort, page_out

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise: Linux")


def resident_kib(inside: Path) -> int:
    """KiB of this process's resident pages in mappings of files under ``inside`` (/proc/self/smaps)."""
    total, current = 0, None
    prefix = str(inside.resolve())
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if match := re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line):
            current = match[1]
        elif line.startswith("Rss:") and current and current.startswith(prefix):
            total += int(line.split()[1])
    return total


def test_mapped_files_in_the_folder_give_their_pages_back_and_read_the_same(tmp_path):
    inside, outside = tmp_path / "bundle", tmp_path / "elsewhere"
    data = np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8)
    with atomic_folder(inside) as folder:  # the builds' writer: a page not yet on the disk would not go back
        data.tofile(folder / "model.onnx.data")
    outside.mkdir()
    with open(outside / "model.onnx.data", "wb") as file:
        data.tofile(file)
        file.flush()
        os.fsync(file.fileno())
    with open(inside / "model.onnx.data", "rb") as one, open(outside / "model.onnx.data", "rb") as other:
        mapped = mmap.mmap(one.fileno(), 0, access=mmap.ACCESS_COPY)  # private and writable, as ONNX Runtime maps
        kept = mmap.mmap(other.fileno(), 0, access=mmap.ACCESS_READ)
    view, kept_view = np.frombuffer(mapped, np.uint8), np.frombuffer(kept, np.uint8)
    written = view[: 2 * mmap.PAGESIZE]
    written[:] = 7  # a page a kernel wrote to: its own copy now
    assert int(view.sum(dtype=np.int64)) and int(kept_view.sum(dtype=np.int64))  # every page read: resident
    assert resident_kib(inside) >= 4000 and resident_kib(outside) >= 4000

    advised = page_out.page_out_mapped_files(inside)

    assert advised >= data.nbytes  # asked for the whole mapping, and taken
    assert resident_kib(inside) <= 400  # the file's pages are back with the system; the two written ones may stay
    assert resident_kib(outside) >= 4000  # a file elsewhere is not the bundle's
    assert (written == 7).all()  # reclaimed, never discarded
    assert np.array_equal(view[2 * mmap.PAGESIZE :], data[2 * mmap.PAGESIZE :])  # read again from the file
    del view, kept_view, written
    mapped.close(), kept.close()


@pytest.fixture(scope="module")
def int4_bundle(tmp_path_factory, tiny_llama) -> Path:
    folder = tmp_path_factory.mktemp("page_out") / "int4.edgec"
    build(tiny_llama, folder, BuildSettings(weights="int4", context=64, prefill_chunk=16))
    return folder


def test_a_quantized_bundle_pages_out_once_its_sessions_are_open_and_computes_the_same(int4_bundle, monkeypatch):
    """How much goes back is the first test's (a 4 MB file): this bundle's whole file is 19 pages, and the kernel
    skips a page another CPU faulted in a moment ago (still in that CPU's batch, not yet on a list it reclaims
    from) — a full test run once kept all 16 of the resident ones."""
    ids = list(range(3, 40))
    real, mapped = page_out.page_out_mapped_files, []

    def after_opening(folder: Path) -> int:
        mapped.append(resident_kib(folder))  # the sessions have mapped the file and packed from it
        return real(folder)

    monkeypatch.setattr(page_out, "page_out_mapped_files", after_opening)
    paged = Model.load(int4_bundle)
    assert len(mapped) == 1 and mapped[0] > 0
    first = paged.logprobs(ids)
    monkeypatch.setattr(page_out, "page_out_mapped_files", lambda folder: 0)
    kept = Model.load(int4_bundle)  # the pages left resident
    assert np.array_equal(first, kept.logprobs(ids))
    assert np.array_equal(first, paged.logprobs(ids))  # and again, after the first call read back what it needs


def test_only_bundles_whose_kernels_pack_their_weights_page_out(int4_bundle, tiny_bundle, monkeypatch):
    calls = []
    monkeypatch.setattr(page_out, "page_out_mapped_files", lambda folder: calls.append(Path(folder)) or 0)
    Model.load(int4_bundle)
    assert calls == [int4_bundle]
    calls.clear()
    Model.load(tiny_bundle)  # fp32: its MatMuls read their mapped weights at every step
    assert calls == []
    assert backend_ort._packs_own_forms(int4_bundle, ["model.onnx"], None)
    assert not backend_ort._packs_own_forms(tiny_bundle, ["model.onnx"], None)
