"""Helpers for the hostile-input tests: copies of the tiny bundle that an attacker has edited (hashes recomputed,
as an attacker would), and a Linux inotify watch that sees any read of a file outside the bundle — by Python,
ONNX Runtime's C++ or the tokenizers' Rust alike."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest

IN_ACCESS, IN_OPEN, IN_NONBLOCK = 0x1, 0x20, 0o4000


def copy_bundle(bundle: Path, where: Path) -> Path:
    copy = where / "copy.edgec"
    shutil.copytree(bundle, copy)
    return copy


def read_manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def write_manifest(bundle: Path, manifest: dict) -> None:
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def edit_manifest(bundle: Path, change) -> dict:
    """Apply ``change(manifest)`` in place and write the result (an attacker who rewrote the manifest)."""
    manifest = read_manifest(bundle)
    change(manifest)
    write_manifest(bundle, manifest)
    return manifest


def file_entry(path: Path) -> dict:
    data = path.read_bytes()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def rehash(bundle: Path, *names: str) -> None:
    """Recompute the manifest entries of ``names`` (the attacker's bookkeeping after changing those files)."""
    manifest = read_manifest(bundle)
    for name in names:
        manifest["files"][name] = file_entry(bundle / name)
    write_manifest(bundle, manifest)


class FileWatch:
    """Every open or read of a file in the watched folders, seen by the kernel (so C and Rust code count)."""

    def __init__(self, *folders: Path) -> None:
        if not hasattr(os, "uname") or os.uname().sysname != "Linux":
            pytest.skip("the read watch uses Linux inotify")
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(IN_NONBLOCK)
        if self.fd < 0:
            pytest.skip("inotify is not available here")
        self.folders = {}
        for folder in folders:
            handle = self.libc.inotify_add_watch(self.fd, str(folder).encode(), IN_OPEN | IN_ACCESS)
            if handle < 0:
                pytest.skip(f"cannot watch {folder}")
            self.folders[handle] = folder

    def events(self) -> list[str]:
        """Files opened or read since the last call (a folder's own name when it was listed)."""
        seen = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return seen
            offset = 0
            while offset < len(data):
                handle, _, _, length = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16 : offset + 16 + length].rstrip(b"\0").decode()
                seen.append(str(self.folders[handle] / name) if name else str(self.folders[handle]))
                offset += 16 + length

    def close(self) -> None:
        os.close(self.fd)


def fifo_in_place_of(path: Path) -> Path:
    """``path`` replaced by a named pipe with no writer: a plain open() of it waits forever."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def raised_within(seconds: float, call, fifo: Path) -> BaseException | None:
    """What ``call()`` raised (None if it returned), failing the test when it takes longer than ``seconds`` — as
    it would waiting on ``fifo`` — instead of hanging the suite: the pipe then gets a writer so the call ends."""
    import threading

    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001  (handed to the test)
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the waiting open returns; the call ends
        thread.join(seconds)
        pytest.fail(f"the call waited on the named pipe {fifo.name} for more than {seconds} s")
    return outcome[0]
