"""``edgec pack`` / ``unpack``: one archive to carry a bundle (and, optionally, the runtime's wheels) to a machine
with no network. A pack is closed like a bundle: ``PACK.json`` lists every member with its size and sha256, and
unpacking refuses anything else — an added wheel, a replaced script, a member it does not list.

    ARCHIVE.tar            a plain tar (never compressed: what it holds on disk is what it unpacks to)
      PACK.json            what is inside: every member's size and sha256
      PACK.sig             with --sign: an Ed25519 signature over PACK.json (edgec.signing)
      NAME.edgec/...       the bundle (manifest.json, its files, signature.json when signed)
      wheels/*.whl         with --wheels: edgec and what the bundle's runtime needs (its extra: numpy, tokenizers
                           and onnxruntime, or onnxruntime-gpu, tensorrt-rtx, …) for the chosen Python/platform
      requirements.txt     with --wheels: each wheel by path with its sha256
      install.sh           with --wheels: creates .venv, installs exactly those wheels (pip --require-hashes)
"""

from __future__ import annotations

import hashlib
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
from typing import Any

from edgec.bundle import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    SIGNATURE,
    atomic_file,
    atomic_folder,
    open_bundle,
    parse_json,
    read_json,
    sha256_file,
    source_date_epoch,
)
from edgec.errors import BundleError, EdgecError, SignatureError
from edgec.manifest_schema import Closed, bound_errors, path_problem, schema_errors, show
from edgec.signing import SigningKey, check_document_signature, sign_document

PACK_INFO = "PACK.json"
PACK_SIGNATURE = "PACK.sig"
PACK_FORMAT = 1
REQUIREMENTS = "requirements.txt"
INSTALL = "install.sh"
INSTALL_SH = """#!/bin/sh
# Install the edgec runtime from the wheels beside this script, needing no network. requirements.txt names each
# wheel with its sha256: pip installs exactly those and refuses any other file or any changed byte.
set -e
cd "$(dirname "$0")"
"${PYTHON:-python3}" -m venv .venv
.venv/bin/pip install --isolated --no-index --require-hashes -r requirements.txt
echo "installed; try: .venv/bin/python -m edgec.runtime BUNDLE \\"Your prompt\\""
"""
MAX_MEMBERS = 10_000
MAX_END_BYTES = 1 << 20  # the zero blocks after the last member (a tar writer pads them to its record size)
PACK_SCHEMA = Closed(
    {
        "pack_format": int,
        "edgec_version": str,
        "bundle": str,
        "wheels": [str],
        "python?": (str, type(None)),
        "platform?": (str, type(None)),
        "files": dict,
    }
)
PACK_BOUNDS = {"pack_format": (1, 1_000), "wheels#": (0, 1_000), "files#": (1, MAX_MEMBERS), "files.*.size": (0, 2**44)}
FILE_ENTRY = Closed({"size": int, "sha256": str})
COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


class PackError(EdgecError):
    """Packing could not gather what the archive needs."""


def runtime_requirements(signed: bool = False, extra: str = "runtime") -> list[str]:
    """An extra's requirements (``runtime``, or the one a bundle's device needs: ``cuda``, ``tensorrt-rtx``, …), as
    the installed edgec declares them, and the trust extra's for a signed pack, so the deployment can check
    signatures."""
    extras = [f'extra == "{extra}"'] + (['extra == "trust"'] if signed else [])
    requirements = metadata.requires("edgec") or []
    return [r.split(";")[0].strip() for r in requirements if any(e in r for e in extras) and "edgec" not in r]


def download_wheels(
    folder: Path, python: str | None, platform: str | None, signed: bool = False, extra: str = "runtime"
) -> list[str]:
    """edgec's own wheel (from its source tree) plus ``extra``'s dependencies for the given Python/platform."""
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
        _pip(["download", "-q", "-d", str(folder), *target, *runtime_requirements(signed, extra)])
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


def requirements_text(wheels: dict[str, bytes | Path]) -> str:
    """requirements.txt for ``install.sh``: every wheel by its path in the pack, pinned to its sha256."""
    lines = []
    for name in sorted(wheels):
        content = wheels[name]
        digest = hashlib.sha256(content).hexdigest() if isinstance(content, bytes) else sha256_file(content)
        lines.append(f"wheels/{name} --hash=sha256:{digest}")
    return "\n".join(lines) + "\n"


