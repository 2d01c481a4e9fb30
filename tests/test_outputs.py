"""Where edgec writes: --overwrite replaces only an edgec bundle or an empty folder (``edgec build -o . --overwrite``
once emptied the working directory), one writer per output at a time (a second build to the same -o once deleted
the first one's temporary folder), and an output folder edgec cannot write is one line (issue 15.6, 15.8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from edgec.bundle import atomic_file, atomic_folder
from edgec.cli import main
from edgec.errors import BundleError


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


def test_overwrite_dot_leaves_the_working_directory_alone(tiny_llama, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "precious.txt").write_text("years of work")
    monkeypatch.chdir(work)
    line = one_error_line(invoke("build", tiny_llama, "-o", ".", "--overwrite", "--context", "64"))
    assert "not an edgec bundle" in line
    assert (work / "precious.txt").read_text() == "years of work"
    assert sorted(os.listdir(tmp_path)) == ["work"]  # no temporary folder or lock left beside it


@pytest.mark.parametrize("kind", ["folder", "file", "link", "foreign-manifest"])
def test_overwrite_refuses_what_is_not_a_bundle(tmp_path, kind):
    target = tmp_path / "out"
    if kind == "folder":
        target.mkdir()
        (target / "notes.txt").write_text("keep")
    elif kind == "file":
        target.write_text("keep")
    elif kind == "link":
        (tmp_path / "elsewhere").mkdir()
        os.symlink(tmp_path / "elsewhere", target)
    else:  # a web app's manifest.json is not an edgec manifest
        target.mkdir()
        (target / "manifest.json").write_text(json.dumps({"name": "app", "icons": []}))
    with pytest.raises(BundleError, match="refusing to replace"):
        with atomic_folder(target, overwrite=True):
            pass
    assert os.path.lexists(target) and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("kind", ["empty", "bundle"])
def test_overwrite_replaces_a_bundle_or_an_empty_folder(tmp_path, kind):
    target = tmp_path / "out"
    target.mkdir()
    if kind == "bundle":
        (target / "manifest.json").write_text(json.dumps({"format_version": 1, "edgec_version": "0", "files": {}}))
        (target / "model.onnx").write_text("old")
    with atomic_folder(target, overwrite=True) as folder:
        (folder / "new.txt").write_text("new")
    assert sorted(os.listdir(target)) == ["new.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_real_bundle_is_replaced_by_build_overwrite(tiny_bundle, tiny_llama, tmp_path):
    import shutil

    out = tmp_path / "b.edgec"
    shutil.copytree(tiny_bundle, out)
    result = invoke("build", tiny_llama, "-o", out, "--overwrite", "--context", "64")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["build_settings"]["context"] == 64


HOLD_THE_OUTPUT = """
import sys
from pathlib import Path
from edgec.bundle import atomic_folder
with atomic_folder(sys.argv[1]) as folder:
    (folder / "first.txt").write_text("written by the first writer")
    print(folder, flush=True)
    sys.stdin.readline()  # hold the output until told to finish
