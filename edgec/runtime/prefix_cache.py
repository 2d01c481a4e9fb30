"""Saved prompts: a cache state written to disk after a prompt was read, so the same prompt (or one that starts with
it) is answered again without reading it again.

A state file holds what generation needs to go on from the end of the prompt: the prompt's token ids and protect
flags, every cache state tensor, and the logits of its last position (the first new token is chosen from them, so a
repeated prompt runs no step at all before its first token). It is tied to one bundle and one cache setting: the
key is SHA-256 of the bundle's manifest (which holds every file's hash) and the cache spec in force (a capacity or
prefill mode chosen at load changes the state). A compressed 8K prompt is a few MB; an uncompressed cache is saved
whole (its buffers are sized for the full context).

Layout: ``MAGIC``, a little-endian uint32 header length, a JSON header (≤ ``MAX_HEADER`` bytes), then the raw arrays
in header order (logits as float32). A state file is input from outside (a shared folder, a copied disk): before
anything is used, the file's size must equal what the header promises and what this bundle's state needs, every
array must have exactly the name, dtype and shape this bundle's state has, the payload must match its SHA-256,
token ids must lie in the vocabulary and positions in the prompt. Any failure is a ``StateFileError`` with one line.

A prefix cache folder (``edgec run --prefix-cache DIR``) names each file by the key of its prompt
(``prefix_key``): a new prompt looks for the longest of its own prefixes that has a file, restores it, and reads
only the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgec.bundle import open_regular_file
from edgec.errors import StateFileError, one_line

MAGIC = b"EDGECKV\x01"
FORMAT = 1
MAX_HEADER = 1 << 20
MAX_FILES = 10_000  # a prefix cache folder is listed once per prompt; more entries than this are not looked at
SUFFIX = ".edgeckv"


__all__ = ["SavedPrompt", "StateFileError", "find_prefix", "prefix_keys", "read_state", "write_state"]


@dataclass
class SavedPrompt:
    """A prompt read into a cache state: its ids [n] int64 and protect flags [n] bool, the state tensors by graph
    input name, and the logits after its last token [vocab] (float32 or float16, as the graph gives them)."""

    ids: np.ndarray
    flags: np.ndarray
    arrays: dict[str, np.ndarray]
    logits: np.ndarray


def cache_identity(manifest_bytes: bytes, spec_json: dict[str, Any]) -> str:
    """What a state depends on: the bundle (its manifest, which hashes every file) and the cache spec in force."""
    spec = json.dumps(spec_json, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(hashlib.sha256(manifest_bytes).digest() + spec).hexdigest()


def prefix_keys(identity: str, ids: np.ndarray, flags: np.ndarray) -> list[str]:
    """The file key of every prefix of a prompt: keys[n - 1] is ids[:n]'s (SHA-256 over the identity and each
    token's id and protect flag, extended token by token)."""
    digest = hashlib.sha256(identity.encode())
    keys = []
    for token, flag in zip(ids.tolist(), flags.tolist(), strict=True):
        digest.update(struct.pack("<qB", token, bool(flag)))
        keys.append(digest.copy().hexdigest())
    return keys


def expected_arrays(template: dict[str, np.ndarray]) -> dict[str, tuple]:
    """name → (dtype, shape) of every state tensor as this model holds it (``template``)."""
    shapes = {name: (np.dtype(array.dtype).str, tuple(array.shape)) for name, array in template.items()}
    return shapes


def write_state(path: Path, identity: str, saved: SavedPrompt) -> None:
    """Write atomically (a temporary file renamed into place): a reader never sees half a file."""
    arrays = {"ids": saved.ids.astype("<i8"), "flags": saved.flags.astype(np.uint8)}
    arrays |= {name: np.ascontiguousarray(value) for name, value in saved.arrays.items()}
    arrays["logits"] = np.ascontiguousarray(saved.logits, dtype="<f4")
    payload = hashlib.sha256()
    entries = []
    for name, value in arrays.items():
        payload.update(value.tobytes())
        entries.append({"name": name, "dtype": value.dtype.str, "shape": list(value.shape)})
    header = {"format": FORMAT, "identity": identity, "tokens": len(saved.ids), "arrays": entries}
    header["payload_sha256"] = payload.hexdigest()
    encoded = json.dumps(header, separators=(",", ":")).encode()
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(MAGIC + struct.pack("<I", len(encoded)) + encoded)
            for value in arrays.values():
                file.write(value.tobytes())
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise StateFileError(f"cannot write the cache state {one_line(path)}: {one_line(error.strerror)}") from None