def pack(
    bundle: str | Path,
    output: str | Path,
    wheels: bool = False,
    python: str | None = None,
    platform: str | None = None,
    sign: SigningKey | None = None,
) -> Path:
    """Write ``output`` (a plain tar); reproducible: sorted members, fixed owners, mtime = SOURCE_DATE_EPOCH or 0.
    With ``sign``, ``PACK.sig`` signs PACK.json, and an unsigned bundle gets a ``signature.json`` by the same key
    in the archive (a bundle already signed keeps its own)."""
    bundle, output = Path(bundle), Path(output)
    try:
        manifest = open_bundle(bundle, check_hashes=True)
    except BundleError as error:
        raise BundleError(f"refusing to pack: {error}") from None
    name = Path(os.path.abspath(bundle)).name
    if path_problem(name):
        raise PackError(f"the bundle folder's name {show(name)} cannot travel in a pack: use letters, digits, _ . + -")
    members: dict[str, bytes | Path] = {f"{name}/{file}": bundle / file for file in [MANIFEST, *manifest["files"]]}
    if os.path.lexists(bundle / SIGNATURE):
        members[f"{name}/{SIGNATURE}"] = bundle / SIGNATURE
    elif sign is not None:
        record = sign_document(read_json(bundle / MANIFEST), sign, "bundle")
        members[f"{name}/{SIGNATURE}"] = (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()
    info: dict[str, Any] = {"pack_format": PACK_FORMAT, "edgec_version": manifest["edgec_version"], "bundle": name}
    with tempfile.TemporaryDirectory(prefix="edgec-pack-") as scratch:
        info["wheels"] = []
        if wheels:
            folder = Path(scratch) / "wheels"
            info |= {"python": python, "platform": platform}
            from edgec.runtime.model import runtime_extra  # the bundle's device decides which runtime to carry

            extra = runtime_extra(manifest["runtime"])
            info["wheels"] = download_wheels(folder, python, platform, signed=sign is not None, extra=extra)
            found: dict[str, bytes | Path] = {wheel: folder / wheel for wheel in info["wheels"]}
            members |= {f"wheels/{wheel}": path for wheel, path in found.items()}
            members[REQUIREMENTS] = requirements_text(found).encode()
            members[INSTALL] = INSTALL_SH.encode()
        info["files"] = {
            member: {"size": _size(content), "sha256": _sha256(content)} for member, content in sorted(members.items())
        }
        document = (json.dumps(info, indent=2, sort_keys=True) + "\n").encode()
        members[PACK_INFO] = document
        if sign is not None:
            record = sign_document(json.loads(document), sign, "pack")
            members[PACK_SIGNATURE] = (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()
        with atomic_file(output) as temporary:
            _write_tar(temporary, sorted(members.items()))
    return output


def _size(content: bytes | Path) -> int:
    return len(content) if isinstance(content, bytes) else content.stat().st_size


def _sha256(content: bytes | Path) -> str:
    return hashlib.sha256(content).hexdigest() if isinstance(content, bytes) else sha256_file(content)


def _write_tar(path: Path, members: list[tuple[str, bytes | Path]]) -> None:
    mtime = source_date_epoch() or 0
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as archive:
        for name, content in members:
            entry = tarfile.TarInfo(name)
            entry.size = _size(content)
            entry.mode = 0o755 if name == INSTALL else 0o644
            entry.mtime, entry.uid, entry.gid, entry.uname, entry.gname = mtime, 0, 0, "", ""
            if isinstance(content, bytes):
                archive.addfile(entry, io.BytesIO(content))
            else:
                with open(content, "rb") as stream:
                    archive.addfile(entry, stream)


# --- unpacking --------------------------------------------------------------------------------------------------
def unpack(archive: str | Path, output: str | Path, trust: Any = None) -> Path:
    """Extract into the folder ``output`` (atomically): only the members PACK.json lists, each checked against
    its size and sha256, then the bundle's own checks. With ``trust`` (public key file(s)), PACK.sig and the
    bundle's signature must be by a trusted key. Returns the bundle's path."""
    archive, output = Path(archive), Path(output)
    if os.path.lexists(output):
        raise BundleError(f"{output} already exists; choose another -o")
    tar = _open_archive(archive)
    with tar:
        members = _members(tar, archive)
        info = _pack_info(tar, members, archive)
        signed_by = None
        if trust is not None:
            signed_by = _check_pack_signature(tar, members, info, trust, archive)
        _check_member_set(members, info, archive)
        needed = sum(member.size for member in members.values())
        with atomic_folder(output) as temporary:
            if needed > shutil.disk_usage(temporary).free:
                raise BundleError(f"unpacking {archive} needs {needed:,} bytes; {output.parent} has less free space")
            for name, member in sorted(members.items()):
                _extract(tar, member, temporary / name, info["files"].get(name), archive, signed_by)
            bundle = temporary / info["bundle"]
            try:
                open_bundle(bundle, check_hashes=True, trust=trust)
            except BundleError as error:
                raise type(error)(f"{archive}: {error}") from None
    return output / info["bundle"]


def _open_archive(archive: Path) -> tarfile.TarFile:
    try:
        with open(archive, "rb") as handle:
            head = handle.read(8)
    except OSError as error:
        raise BundleError(f"cannot read {archive}: {error.strerror or error}") from None
    for magic, kind in COMPRESSED.items():
        if head.startswith(magic):
            raise BundleError(
                f"{archive} is {kind}-compressed; edgec packs are plain tar (their size on disk bounds what they "
                "unpack to): decompress it first"
            )
    try:
        return tarfile.open(archive, "r:")
    except (OSError, tarfile.TarError) as error:
        raise BundleError(f"{archive} is not a readable tar archive ({error})") from None


def _members(tar: tarfile.TarFile, archive: Path) -> dict[str, tarfile.TarInfo]:
    """The archive's files by name, after refusing anything but plain relative files (and their folders), more
    than ``MAX_MEMBERS`` members, a name twice, or more bytes than the archive itself holds."""
    files: dict[str, tarfile.TarInfo] = {}
    total = 0
    limit = archive.stat().st_size
    try:
        for count, member in enumerate(iter(tar.next, None)):
            if count >= MAX_MEMBERS:
                raise BundleError(f"{archive} has more than {MAX_MEMBERS:,} members: not an edgec pack")
            name = member.name.rstrip("/") if member.isdir() else member.name
            if problem := path_problem(name):
                raise BundleError(f"refusing archive member {show(member.name)}: {problem}")
            if member.isdir():
                continue
            if not member.isfile() or member.issparse():
                raise BundleError(f"refusing archive member {show(member.name)}: only plain files belong in a pack")
            if name in files:
                raise BundleError(f"refusing archive member {show(member.name)}: it appears twice")
            total += member.size
            if total > limit:
                raise BundleError(f"{archive} claims more content than the archive holds: damaged or hostile")
            files[name] = member
    except tarfile.TarError as error:
        raise BundleError(f"{archive} is not a readable tar archive ({error})") from None
    _check_whole(tar, archive)
    return files


def _check_whole(tar: tarfile.TarFile, archive: Path) -> None:
    """tarfile stops without a word at a header it cannot read after the first, so a pack cut off in a member (a
    broken download) or damaged in a header would read as one whose later members are missing. A whole tar ends
    in zero blocks (at least two; writers pad them to a record) and nothing else."""
    with open(archive, "rb") as handle:
        handle.seek(tar.offset)  # where tarfile stopped: the first header it did not read
        tail = handle.read(MAX_END_BYTES + 1)
    if len(tail) < 2 * tarfile.BLOCKSIZE or len(tail) > MAX_END_BYTES or tail.strip(b"\0"):
        raise BundleError(
            f"{archive} does not end as a whole tar archive does (cut off, damaged, or bytes after its end): "
            "download or copy it again"
        )


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int) -> bytes:
    if member.size > limit:
        raise BundleError(f"{member.name} is larger than {limit:,} bytes: not an edgec pack")
    stream = tar.extractfile(member)
    return stream.read() if stream is not None else b""


def _pack_info(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], archive: Path) -> dict[str, Any]:
    if PACK_INFO not in members:
        raise BundleError(f"{archive} is not an edgec pack (no {PACK_INFO})")
    info = parse_json(_read_member(tar, members[PACK_INFO], MAX_MANIFEST_BYTES), f"{PACK_INFO} in {archive}")
    if isinstance(info, dict) and "pack_format" not in info:
        raise BundleError(f"{archive} was packed by an older edgec, whose {PACK_INFO} lists no hashes; pack it again")
    if errors := pack_info_errors(info):
        raise BundleError(f"{PACK_INFO} in {archive} is not valid: {'; '.join(errors[:3])}")
    return info


