"""Bundle layout, manifest, hashing, the closed-bundle checks, and writing a bundle atomically.

Standard library only: the runtime imports this to open a bundle.

    NAME.edgec/
      manifest.json            what is inside and how it was made (see docs/bundle-format.md)
      signature.json           optional: an Ed25519 signature over the manifest (edgec.signing)
      model.onnx, model.onnx.data
      tokenizer.json, tokenizer_config.json, ...

A bundle is closed: every file it uses is listed in the manifest with its size and sha256, is a regular file
inside the folder (no links, no ``..``, no absolute paths), and the graph's external data names only listed files.
A bundle may come from anyone, so everything here treats its bytes as hostile (docs/security.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from edgec.errors import BuildError, BundleError, SignatureError
from edgec.manifest_schema import UNLISTED, manifest_errors, path_problem, show

FORMAT_VERSION = 2  # v2: the runtime section holds what the runtime needs; the cache names each layer's state
MANIFEST = "manifest.json"
SIGNATURE = "signature.json"
MAX_MANIFEST_BYTES = 16 * 2**20  # a real manifest is a few KiB; the bound keeps a hostile one from filling memory


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_table(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file in the bundle except the manifest and its signature, with size and sha256, sorted by name."""
    table = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and name not in UNLISTED:
            if problem := path_problem(name):
                raise BuildError(f"the build wrote {show(name)}, which a bundle cannot list ({problem})")
            table[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return table


def write_manifest(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write manifest.json listing every file; with SOURCE_DATE_EPOCH set, every file's mtime is set to it. The
    manifest must be one that ``read_manifest`` accepts: a build never writes a bundle the runtime refuses."""
    manifest = {**manifest, "format_version": FORMAT_VERSION, "files": file_table(folder)}
    if errors := manifest_errors(json.loads(json.dumps(manifest))):
        raise BuildError(f"the manifest this build made does not fit the bundle format: {'; '.join(errors[:3])}")
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


# --- reading ----------------------------------------------------------------------------------------------------
def open_regular_file(path: str | Path, follow_links: bool = True) -> BinaryIO | None:
    """``path`` opened for reading if it is a regular file, else None; raises OSError. Never waits: a plain open
    of a FIFO waits for a writer, forever, and a hostile folder's ``manifest.json`` may be one. So the open does
    not block (no effect on a regular file's reads) and the file's type is checked on what was opened."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if follow_links else getattr(os, "O_NOFOLLOW", 0))
    handle = os.open(path, flags)
    stream = os.fdopen(handle, "rb")
    if not stat.S_ISREG(os.fstat(handle).st_mode):
        stream.close()
        return None
    return stream


def read_json(path: Path, limit: int = MAX_MANIFEST_BYTES) -> Any:
    """A JSON document from a file nobody vouches for: a regular file (not a link) of at most ``limit`` bytes,
    UTF-8, no NaN or Infinity, no duplicate keys, no absurd nesting or numbers. Raises BundleError."""
    try:
        stream = open_regular_file(path, follow_links=False)
    except OSError as error:
        if os.path.islink(path):
            raise BundleError(f"{path} is a symbolic link; a bundle holds only regular files") from None
        raise BundleError(f"cannot read {path}: {error.strerror or error}") from None
    if stream is None:
        raise BundleError(f"{path} is not a regular file")
    with stream:
        data = stream.read(limit + 1)
    if len(data) > limit:
        raise BundleError(f"{path} is larger than {limit:,} bytes: not a file edgec wrote")
    return parse_json(data, str(path))


def parse_json(data: bytes, where: str) -> Any:
    """``read_json``'s rules for bytes already in memory (``where`` names them in the message)."""
    try:
        return json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_unique_keys,
            parse_constant=_no_constant,
            parse_float=_finite_float,
        )
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError, an int of 5,000 digits
        raise BundleError(f"{where} is not valid JSON ({_first_line(error)})") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"the key {show(twice)} appears twice")
    return document


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {show(text)} is out of range")
    return value


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """Read and check a bundle's manifest and file set: the schema with its bounds, and every listed file a
    regular file inside the bundle of its listed size (hashes: ``verify_hashes``; the graph: ``open_bundle``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BundleError(f"bundle {str(folder)!r} is not a folder (build one with: edgec build MODEL -o {folder})")
    path = folder / MANIFEST
    if not os.path.lexists(path):
        raise BundleError(f"{folder} has no {MANIFEST}; it is not an edgec bundle")
    manifest = read_json(path)
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if not isinstance(version, int) or isinstance(version, bool):
        raise BundleError(f"{path} has no format_version")
    if version > FORMAT_VERSION:
        raise BundleError(
            f"bundle format version {version} is newer than this edgec reads ({FORMAT_VERSION}); upgrade edgec"
        )
    if errors := manifest_errors(manifest):
        raise BundleError(f"{path} does not fit the bundle format v{version}: {'; '.join(errors[:3])}")
    for name, entry in manifest["files"].items():
        size = listed_file(folder, name).stat().st_size
        if size != entry["size"]:
            raise BundleError(
                f"{name} in {folder} has {size} bytes, the manifest says {entry['size']}: "
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


def listed_file(folder: Path, name: str) -> Path:
    """``folder / name`` after checking that it is a regular file reached through no link (``name`` has passed
    ``path_problem``, so it has no ``..`` and is not absolute: the file lies inside ``folder``)."""
    path = folder
    parts = name.split("/")
    for index, part in enumerate(parts):
        path = path / part
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            raise BundleError(f"bundle {folder} is missing {name}; rebuild or re-copy it") from None
        except OSError as error:
            raise BundleError(f"cannot read {name} in {folder}: {error.strerror or error}") from None
        if stat.S_ISLNK(mode):
            raise BundleError(f"{name} in {folder} goes through a symbolic link; a bundle holds only regular files")
        last = index == len(parts) - 1
        if (last and not stat.S_ISREG(mode)) or (not last and not stat.S_ISDIR(mode)):
            raise BundleError(f"{name} in {folder} is not a regular file")
    return path


def unlisted_entries(folder: Path, manifest: dict[str, Any]) -> list[str]:
    """Everything in ``folder`` that the manifest does not list (files, links, other folders), sorted."""
    listed = set(manifest["files"])
    parents = {"/".join(name.split("/")[:depth]) for name in listed for depth in range(1, name.count("/") + 1)}
    extra = []
    for root, folders, files in os.walk(folder):  # does not follow links: a linked folder is listed as extra
        base = Path(root).relative_to(folder).as_posix()
        for entry in sorted(folders + files):
            name = entry if base == "." else f"{base}/{entry}"
            if name in listed or name in parents or (base == "." and entry in UNLISTED):
                continue
            extra.append(name)
        folders[:] = [entry for entry in folders if (entry if base == "." else f"{base}/{entry}") in parents]
    return sorted(extra)


def verify_hashes(folder: str | Path, manifest: dict[str, Any]) -> list[str]:
    """Names of files whose sha256 differs from the manifest."""
    folder = Path(folder)
    return [name for name, entry in manifest["files"].items() if sha256_file(folder / name) != entry["sha256"]]


# trust=: a public key file (str or path), a cryptography Ed25519PublicKey, or a sequence of them
# (edgec.signing.load_public_keys); Any because the key class comes from a package the runtime imports lazily
TrustedKeys = Any


def open_bundle(
    folder: str | Path, check_hashes: bool = False, trust: TrustedKeys | None = None, scans: dict | None = None
) -> dict[str, Any]:
    """Everything ``Model.load`` checks before any file reaches a runtime library: ``read_manifest``, the graph's
    external data and ops (``edgec.onnx_scan``), and with ``check_hashes`` every sha256. With ``trust`` (public
    key(s)) the bundle must carry a valid signature by one of them over its manifest, hold exactly the listed
    files, and every file must match its hash: one line names the first file that does not (``SignatureError``).
    ``scans``: filled with the graph files' scans (``onnx_scan.graph_problems``)."""
    from edgec.onnx_scan import graph_problems

    folder = Path(folder)
    manifest = read_manifest(folder)
    if trust is not None:
        from edgec.signing import check_bundle_signature

        check_bundle_signature(folder, manifest, trust)
        if extra := unlisted_entries(folder, manifest):
            raise SignatureError(f"{show(extra[0])} in {folder} is not in the signed manifest: added after signing")
        for name, entry in manifest["files"].items():
            if sha256_file(folder / name) != entry["sha256"]:
                raise SignatureError(
                    f"{name} in {folder} differs from the signed manifest (sha256): changed after signing"
                )
    elif check_hashes and (bad := verify_hashes(folder, manifest)):
        raise BundleError(
            f"{', '.join(bad)} in {folder} differ from the manifest (sha256): damaged, or changed since the build "
            "(only a signed bundle loaded with a trust key shows who changed it)"
        )
    if problems := graph_problems(folder, manifest, scans):
        raise BundleError(f"{folder}: {problems[0]}")
    return manifest


# --- writing ----------------------------------------------------------------------------------------------------
def is_edgec_bundle(folder: Path) -> bool:
    """Whether ``folder`` holds an edgec manifest (what ``--overwrite`` may replace; damage elsewhere is fine)."""
    try:
        manifest = read_json(folder / MANIFEST)
    except BundleError:
        return False
    return isinstance(manifest, dict) and {"format_version", "edgec_version", "files"} <= manifest.keys()


def _check_replaceable(destination: Path) -> None:
    """``--overwrite`` replaces an edgec bundle or an empty folder, nothing else."""
    if destination.is_symlink():
        raise BundleError(f"refusing to replace {destination}: it is a symbolic link; give the folder itself")
    if not destination.is_dir():
        raise BundleError(f"refusing to replace {destination}: it is a file, not a bundle folder")
    if any(destination.iterdir()) and not is_edgec_bundle(destination):
        raise BundleError(
            f"refusing to replace {destination}: it is not an edgec bundle (no manifest.json) and not empty; "
            "--overwrite only replaces a bundle. Remove it yourself or choose another -o"
        )


@contextlib.contextmanager
def output_lock(destination: Path) -> Iterator[None]:
    """Hold ``.NAME.lock`` beside ``destination`` for as long as this process writes it: a second edgec writing
    the same output fails at once instead of deleting the first one's temporary files. The kernel releases the
    lock of a killed process; the file itself is removed on the way out."""
    lock = destination.parent / f".{destination.name}.lock"
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        handle = _acquire(lock, destination)
    except OSError as error:
        raise BundleError(f"cannot write in {destination.parent}: {error.strerror or error}") from None
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if os.name != "nt":  # Windows cannot remove a file that is open
                lock.unlink()
        os.close(handle)


def _acquire(lock: Path, destination: Path) -> int:
    for _ in range(10):  # retry while another process removes the file between our open and our lock
        handle = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _try_lock(handle):
                raise BundleError(
                    f"another edgec is writing {destination} (it holds {lock.name}); wait for it or choose another -o"
                )
            if os.name == "nt" or os.path.samestat(os.fstat(handle), os.stat(lock)):
                return handle
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(handle)
            raise
        os.close(handle)
    raise BundleError(f"cannot lock {lock}: it keeps being replaced")


def _try_lock(handle: int) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        try:
            msvcrt.locking(handle, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _remove_stale(destination: Path) -> None:
    """Temporary files and folders left by an edgec that was killed while writing ``destination`` (called with
    the output lock held: nobody else is writing them)."""
    for pattern in (f".{destination.name}.tmp-*", f".{destination.name}.old-*"):
        for stale in destination.parent.glob(pattern):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def _absolute(destination: str | Path) -> Path:
    destination = Path(os.path.abspath(destination))  # "." and "x/.." get a real name and parent
    if not destination.name:
        raise BundleError(f"{destination} cannot be an output: give a folder name")
    return destination


@contextlib.contextmanager
def atomic_folder(
    destination: str | Path, overwrite: bool = False, seal: Callable[[Path], None] | None = None
) -> Iterator[Path]:
    """Yield a temporary folder beside ``destination``; on success ``seal`` it (e.g. sign it) and rename it into
    place, on any failure remove it. Nothing half-written ever appears at ``destination``. ``overwrite`` replaces
    an existing edgec bundle or empty folder, never anything else; one writer per destination at a time."""
    destination = _absolute(destination)
    with output_lock(destination):
        try:
            if os.path.lexists(destination):
                if not overwrite:
                    raise BundleError(f"{destination} already exists; choose another -o or pass --overwrite")
                _check_replaceable(destination)
            _remove_stale(destination)
            temporary = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-", dir=destination.parent))
        except OSError as error:
            raise BundleError(f"cannot write in {destination.parent}: {error.strerror or error}") from None
        try:
            yield temporary
            if seal is not None:
                seal(temporary)
            temporary.chmod(0o755)  # mkdtemp makes it private; a bundle is meant to be read by others
            sync_to_disk(temporary)
            _move_into_place(temporary, destination)
            _sync_folder(destination.parent)
        except OSError as error:  # disk full, permissions, ...: a user's problem, not a bug
            reason = write_failure(error, destination.parent)  # while the temporary folder still fills the disk
            shutil.rmtree(temporary, ignore_errors=True)
            where = f" ({error.filename})" if error.filename else ""
            raise BundleError(f"writing {destination} failed: {reason}{where}; nothing was written") from None
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise


# below this much free space, a write that failed without saying why failed because the disk is full
NEARLY_FULL_BYTES = 64 << 20


def write_failure(error: OSError, folder: Path) -> str:
    """Why writing a bundle or archive in ``folder`` failed, as its user should read it: the system's reason, and
    where the writer gave none and the disk has almost nothing left, that the disk is full (numpy's ``tofile``, which
    writes the weights, says only "problem writing element N to file")."""
    reason = error.strerror or str(error)
    if error.errno is None:
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            return reason
        if free < NEARLY_FULL_BYTES:
            return f"the disk is full ({free >> 20} MB free at {folder}; {reason})"
    return reason


def sync_to_disk(folder: Path) -> None:
    """Every file under ``folder``, and the folders, written through to the disk before the rename that publishes
    them. A rename can reach the disk before the data it names: after a power cut the bundle would be there with
    empty or short files (an industrial PC is switched off, not shut down). And a page not yet written back may
    stay mapped after the runtime's page-out (``runtime.page_out``): a 4 MB weights file loaded at once kept a
    dirty 2 MB folio without this, nothing with it."""
    for root, _folders, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                _sync_file(path)
        _sync_folder(root)


def _sync_file(path: str | Path) -> None:
    handle = os.open(path, os.O_RDWR if os.name == "nt" else os.O_RDONLY)  # Windows commits only a writable one
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _sync_folder(path: str | Path) -> None:
    """Where the system lets a folder be synced (POSIX): its entries (a new name, a rename) reach the disk."""
    try:
        handle = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # Windows opens no folder; its renames are journaled with the file
    try:
        os.fsync(handle)
    except OSError:
        pass  # some file systems refuse to sync a folder: the files themselves are on the disk
    finally:
        os.close(handle)


def _move_into_place(temporary: Path, destination: Path) -> None:
    """Rename ``temporary`` to ``destination``; an old bundle there is first moved aside (a kill in between
    leaves the new bundle or the old one, and the aside copy is removed by the next run)."""
    if not os.path.lexists(destination):
        os.replace(temporary, destination)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old-", dir=destination.parent))
    os.replace(destination, aside / "bundle")
    try:
        os.replace(temporary, destination)
    except OSError:
        os.replace(aside / "bundle", destination)  # the old bundle goes back: a failed write changes nothing
        raise
    shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(destination: str | Path) -> Iterator[Path]:
    """Like ``atomic_folder`` for one file (an archive): yields a temporary path beside it, renamed into place
    on success; an existing file at ``destination`` is replaced, a folder is refused."""
    destination = _absolute(destination)
    with output_lock(destination):
        if os.path.isdir(destination) or os.path.islink(destination):
            raise BundleError(f"{destination} is a folder or a link; give a file name for the archive")
        try:
            _remove_stale(destination)
            handle, name = tempfile.mkstemp(prefix=f".{destination.name}.tmp-", dir=destination.parent)
        except OSError as error:
            raise BundleError(f"cannot write in {destination.parent}: {error.strerror or error}") from None
        os.close(handle)
        temporary = Path(name)
        try:
            yield temporary
            os.chmod(temporary, 0o644)  # mkstemp makes it private
            _sync_file(temporary)
            os.replace(temporary, destination)
            _sync_folder(destination.parent)
        except OSError as error:
            reason = write_failure(error, destination.parent)
            temporary.unlink(missing_ok=True)
            raise BundleError(f"cannot write {destination}: {reason}; nothing was written") from None
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
