"""edgec pack / unpack: one archive to an offline machine, and an offline install from it."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgec.cli import main
from edgec.errors import BundleError
from edgec.pack import pack, unpack


def test_pack_unpack_round_trip_is_exact_and_reproducible(tiny_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    first, second = pack(tiny_bundle, tmp_path / "a.tar"), pack(tiny_bundle, tmp_path / "b.tar")
    assert first.read_bytes() == second.read_bytes()
    with tarfile.open(first) as archive:
        assert {m.mtime for m in archive.getmembers()} == {1700000000}
    bundle = unpack(first, tmp_path / "out")
    for path in tiny_bundle.iterdir():
        assert (bundle / path.name).read_bytes() == path.read_bytes()
    result = CliRunner().invoke(main, ["verify", str(bundle)])
    assert result.exit_code == 0, result.output


def _rewrite(archive_path, out_path, change):
    """Copy a tar, letting change(name, data) alter or add members."""
    with tarfile.open(archive_path) as source, tarfile.open(out_path, "w") as target:
        for member in source.getmembers():
            data = source.extractfile(member).read()
            name, data = change(member.name, data)
            entry = tarfile.TarInfo(name)
            entry.size = len(data)
            target.addfile(entry, io.BytesIO(data))
    return out_path


def test_unpack_names_a_tampered_file_and_leaves_nothing(tiny_bundle, tmp_path):
    good = pack(tiny_bundle, tmp_path / "good.tar")

    def flip(name, data):
        if name.endswith("tokenizer.json"):
            data = data[:100] + bytes([data[100] ^ 1]) + data[101:]
        return name, data

    bad = _rewrite(good, tmp_path / "bad.tar", flip)
    with pytest.raises(BundleError, match="tokenizer.json .* differ"):
        unpack(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_unpack_refuses_path_traversal(tiny_bundle, tmp_path):
    good = pack(tiny_bundle, tmp_path / "good.tar")
    evil = _rewrite(good, tmp_path / "evil.tar", lambda n, d: ("../evil.txt" if n == "PACK.json" else n, d))
    result = CliRunner().invoke(main, ["unpack", str(evil), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "refusing archive member '../evil.txt'" in result.stderr
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "out").exists()
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"not a tar at all" * 10)
    with pytest.raises(BundleError, match="not a readable tar"):
        unpack(garbage, tmp_path / "out")


@pytest.mark.slow  # pip installs every wheel into a fresh venv: the slow tier
def test_pack_with_wheels_installs_and_runs_offline(tiny_bundle, tmp_path):
    """pack --wheels → unpack → install into a fresh venv with pip --no-index → generate."""
    archive = tmp_path / "deploy.tar"
    result = CliRunner().invoke(main, ["pack", str(tiny_bundle), "-o", str(archive), "--wheels"])
    assert result.exit_code == 0, result.output + result.stderr
    bundle = unpack(archive, tmp_path / "site")
    site = tmp_path / "site"
    wheels = sorted(p.name.split("-")[0].lower() for p in (site / "wheels").glob("*.whl"))
    for needed in ("edgec", "numpy", "onnxruntime", "tokenizers"):
        assert needed in wheels
    install = subprocess.run(
        ["sh", str(site / "install.sh")],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PIP_NO_INDEX": "1"},
    )
    assert install.returncode == 0, install.stdout + install.stderr
    run = subprocess.run(
        [str(site / ".venv/bin/python"), "-m", "edgec.runtime", str(bundle), "def f(x):", "-n", "5"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    from edgec.runtime import Model

    assert run.stdout == Model.load(bundle).generate("def f(x):", max_new_tokens=5) + "\n"
    listing = subprocess.run([str(site / ".venv/bin/python"), "-m", "pip", "list"], capture_output=True, text=True)
    assert "torch" not in listing.stdout and "transformers" not in listing.stdout


def test_pack_carries_the_runtime_the_bundle_needs(tiny_bundle, tmp_path, monkeypatch):
    """A CUDA bundle's pack carries onnxruntime-gpu (the `cuda` extra), not the CPU onnxruntime; a TensorRT-RTX
    bundle's carries tensorrt-rtx. (pip download is stood in for: what matters is what it is asked for.)"""
    from edgec import pack as pack_module

    asked = []

    def fake_pip(arguments):
        asked.append(arguments)
        folder = Path(arguments[arguments.index("-w" if arguments[0] == "wheel" else "-d") + 1])
        (folder / f"stand_in_{len(asked)}-1.0-py3-none-any.whl").write_bytes(b"wheel")

    monkeypatch.setattr(pack_module, "_pip", fake_pip)
    for providers, library, wanted, unwanted in (
        (["CUDAExecutionProvider"], "onnxruntime", " onnxruntime-gpu>=", " onnxruntime>="),
        ([], "tensorrt_rtx", " tensorrt-rtx>=", " onnxruntime"),
    ):
        bundle = shutil.copytree(tiny_bundle, tmp_path / f"{library}.edgec")
        data = json.loads((bundle / "manifest.json").read_text())
        data["runtime"] |= {"providers": providers, "library": library}
        (bundle / "manifest.json").write_text(json.dumps(data))
        asked.clear()
        pack(bundle, tmp_path / f"{library}.tar", wheels=True, python="3.12", platform="manylinux_2_28_x86_64")
        download = " " + " ".join(next(arguments for arguments in asked if arguments[0] == "download"))
        assert wanted in download and unwanted not in download, download