"""


def test_a_second_writer_to_the_same_output_fails_without_touching_the_first(tiny_llama, tmp_path):
    out = tmp_path / "b.edgec"
    first = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_OUTPUT, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        temporary = first.stdout.readline().strip()
        assert temporary and os.path.isdir(temporary)
        with pytest.raises(BundleError, match="another edgec is writing"):
            with atomic_folder(out):
                pass
        line = one_error_line(invoke("build", tiny_llama, "-o", out, "--context", "64"))
        assert "another edgec is writing" in line
        assert os.path.isfile(os.path.join(temporary, "first.txt")), "the second writer removed the first's files"
        first.stdin.write("done\n")
        first.stdin.flush()
        assert first.wait(timeout=60) == 0
    finally:
        first.kill()
    assert (out / "first.txt").read_text() == "written by the first writer"
    assert sorted(os.listdir(tmp_path)) == ["b.edgec"]  # the lock file is gone too


def test_a_lock_held_by_a_killed_writer_is_free(tmp_path):
    out = tmp_path / "b.edgec"
    first = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_OUTPUT, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    first.stdout.readline()
    first.kill()  # SIGKILL: no cleanup runs; the kernel drops the lock
    first.wait()
    assert list(tmp_path.glob(".b.edgec.tmp-*"))
    with atomic_folder(out) as folder:
        (folder / "second.txt").write_text("ok")
    assert sorted(os.listdir(tmp_path)) == ["b.edgec"]


def _unwritable_folder(tmp_path):
    if os.geteuid() != 0:
        folder = tmp_path / "readonly"
        folder.mkdir()
        folder.chmod(0o555)
        return folder
    if os.path.isdir("/sys") and not os.access("/sys", os.W_OK | os.X_OK) or _cannot_create_in("/sys"):
        return "/sys"  # root writes anywhere on a normal file system; sysfs refuses new files even to root
    pytest.skip("no folder here that this user cannot write")


def _cannot_create_in(folder) -> bool:
    try:
        os.close(os.open(os.path.join(folder, ".edgec-probe"), os.O_CREAT | os.O_WRONLY, 0o644))
    except OSError:
        return True
    os.unlink(os.path.join(folder, ".edgec-probe"))
    return False


def test_an_output_folder_edgec_cannot_write_is_one_line(tiny_bundle, tiny_llama, tmp_path):
    folder = _unwritable_folder(tmp_path)
    line = one_error_line(invoke("build", tiny_llama, "-o", f"{folder}/b.edgec", "--context", "64"))
    assert "cannot write in" in line
    line = one_error_line(invoke("pack", tiny_bundle, "-o", f"{folder}/p.tar"))
    assert "cannot write in" in line
    archive = tmp_path / "p.tar"
    assert invoke("pack", tiny_bundle, "-o", archive).exit_code == 0
    assert "cannot write in" in one_error_line(invoke("unpack", archive, "-o", f"{folder}/site"))


def test_pack_removes_what_a_killed_pack_left(tiny_bundle, tmp_path):
    stale = tmp_path / ".p.tar.tmp-abc123"
    stale.write_bytes(b"half an archive")
    assert invoke("pack", tiny_bundle, "-o", tmp_path / "p.tar").exit_code == 0
    assert sorted(os.listdir(tmp_path)) == ["p.tar"]


def record_syncs_and_renames(monkeypatch) -> list[tuple[str, ...]]:
    """("sync", path) for each ``os.fsync`` (the path its handle names) and ("rename", source, target) for each
    ``os.replace``, in the order they happen, every path resolved (as /proc names files); both still do their work."""
    events: list[tuple[str, ...]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(handle: int) -> None:
        events.append(("sync", os.readlink(f"/proc/self/fd/{handle}")))
        real_fsync(handle)

    def replace(source, target) -> None:
        events.append(("rename", os.path.realpath(source), os.path.realpath(target)))
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


names_open_files = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an open file through /proc")


@names_open_files
@pytest.mark.parametrize("replacing", [False, True])
def test_a_bundle_is_on_the_disk_before_its_name_is(tmp_path, monkeypatch, replacing):
    """Every file and folder of a new bundle is synced before the rename that publishes it, and the folder it lands
    in after: a power cut leaves the old bundle or the whole new one, and the new one's pages are clean (a dirty
    one may stay mapped after the runtime's page-out)."""
    events = record_syncs_and_renames(monkeypatch)
    tmp_path = tmp_path.resolve()
    out = tmp_path / "b.edgec"
    if replacing:
        with atomic_folder(out) as folder:
            (folder / "manifest.json").write_text(json.dumps({"format_version": 1, "edgec_version": "0", "files": {}}))
        events.clear()
    with atomic_folder(out, overwrite=True) as folder:
        (folder / "model.onnx.data").write_bytes(b"w" * 100_000)
        (folder / "plugins").mkdir()
        (folder / "plugins" / "op.json").write_text("{}")
    published = next(i for i, event in enumerate(events) if event[0] == "rename" and event[2] == str(out))
    temporary = events[published][1]
    synced_before = {event[1] for event in events[:published] if event[0] == "sync"}
    expected = {temporary, f"{temporary}/model.onnx.data", f"{temporary}/plugins", f"{temporary}/plugins/op.json"}
    assert expected <= synced_before, expected - synced_before
    assert ("sync", str(tmp_path)) in events[published + 1 :]
    assert (out / "plugins" / "op.json").read_text() == "{}"


@names_open_files
def test_an_archive_is_on_the_disk_before_its_name_is(tmp_path, monkeypatch):
    events = record_syncs_and_renames(monkeypatch)
    tmp_path = tmp_path.resolve()
    out = tmp_path / "b.tar"
    with atomic_file(out) as temporary:
        temporary.write_bytes(b"archive")
    assert events == [("sync", str(temporary)), ("rename", str(temporary), str(out)), ("sync", str(tmp_path))]