def pack_info_errors(info: Any) -> list[str]:
    """Everything wrong with a parsed PACK.json: its schema and bounds, and a member set that can only be a pack's
    (the bundle folder is one plain name, so it unpacks inside the output folder)."""
    errors = schema_errors(info, PACK_SCHEMA, PACK_INFO)
    if errors:
        return errors
    if info["pack_format"] > PACK_FORMAT:
        return [f"pack format {info['pack_format']} is newer than this edgec reads ({PACK_FORMAT}); upgrade edgec"]
    errors += bound_errors(info, PACK_BOUNDS)
    for name, entry in info["files"].items():
        errors += schema_errors(entry, FILE_ENTRY, f"{PACK_INFO}.files[{show(name)}]")
    if errors:
        return errors
    bundle = info["bundle"]
    if path_problem(bundle) or "/" in bundle or bundle in (PACK_INFO, PACK_SIGNATURE, INSTALL, REQUIREMENTS, "wheels"):
        return [f"{PACK_INFO}.bundle is {show(bundle)}: it must be one plain folder name"]
    wheel_names = set(info["wheels"])
    for name in info["wheels"]:
        if path_problem(name) or "/" in name or not name.endswith(".whl"):
            errors.append(f"{PACK_INFO}.wheels has {show(name)}, which is not a wheel's file name")
    for name in info["files"]:
        if problem := path_problem(name):
            errors.append(f"{PACK_INFO}.files has an unsafe path {show(name)}: {problem}")
        elif not (
            name.startswith(f"{bundle}/")
            or name in (INSTALL, REQUIREMENTS)
            or (name.startswith("wheels/") and name[len("wheels/") :] in wheel_names)
        ):
            errors.append(f"{PACK_INFO}.files has {show(name)}, which belongs to no part of a pack")
    if f"{bundle}/{MANIFEST}" not in info["files"]:
        errors.append(f"{PACK_INFO}.files has no {bundle}/{MANIFEST}")
    listed_wheels = {name[len("wheels/") :] for name in info["files"] if name.startswith("wheels/")}
    if listed_wheels != wheel_names:
        errors.append(f"{PACK_INFO}.wheels and the wheels in {PACK_INFO}.files differ")
    if bool(wheel_names) != (INSTALL in info["files"]) or bool(wheel_names) != (REQUIREMENTS in info["files"]):
        errors.append(f"{INSTALL} and {REQUIREMENTS} come with wheels, and only with them")
    return errors


