"""Carry the GPU check to a machine that takes little per call (this workplace's `device` tool: 64 MiB a call, the
working tree included, and no network there): the pack and onnxruntime-gpu, compressed as one stream and cut into
parts, one part per call, with one script that every call runs.

    python benchmarks/gpu_prepare.py --no-short --compressed --rtx '' --no-wheels   # one 16K bundle + a compressed one
    python benchmarks/gpu_carry.py                                                  # → .carry/ (git-ignored)
    # then one call per part while the machine stays warm, each carrying [".carry/receive", ".carry/pKK"]:
    #   bash .carry/receive/receive.sh
    # each call adds its part; the call that completes the set checks it (sha256), unpacks it and runs
    # benchmarks/gpu_check.py from the working tree with --no-install (results.json and check.log in $OUT).

Why not gpu_prepare.py's packs with wheels: the onnxruntime-gpu wheel alone is 256 MB (zip), and the two fp16
bundles are 2 × 263 MiB. One xz stream with a dictionary larger than a bundle stores the second bundle's weights as
a copy of the first's (the compressed-cache graph changes attention, not the weights): ~430 MB in all, 8 calls.
The machine's own Python supplies numpy, tokenizers and the CUDA libraries (nvidia-* wheels); the stream carries
onnxruntime-gpu's files as its wheel holds them, put first on PYTHONPATH there.
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from edgec.bundle import sha256_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PACK = HERE / "out" / "gpu-pack"
WHEELS = HERE / "out" / "gpu-wheels"
CARRY = ROOT / ".carry"  # ignored through .git/info/exclude (the device tool carries ignored paths only when named)
PART_MIB = 54  # 54 MiB + the working tree (~7 MiB) stays under a call's 64 MiB
DICTIONARY = 512 << 20  # larger than one bundle: the second bundle's weights become back-references to the first's
ORT_GPU = "onnxruntime-gpu==1.31.1"  # CUDA 13 + cuDNN 9: what the H200 image's nvidia-* wheels provide


class CarryError(Exception):
    """One `error:` line, exit 2."""


def ort_gpu_wheel(folder: Path, python: str, platform: str, requirement: str = ORT_GPU) -> Path:
    """The onnxruntime-gpu wheel for the device's Python and platform (downloaded once, kept in ``folder``)."""
    found = sorted(folder.glob("onnxruntime_gpu-*.whl"))
    if found:
        return found[-1]
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(folder),
               "--implementation", "cp", "--python-version", python, "--platform", platform, requirement]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    found = sorted(folder.glob("onnxruntime_gpu-*.whl"))
    if done.returncode or not found:
        raise CarryError(f"pip download {requirement} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return found[-1]


def write_stream(pack: Path, wheel: Path, stream_path: Path) -> None:
    """One tar, xz-compressed with a large dictionary: site/ (the wheel's files) then gpu-pack/ (the pack)."""
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 1, "dict_size": DICTIONARY}]
    with lzma.LZMAFile(stream_path, "wb", format=lzma.FORMAT_XZ, filters=filters) as sink:
        with tarfile.open(fileobj=sink, mode="w|") as tar, zipfile.ZipFile(wheel) as archive:
            for member in archive.infolist():
                if member.is_dir():
                    continue
                info = tarfile.TarInfo(f"site/{member.filename}")
                info.size, info.mode = member.file_size, 0o755 if member.filename.endswith(".so") else 0o644
                with archive.open(member) as source:
                    tar.addfile(info, source)
            tar.add(pack, arcname="gpu-pack", filter=_without_check_outputs)