def read_state(path: Path, identity: str, expected: dict[str, tuple], context: int, vocab: int) -> SavedPrompt:
    """Read and check a state file against this model (``expected_arrays``; ``context``: the bundle's)."""
    path = Path(path)
    where = one_line(path)
    try:
        opened = open_regular_file(path)
        if opened is None:  # a FIFO or a device: opened without waiting, never read
            raise StateFileError(f"{where} is not a regular file")
        with opened as file:
            head = file.read(len(MAGIC) + 4)
            if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
                raise StateFileError(f"{where} is not an edgec cache state file")
            (length,) = struct.unpack("<I", head[len(MAGIC) :])
            if length > MAX_HEADER:
                raise StateFileError(f"{where}: its header claims {length} bytes (at most {MAX_HEADER})")
            header = _header(file.read(length), where)
            tokens = header["tokens"]
            if not 1 <= tokens <= context:
                raise StateFileError(f"{where} holds {tokens} tokens; this bundle's context is {context}")
            wanted = {"ids": ("<i8", (tokens,)), "flags": ("|u1", (tokens,))} | expected | {"logits": ("<f4", (vocab,))}
            named = [entry["name"] for entry in header["arrays"]]
            if named != list(wanted):
                raise StateFileError(
                    f"{where} was saved by another bundle or cache setting: its tensors differ from this bundle's"
                )
            for entry in header["arrays"]:
                dtype, shape = wanted[entry["name"]]
                if entry["dtype"] != dtype or tuple(entry["shape"]) != shape:
                    raise StateFileError(
                        f"{where}: {one_line(entry['name'])} is {one_line(entry['dtype'])} {entry['shape']}, this "
                        f"bundle's is {dtype} {list(shape)}"
                    )
            if header["identity"] != identity:
                raise StateFileError(f"{where} was saved by another bundle or cache setting")
            sizes = [np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64)) for dtype, shape in wanted.values()]
            body = file.read(sum(sizes) + 1)
    except OSError as error:
        raise StateFileError(f"cannot read the cache state {where}: {one_line(error.strerror)}") from None
    if len(body) != sum(sizes):
        raise StateFileError(f"{where} is {'longer' if len(body) > sum(sizes) else 'shorter'} than its header says")
    if hashlib.sha256(body).hexdigest() != header["payload_sha256"]:
        raise StateFileError(f"{where} is damaged: its contents do not match their SHA-256")
    arrays, offset = {}, 0
    for (name, (dtype, shape)), size in zip(wanted.items(), sizes, strict=True):
        arrays[name] = np.frombuffer(body, dtype=np.dtype(dtype), count=size // np.dtype(dtype).itemsize, offset=offset)
        arrays[name] = arrays[name].reshape(shape).copy()
        offset += size
    ids, flags, logits = arrays.pop("ids"), arrays.pop("flags"), arrays.pop("logits")
    if ids.min() < 0 or ids.max() >= vocab:
        raise StateFileError(f"{where} holds token ids outside this bundle's vocabulary of {vocab}")
    if flags.max() > 1:
        raise StateFileError(f"{where} holds protect flags other than 0 and 1")
    for name, value in arrays.items():
        if name.endswith((".pos", ".pos_hi")) and (value.min() < -1 or value.max() >= tokens):
            raise StateFileError(f"{where}: {name} holds positions outside the saved prompt")
        if value.dtype.kind == "f" and np.isnan(value).any():
            raise StateFileError(f"{where}: {name} holds NaN")
    if not np.isfinite(logits).all():
        raise StateFileError(f"{where}: its logits are not all finite")
    return SavedPrompt(ids=ids, flags=flags.astype(bool), arrays=arrays, logits=logits)


def _header(raw: bytes, where: str) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise StateFileError(f"{where}: its header is not JSON") from None
    fields = {"format": int, "identity": str, "tokens": int, "arrays": list, "payload_sha256": str}
    if not isinstance(header, dict) or any(not isinstance(header.get(k), t) for k, t in fields.items()):
        raise StateFileError(f"{where}: its header lacks {', '.join(fields)}")
    if header["format"] != FORMAT:
        raise StateFileError(f"{where} is cache state format {header['format']}; this edgec reads {FORMAT}")
    for entry in header["arrays"]:
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("dtype"), str)
            and isinstance(entry.get("shape"), list)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in entry["shape"])
        ):
            raise StateFileError(f"{where}: its header lists an array without a name, dtype and shape")
    return header


def find_prefix(folder: Path, keys: Sequence[str]) -> tuple[int, Path] | None:
    """The longest prefix (its token count and file) of a prompt whose key has a file in ``folder``."""
    try:
        with os.scandir(folder) as entries:
            names = set()
            for count, entry in enumerate(entries):
                if count >= MAX_FILES:
                    break
                names.add(entry.name)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise StateFileError(f"cannot read the prefix cache {one_line(folder)}: {one_line(error.strerror)}") from None
    for count in range(len(keys), 0, -1):
        if keys[count - 1] + SUFFIX in names:
            return count, Path(folder) / (keys[count - 1] + SUFFIX)
    return None
