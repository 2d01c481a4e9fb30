"""benchmarks/gpu_carry.py: the pack and a wheel cut into parts, and the device's side played here — parts arriving
one call at a time, the set checked, unpacked and handed to the check (which, with no nvidia-smi here, says so)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import benchmark_script

carry = benchmark_script("gpu_carry")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def pack_and_wheel(tmp_path):
    pack = tmp_path / "gpu-pack"
    (pack / "packs").mkdir(parents=True)
    (pack / "PREPARED.json").write_text(json.dumps({"packs": []}))
    (pack / "packs" / "bundle.tar").write_bytes(os.urandom(300_000))  # incompressible, like fp16 weights
    (pack / "check").mkdir()
    (pack / "check" / "left-by-a-dry-run").write_text("not the pack")
    wheel = tmp_path / "onnxruntime_gpu-0.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("onnxruntime/__init__.py", "__version__ = 'carried'\ndef get_available_providers():\n"
                         "    return ['CUDAExecutionProvider']\n")  # fmt: skip
        archive.writestr("onnxruntime/capi/libfake.so", b"\x7fELF" + bytes(1000))
    return pack, wheel


def _call(
    device_repo: Path, carried: list[Path], work: Path, out: Path, python_dir: Path | None = None
) -> subprocess.CompletedProcess:
    """One device call: the named paths replace theirs in the working tree, then the same command runs
    (``python_dir``: where the device's python3 is; by default this Python's)."""
    for path in carried:
        target = device_repo / ".carry" / path.name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(path, target)
    (device_repo / "benchmarks").mkdir(exist_ok=True)
    shutil.copy2(ROOT / "benchmarks" / "gpu_check.py", device_repo / "benchmarks" / "gpu_check.py")
    python_dir = python_dir or Path(sys.executable).parent
    env = {"PATH": f"{python_dir}:/usr/bin:/bin", "EDGEC_CARRY_WORK": str(work), "OUT": str(out)}
    if shutil.which("nvidia-smi", path=env["PATH"]):
        pytest.skip("a GPU machine: the check would run for real")
    python3 = python_dir / "python3"
    if not python3.exists():
        pytest.skip("no python3 beside this Python")
    return subprocess.run(["bash", ".carry/receive/receive.sh"], cwd=device_repo, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_parts_arrive_one_call_at_a_time_then_the_check_runs(pack_and_wheel, tmp_path):
    pack, wheel = pack_and_wheel
    out = tmp_path / "carry"
    parts = carry.carry(pack, wheel, out, part_bytes=120_000, budget=300)
    assert len(parts) == 3 and all(part.stat().st_size <= 120_000 for part in parts)
    assert sorted(p.name for p in out.iterdir()) == ["p00", "p01", "p02", "receive"]
    device, work, results = tmp_path / "device-repo", tmp_path / "work", tmp_path / "out"
    device.mkdir()
    for index, part in enumerate(parts[:-1]):
        done = _call(device, [out / "receive", part.parent], work, results)
        assert done.returncode == 0 and done.stdout.strip() == f"parts here: {index + 1} of 3", done.stderr
        assert not (work / "site").exists()
    done = _call(device, [out / "receive", parts[-1].parent], work, results)
    assert (work / "site" / "onnxruntime" / "capi" / "libfake.so").read_bytes()[:4] == b"\x7fELF"
    assert (work / "gpu-pack" / "packs" / "bundle.tar").read_bytes() == (pack / "packs" / "bundle.tar").read_bytes()
    assert not (work / "gpu-pack" / "check").exists()  # a dry run's leftovers do not travel
    # the carried onnxruntime comes first on the path; the check itself ran, and with no nvidia-smi here says so
    assert "onnxruntime carried ['CUDAExecutionProvider']" in done.stdout
    assert done.returncode == 2 and "error: no NVIDIA GPU here" in (results / "check.log").read_text()


def test_a_damaged_part_is_refused_and_nothing_unpacked(pack_and_wheel, tmp_path):
    pack, wheel = pack_and_wheel
    parts = carry.carry(pack, wheel, tmp_path / "carry", part_bytes=200_000, budget=300)
    damaged = bytearray(parts[0].read_bytes())
    damaged[100] ^= 1
    parts[0].write_bytes(bytes(damaged))
    device, work = tmp_path / "device-repo", tmp_path / "work"
    device.mkdir()
    _call(device, [tmp_path / "carry" / "receive", parts[0].parent], work, tmp_path / "out")
    done = _call(device, [tmp_path / "carry" / "receive", parts[1].parent], work, tmp_path / "out")
    assert done.returncode == 3 and "damaged part" in done.stdout and not (work / "site").exists()


def test_bad_inputs_are_one_line(pack_and_wheel, tmp_path, capsys):
    pack, wheel = pack_and_wheel
    assert carry.main(["--pack", str(tmp_path), "--wheel", str(wheel), "--out", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {tmp_path} holds no PREPARED.json")
    not_a_wheel = tmp_path / "x.whl"
    not_a_wheel.write_text("no")
    assert carry.main(["--pack", str(pack), "--wheel", str(not_a_wheel), "--out", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {not_a_wheel} is not a wheel"
    assert not (tmp_path / "c").exists()


def test_the_image_s_cuda_wheels_are_linked_where_onnxruntime_looks_first(pack_and_wheel, tmp_path):
    """onnxruntime-gpu's preload_dlls looks for the nvidia-* wheels beside itself: the device's own (in its Python's
    site-packages) are linked there."""
    pack, wheel = pack_and_wheel
    image = tmp_path / "image-python"  # a Python whose site-packages hold the CUDA wheels, as the H200 image's does
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(image)], check=True, timeout=120)
    [site] = image.glob("lib/python3*/site-packages")
    (site / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    [part] = carry.carry(pack, wheel, tmp_path / "carry", part_bytes=10**7, budget=300)
    device, work = tmp_path / "device-repo", tmp_path / "work"
    device.mkdir()
    done = _call(device, [tmp_path / "carry" / "receive", part.parent], work, tmp_path / "out", image / "bin")
    assert (work / "site" / "nvidia").is_symlink() and (work / "site" / "nvidia" / "cu13" / "lib").is_dir()
    assert "onnxruntime carried" in done.stdout
