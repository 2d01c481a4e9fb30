"""Bundle layout, manifest, hashing, and writing a bundle atomically.

Standard library only: the runtime imports this to open a bundle.

    NAME.edgec/
      manifest.json            what is inside and how it was made (see docs/bundle-format.md)
      model.onnx, model.onnx.data
      tokenizer.json, tokenizer_config.json, ...
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from edgec.errors import BundleError
from edgec.manifest_schema import manifest_errors

FORMAT_VERSION = 2  # v2: the runtime section holds what the runtime needs; the cache names each layer's state
MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_table(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file in the bundle except the manifest, with size and sha256, sorted by name."""
    table = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            name = path.relative_to(folder).as_posix()
            table[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return table


def write_manifest(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write manifest.json listing every file; with SOURCE_DATE_EPOCH set, every file's mtime is set to it."""
    manifest = {**manifest, "format_version": FORMAT_VERSION, "files": file_table(folder)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    if (epoch := source_date_epoch()) is not None:
        for path in folder.rglob("*"):
            os.utime(path, (epoch, epoch))
    return manifest


def source_date_epoch() -> int | None:
    """The reproducible-builds timestamp (https://reproducible-builds.org/specs/source-date-epoch/), if set."""
    value = os.environ.get("SOURCE_DATE_EPOCH")
    return int(value) if value and value.isdigit() else None


def write_npz(path: Path, arrays: dict[str, Any]) -> None:
    """Like numpy.savez, but byte-for-byte reproducible (fixed member timestamps and order)."""
    import io
    import zipfile

    import numpy as np

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for name in sorted(arrays):
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.asarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            archive.writestr(info, buffer.getvalue())


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """Read and sanity-check a bundle's manifest and file set (sizes, not hashes: that is ``verify_hashes``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BundleError(f"bundle {str(folder)!r} is not a folder (build one with: edgec build MODEL -o {folder})")
    path = folder / MANIFEST
    if not path.is_file():
        raise BundleError(f"{folder} has no {MANIFEST}; it is not an edgec bundle")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BundleError(f"{path} is not valid JSON ({error})") from None
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise BundleError(f"{path} has no format_version")
    if version > FORMAT_VERSION:
        raise BundleError(
            f"bundle format version {version} is newer than this edgec reads ({FORMAT_VERSION}); upgrade edgec"
        )
    if errors := manifest_errors(manifest):
        raise BundleError(f"{path} does not fit the bundle format v{version}: {'; '.join(errors[:3])}")
    for name, entry in manifest.get("files", {}).items():
        file = folder / name
        if not file.is_file():
            raise BundleError(f"bundle {folder} is missing {name}; rebuild or re-copy it")
        if file.stat().st_size != entry["size"]:
            raise BundleError(
                f"{name} in {folder} has {file.stat().st_size} bytes, the manifest says {entry['size']}: "
                "the file is damaged or truncated"
            )
    return manifest


def upgrade_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest in the current format's layout (a copy; v1 bundles keep loading). v1 kept the runtime's prefill
    chunk and default protect heuristics among the build settings; v1's per-layer state is read by
    ``CacheSpec.from_json`` (and narrowed to the graph's inputs by the runtime)."""
    if manifest.get("format_version", FORMAT_VERSION) >= 2:
        return manifest
    settings = manifest["build_settings"]
    runtime = {**manifest["runtime"], "prefill_chunk": settings["prefill_chunk"], "protect": settings.get("protect")}
    return {**manifest, "runtime": runtime}


def verify_hashes(folder: str | Path, manifest: dict[str, Any]) -> list[str]:
    """Names of files whose sha256 differs from the manifest."""
    folder = Path(folder)
    return [name for name, entry in manifest["files"].items() if sha256_file(folder / name) != entry["sha256"]]


@contextlib.contextmanager
def atomic_folder(destination: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``destination``; on success rename it into place, on any failure remove
    it. Nothing half-written ever appears at ``destination``."""
    destination = Path(destination)
    if destination.exists() and not overwrite:
        raise BundleError(f"{destination} already exists; choose another -o or pass --overwrite")
    destination.parent.mkdir(parents=True, exist_ok=True)
    for stale in destination.parent.glob(f".{destination.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a build that was killed
    temporary = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-", dir=destination.parent))
    try:
        yield temporary
        temporary.chmod(0o755)  # mkdtemp makes it private; a bundle is meant to be read by others
        if destination.exists():
            shutil.rmtree(destination)
        os.replace(temporary, destination)
    except OSError as error:  # disk full, permissions, ...: a user's problem, not a bug
        shutil.rmtree(temporary, ignore_errors=True)
        where = f" ({error.filename})" if error.filename else ""
        raise BundleError(
            f"writing {destination} failed: {error.strerror or error}{where}; nothing was written"
        ) from None
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
