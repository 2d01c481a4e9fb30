"""A build killed at any moment, or failing to write, leaves nothing at -o; the next build cleans up."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from edgec.build import STAGES
from edgec.cli import main
from edgec.errors import BundleError

KILL_AT_STAGE = """
import os, signal, sys
from edgec.build import BuildSettings, build
stage = sys.argv[3]
def progress(name, *steps):  # steps: (done, total) inside a long stage
    if name == stage and not steps:
        os.kill(os.getpid(), signal.SIGKILL)
build(sys.argv[1], sys.argv[2], BuildSettings(context=64), progress=progress)
"""


# the default tier kills one stage (the last, which renames into place); the slow tier every other one
@pytest.mark.parametrize("stage", [s if s == "bundle" else pytest.param(s, marks=pytest.mark.slow) for s in STAGES])
def test_kill_9_at_each_stage_leaves_nothing(stage, tiny_llama, tmp_path):
    out = tmp_path / "b.edgec"
    done = subprocess.run([sys.executable, "-c", KILL_AT_STAGE, str(tiny_llama), str(out), stage])
    assert done.returncode == -signal.SIGKILL
    assert not out.exists()
    stale = list(tmp_path.glob(".b.edgec.tmp-*"))
    assert len(stale) == 1  # what the killed build was writing, never at -o
    if stage == STAGES[-1]:
        # the next build removes the stale folder and succeeds
        result = CliRunner().invoke(main, ["build", str(tiny_llama), "-o", str(out), "--context", "64"])
        assert result.exit_code == 0, result.output
        assert (out / "manifest.json").is_file() and not list(tmp_path.glob(".b.edgec.tmp-*"))


def test_kill_9_mid_write(tiny_llama, tmp_path):
    """A kill at an arbitrary moment (here: while weights are being written or validated)."""
    out = tmp_path / "b.edgec"
    process = subprocess.Popen(
        [sys.executable, "-m", "edgec.cli", "build", str(tiny_llama), "-o", str(out), "--context", "64"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while not list(tmp_path.glob(".b.edgec.tmp-*/model.onnx*")) and time.time() < deadline:
        if process.poll() is not None:
            break
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    if process.returncode == -signal.SIGKILL:
        assert not out.exists()
    else:  # it finished before the kill landed: then the bundle is whole
        assert process.returncode == 0 and (out / "manifest.json").is_file()


def test_disk_full_is_one_clear_line(tiny_llama, tmp_path, monkeypatch):
    import onnx_ir

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "b.edgec" / "model.onnx.data"))

    monkeypatch.setattr(onnx_ir, "save", full)
    out = tmp_path / "b.edgec"
    result = CliRunner().invoke(main, ["build", str(tiny_llama), "-o", str(out), "--context", "64"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0] and "nothing was written" in lines[0]
    assert not out.exists() and not list(tmp_path.glob(".b.edgec.tmp-*"))


@pytest.mark.parametrize("free_mb", [3, 5000])
def test_a_write_that_fails_without_a_reason_on_a_full_disk_says_so(tmp_path, monkeypatch, free_mb):
    """numpy's ``tofile`` (the weights' writer) fails on a full disk with no errno: "problem writing element N to
    file" (the CI's slow tier once). Nearly nothing free: the line says the disk is full; room left: it claims
    nothing it does not know."""
    import shutil

    from edgec import bundle

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(bundle.shutil, "disk_usage", lambda path: usage._replace(free=free_mb << 20))
    out = tmp_path / "b.edgec"
    with pytest.raises(BundleError) as raised:
        with bundle.atomic_folder(out):
            raise OSError("problem writing element 719872 to file")
    message = str(raised.value)
    assert "problem writing element 719872 to file" in message and "nothing was written" in message
    assert ("the disk is full" in message) == (free_mb == 3), message
    assert free_mb != 3 or "(3 MB free at" in message
    assert not out.exists() and not list(tmp_path.glob(".b.edgec.tmp-*"))


@pytest.mark.parametrize("short_by", [1, 0])
def test_a_build_whose_weights_cannot_fit_is_refused_before_it_reads_them(tiny_llama, tmp_path, monkeypatch, short_by):
    """Free space one byte short of the weights' lower bound: one line, before any weight is read, nothing
    written. Exactly enough: the build goes on, and its bundle is at least that large (the bound holds)."""
    import shutil

    from edgec import load
    from edgec.build import BuildSettings, plan_build, weights_on_disk

    shape = load.inspect_source(tiny_llama, False)["shape"]
    needed = weights_on_disk(plan_build(BuildSettings(context=64), shape, shape.max_context))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=needed - short_by))
    if short_by:

        def no_reading(*args, **kwargs):
            raise AssertionError("weights read before the disk was checked")

        monkeypatch.setattr(load, "load_model", no_reading)
    out = tmp_path / "b.edgec"
    result = CliRunner().invoke(main, ["build", str(tiny_llama), "-o", str(out), "--context", "64"])
    if short_by:
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{tmp_path} has " in lines[0], lines
        assert f"weights alone take {needed / 1e6:,.1f} MB" in lines[0] and "nothing was written" in lines[0]
        assert not out.exists() and not list(tmp_path.glob(".b.edgec.tmp-*"))
    else:
        assert result.exit_code == 0, result.output
        assert sum(path.stat().st_size for path in out.rglob("*") if path.is_file()) >= needed


@pytest.mark.slow  # two full builds
def test_two_builds_are_byte_identical(tiny_llama, tmp_path, monkeypatch):
    """One build in this process, one in a fresh one: the same bytes, and mtimes from SOURCE_DATE_EPOCH."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    first, second = tmp_path / "one.edgec", tmp_path / "two.edgec"
    result = CliRunner().invoke(main, ["build", str(tiny_llama), "-o", str(first), "--context", "64"])
    assert result.exit_code == 0, result.output
    done = subprocess.run(
        [sys.executable, "-m", "edgec.cli", "build", str(tiny_llama), "-o", str(second), "--context", "64"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
        assert (first / name).stat().st_mtime == 1700000000
    assert json.loads((first / "manifest.json").read_text())["files"]
