"""``edgec pack`` / ``unpack``: one archive to carry a bundle (and, optionally, the runtime's wheels) to a machine
with no network; unpacking checks every file on the way out.

    ARCHIVE.tar
      PACK.json            what is inside
      NAME.edgec/...       the bundle
      wheels/*.whl         with --wheels: edgec, numpy, onnxruntime, tokenizers for the chosen Python/platform
      install.sh           with --wheels: creates .venv and installs from wheels/ with pip --no-index
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

from edgec.bundle import read_manifest, source_date_epoch, verify_hashes
from edgec.errors import BundleError, EdgecError

PACK_INFO = "PACK.json"
INSTALL_SH = """#!/bin/sh
# Install the edgec runtime from the wheels beside this script. Needs no network.
set -e
cd "$(dirname "$0")"
"${PYTHON:-python3}" -m venv .venv
.venv/bin/pip install --no-index --find-links wheels "edgec[runtime]"
echo "installed; try: .venv/bin/python -m edgec.runtime BUNDLE \\"Your prompt\\""
"""


class PackError(EdgecError):
    """Packing could not gather what the archive needs."""


def runtime_requirements() -> list[str]:
    """The runtime extra's requirements, as the installed edgec declares them."""
    requirements = metadata.requires("edgec") or []
    return [r.split(";")[0].strip() for r in requirements if 'extra == "runtime"' in r and "edgec" not in r]


def download_wheels(folder: Path, python: str | None, platform: str | None) -> list[str]:
    """edgec's own wheel (from its source tree) plus the runtime's dependencies for the given Python/platform."""
    folder.mkdir(parents=True, exist_ok=True)
    source = Path(__file__).resolve().parents[1]
    if not (source / "pyproject.toml").is_file():
        raise PackError("--wheels needs edgec installed from its source tree (pip install -e .)")
    _pip(["wheel", "--no-deps", "-q", "-w", str(folder), str(source)])
    target = ["--only-binary=:all:", "--implementation", "cp"]
    if python:
        target += ["--python-version", python]
    for tag in compatible_platforms(platform) if platform else []:
        target += ["--platform", tag]
    try:
        _pip(["download", "-q", "-d", str(folder), *target, *runtime_requirements()])
    except PackError as error:
        raise PackError(f"{error} (for Python {python or 'this one'}, platform {platform or 'this one'})") from None
    return sorted(p.name for p in folder.glob("*.whl"))


def compatible_platforms(platform: str) -> list[str]:
    """pip takes --platform literally; a glibc 2.Y machine also runs wheels tagged for any older manylinux."""
    legacy = {"manylinux1": 5, "manylinux2010": 12, "manylinux2014": 17}
    name, _, arch = platform.partition("_x86_64") if platform.endswith("_x86_64") else platform.rpartition("_")
    arch = "x86_64" if platform.endswith("_x86_64") else arch
    if name in legacy:
        newest = legacy[name]
    elif name.startswith("manylinux_2_") and name[len("manylinux_2_") :].isdigit():
        newest = int(name[len("manylinux_2_") :])
    else:
        return [platform]
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(newest, 4, -1)]
    return tags + [f"{old}_{arch}" for old, minor in legacy.items() if minor <= newest]


def _pip(arguments: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *arguments], capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PackError(f"pip {arguments[0]} failed: {last}")


def pack(
    bundle: str | Path, output: str | Path, wheels: bool = False, python: str | None = None, platform: str | None = None
) -> Path:
    """Write ``output`` (a tar); reproducible: sorted members, fixed owners, mtime = SOURCE_DATE_EPOCH or 0."""
    bundle, output = Path(bundle), Path(output)
    manifest = read_manifest(bundle)
    if bad := verify_hashes(bundle, manifest):
        raise BundleError(f"{', '.join(bad)} in {bundle} differ from the manifest; refusing to pack a damaged bundle")
    info = {"bundle": bundle.name, "edgec_version": manifest["edgec_version"], "wheels": []}
    with tempfile.TemporaryDirectory(prefix="edgec-pack-") as scratch:
        members: list[tuple[str, Path | bytes, int]] = [
            (f"{bundle.name}/{name}", bundle / name, 0o644) for name in ["manifest.json", *manifest["files"]]
        ]
        if wheels:
            folder = Path(scratch) / "wheels"
            info |= {"wheels": download_wheels(folder, python, platform), "python": python, "platform": platform}
            members += [(f"wheels/{name}", folder / name, 0o644) for name in info["wheels"]]
            members.append(("install.sh", INSTALL_SH.encode(), 0o755))
        members.append((PACK_INFO, (json.dumps(info, indent=2, sort_keys=True) + "\n").encode(), 0o644))
        _write_tar(output, sorted(members, key=lambda member: member[0]))
    return output


def _write_tar(output: Path, members: list[tuple[str, Path | bytes, int]]) -> None:
    mtime = source_date_epoch() or 0
    output.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{output.name}.tmp-", dir=output.parent)
    os.close(handle)
    try:
        with tarfile.open(temporary, "w", format=tarfile.PAX_FORMAT) as archive:
            for name, content, mode in members:
                data = content if isinstance(content, bytes) else None
                entry = tarfile.TarInfo(name)
                entry.size = len(data) if data is not None else content.stat().st_size
                entry.mtime, entry.mode, entry.uid, entry.gid, entry.uname, entry.gname = mtime, mode, 0, 0, "", ""
                if data is not None:
                    archive.addfile(entry, io.BytesIO(data))
                else:
                    with open(content, "rb") as stream:
                        archive.addfile(entry, stream)
        os.chmod(temporary, 0o644)  # mkstemp makes it private
        os.replace(temporary, output)
    except OSError as error:
        Path(temporary).unlink(missing_ok=True)
        raise PackError(f"cannot write {output}: {error.strerror or error}") from None
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def unpack(archive: str | Path, output: str | Path) -> Path:
    """Extract into the folder ``output`` (atomically), refusing unsafe members and checking every bundle file."""
    archive, output = Path(archive), Path(output)
    if output.exists():
        raise BundleError(f"{output} already exists; choose another -o")
    try:
        tar = tarfile.open(archive, "r")
    except (OSError, tarfile.TarError) as error:
        raise BundleError(f"{archive} is not a readable tar archive ({error})") from None
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        with tar:
            for member in tar.getmembers():
                _check_member(member)
            tar.extractall(temporary, filter="data")
        info = json.loads((temporary / PACK_INFO).read_text()) if (temporary / PACK_INFO).is_file() else None
        if not info or not (temporary / info["bundle"]).is_dir():
            raise BundleError(f"{archive} is not an edgec pack (no {PACK_INFO} or no bundle in it)")
        bundle = temporary / info["bundle"]
        manifest = read_manifest(bundle)
        if bad := verify_hashes(bundle, manifest):
            raise BundleError(f"{', '.join(bad)} in {archive} differ from the manifest (sha256): damaged or tampered")
        temporary.chmod(0o755)
        os.replace(temporary, output)
    except (tarfile.TarError, OSError, json.JSONDecodeError) as error:
        shutil.rmtree(temporary, ignore_errors=True)
        raise BundleError(f"cannot unpack {archive}: {error}") from None
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return output / info["bundle"]


def _check_member(member: tarfile.TarInfo) -> None:
    parts = Path(member.name).parts
    if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
        raise BundleError(f"refusing archive member {member.name!r}: only plain relative files belong in a pack")