def _check_pack_signature(
    tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], info: dict[str, Any], trust: Any, archive: Path
) -> str:
    if PACK_SIGNATURE not in members:
        raise SignatureError(
            f"{archive} is not signed (no {PACK_SIGNATURE}); with a trust key only signed packs unpack"
        )
    record = parse_json(
        _read_member(tar, members[PACK_SIGNATURE], MAX_MANIFEST_BYTES), f"{PACK_SIGNATURE} in {archive}"
    )
    return check_document_signature(info, record, trust, "pack", str(archive), (PACK_INFO, PACK_SIGNATURE))


def _check_member_set(members: dict[str, tarfile.TarInfo], info: dict[str, Any], archive: Path) -> None:
    own = {PACK_INFO, PACK_SIGNATURE}
    extra = sorted(name for name in members if name not in info["files"] and name not in own)
    if extra:
        raise BundleError(f"refusing {archive}: {show(extra[0])} is in the archive but not in {PACK_INFO}")
    missing = sorted(name for name in info["files"] if name not in members)
    if missing:
        raise BundleError(f"{archive} lacks {show(missing[0])}, which {PACK_INFO} lists")


def _extract(
    tar: tarfile.TarFile,
    member: tarfile.TarInfo,
    path: Path,
    entry: dict[str, Any] | None,
    archive: Path,
    signed_by: str | None,
) -> None:
    """Copy one member to ``path`` while hashing it; refuse it unless it matches its PACK.json entry."""
    if entry is not None and member.size != entry["size"]:
        raise BundleError(f"{member.name} in {archive} has {member.size:,} bytes, {PACK_INFO} says {entry['size']:,}")
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    source = tar.extractfile(member)
    with open(path, "xb") as target:
        while source is not None and (block := source.read(1 << 22)):
            digest.update(block)
            target.write(block)
    os.chmod(path, 0o755 if member.name == INSTALL else 0o644)
    if entry is not None and digest.hexdigest() != entry["sha256"]:
        if signed_by:
            raise SignatureError(
                f"{member.name} in {archive} differs from the signed {PACK_INFO}: changed after signing"
            )
        raise BundleError(
            f"{member.name} in {archive} differs from {PACK_INFO} (sha256): damaged, or changed since packing "
            "(only a signed pack unpacked with --trust shows who changed it)"
        )