def _without_check_outputs(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    # a check run here (dry run) leaves gpu-pack/check/: its venv and unpacked bundles are not the pack
    return None if info.name == "gpu-pack/check" or info.name.startswith("gpu-pack/check/") else info


def cut(stream_path: Path, out: Path, part_bytes: int) -> list[Path]:
    """``out/pKK/part.KK``: one folder per call (the device tool carries named paths)."""
    parts = []
    with open(stream_path, "rb") as source:
        while block := source.read(part_bytes):
            index = len(parts)
            folder = out / f"p{index:02d}"
            folder.mkdir(parents=True)
            path = folder / f"part.{index:02d}"
            path.write_bytes(block)
            parts.append(path)
    return parts


RECEIVE = r"""# Written by benchmarks/gpu_carry.py: run from the working tree's root on the device machine,
# once per call. Each call adds the part it carries; the call that completes the set checks it, unpacks it
# and runs the check.
set -u
repo=$(pwd)
work=${EDGEC_CARRY_WORK:-/tmp/edgec-gpu}
out=${OUT:-$work/out}
mkdir -p "$work/parts" "$out"
cp .carry/p*/part.* "$work/parts/" 2>/dev/null
if [ ! -f "$work/unpacked" ]; then
  have=$(ls "$work/parts" | wc -l)
  if [ "$have" -lt @PARTS@ ]; then echo "parts here: $have of @PARTS@"; exit 0; fi
  got=$(cat "$work"/parts/part.* | sha256sum | cut -d' ' -f1)
  if [ "$got" != "@SHA256@" ]; then
    echo "error: the @PARTS@ parts do not add up to the stream (damaged part)"; exit 3
  fi
  unxz="import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 22)"
  cat "$work"/parts/part.* | python3 -c "$unxz" | tar -xf - -C "$work" || { echo "error: unpacking failed"; exit 3; }
  touch "$work/unpacked"
  rm -rf "$work/parts"
fi
# onnxruntime's preload_dlls looks for the CUDA wheels beside itself (site/nvidia): point that at the image's own
find="import glob, site; print(([d for r in site.getsitepackages() for d in glob.glob(r + '/nvidia')] + [''])[0])"
nvidia=$(python3 -c "$find" 2>/dev/null)
if [ -n "$nvidia" ] && [ ! -e "$work/site/nvidia" ]; then ln -s "$nvidia" "$work/site/nvidia"; fi
export PYTHONPATH="$work/site:$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
python3 "$repo/benchmarks/gpu_check.py" --pack "$work/gpu-pack" --work "$work/check" --no-install \
  --budget @BUDGET@ --out "$out/results.json" "$@" 2>&1 | tee "$out/check.log"
exit "${PIPESTATUS[0]}"
"""


def write_receive(out: Path, parts: int, sha256: str, budget: float) -> Path:
    script = out / "receive" / "receive.sh"
    script.parent.mkdir(parents=True)
    text = RECEIVE.replace("@PARTS@", str(parts)).replace("@SHA256@", sha256).replace("@BUDGET@", f"{budget:.0f}")
    script.write_text(text)
    return script


def carry(pack: Path, wheel: Path, out: Path, part_bytes: int, budget: float) -> list[Path]:
    if not (pack / "PREPARED.json").is_file():
        raise CarryError(f"{pack} holds no PREPARED.json: make it with benchmarks/gpu_prepare.py --no-wheels")
    if not zipfile.is_zipfile(wheel):
        raise CarryError(f"{wheel} is not a wheel")
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    stream = staging / "stream.tar.xz"
    write_stream(pack, wheel, stream)
    parts = cut(stream, staging, part_bytes)
    write_receive(staging, len(parts), sha256_file(stream), budget)
    stream.unlink()
    shutil.rmtree(out, ignore_errors=True)
    staging.replace(out)
    return [out / path.relative_to(staging) for path in parts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pack", type=Path, default=PACK, help="the pack folder (gpu_prepare.py --no-wheels)")
    parser.add_argument("--wheel", type=Path, default=None, help=f"onnxruntime-gpu wheel [default: {ORT_GPU}]")
    parser.add_argument("--out", type=Path, default=CARRY, help="where the parts go (ignored by git)")
    parser.add_argument("--part-mib", type=float, default=PART_MIB, help="MiB per part (one part per call)")
    parser.add_argument("--budget", type=float, default=400, help="the check's --budget on the device (seconds)")
    parser.add_argument("--python", default="3.12", help="the device's Python (major.minor)")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64", help="its pip platform tag")
    args = parser.parse_args(argv)
    try:
        wheel = args.wheel or ort_gpu_wheel(WHEELS, args.python, args.platform)
        print(f"compressing {args.pack.name} and {wheel.name} (minutes: one xz stream, 512 MiB dictionary) …")
        parts = carry(args.pack, wheel, args.out, int(args.part_mib * 2**20), args.budget)
    except CarryError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    total = sum(part.stat().st_size for part in parts)
    print(f"{len(parts)} parts, {total / 2**20:,.0f} MiB in {args.out}; one call per part, each carrying")
    print(f'[".carry/receive", ".carry/pKK"] (KK = 00 … {len(parts) - 1:02d}), command: bash .carry/receive/receive.sh')
    return 0


if __name__ == "__main__":
    sys.exit(main())
