"""Ed25519 signatures over a bundle's manifest (``signature.json``) and a pack's (``PACK.sig``).

A manifest lists every file with its size and sha256, so a signature over the manifest's canonical digest vouches
for every byte: a loader that trusts the key checks the signature, then every file against the manifest, and names
the first thing that differs. The canonical digest is the sha256 of the manifest serialised with sorted keys, no
spaces and ASCII escapes (so reformatting the JSON does not matter; changing any value does). The signed message is
a purpose line (bundle or pack, so one cannot stand in for the other) followed by that digest.

Keys are files: ``edgec keygen NAME`` writes ``NAME.key`` (PKCS#8 PEM, private, mode 600; encrypted when
``EDGEC_KEY_PASSPHRASE`` is set) and ``NAME.pub`` (SubjectPublicKeyInfo PEM). A public key may also be an OpenSSH
``ssh-ed25519`` line. The ``cryptography`` package does the cryptography; it is imported only when a signature is
made or checked (``pip install 'edgec[trust]'`` on a deployment machine).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgec.bundle import MANIFEST, SIGNATURE, read_json, source_date_epoch
from edgec.errors import BundleError, KeyFileError, SignatureError
from edgec.manifest_schema import Closed, schema_errors, show

SIGNATURE_FORMAT = "edgec-signature-1"
PURPOSES = {"bundle": b"edgec bundle manifest sha256\n", "pack": b"edgec pack manifest sha256\n"}
PASSPHRASE_ENV = "EDGEC_KEY_PASSPHRASE"
MAX_KEY_BYTES = 64 * 1024
SIGNATURE_RECORD = Closed(
    {"format": str, "algorithm": str, "purpose": str, "key_id": str, "manifest_sha256": str, "signature": str}
)


def _crypto():
    """The parts of ``cryptography`` used here, or one line saying how to install it."""
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise BundleError(
            "signatures need the cryptography package, which is not installed: pip install 'edgec[trust]'"
        ) from None
    return ed25519, serialization, InvalidSignature


@dataclass(frozen=True)
class SigningKey:
    """A private Ed25519 key read from a file, ready to sign."""

    key: Any  # cryptography's Ed25519PrivateKey
    path: Path

    @property
    def key_id(self) -> str:
        return key_id(self.key.public_key())


def key_id(public_key: Any) -> str:
    """A short name for a public key: the first 16 hex digits of the sha256 of its 32 raw bytes."""
    _, serialization, _ = _crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def canonical_digest(document: dict[str, Any]) -> str:
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


# --- key files --------------------------------------------------------------------------------------------------
def generate_keypair(stem: str | Path) -> tuple[Path, Path]:
    """Write ``STEM.key`` (private, mode 600) and ``STEM.pub``; refuses to replace either."""
    ed25519, serialization, _ = _crypto()
    stem = Path(stem)
    private_path, public_path = Path(f"{stem}.key"), Path(f"{stem}.pub")
    for path in (private_path, public_path):
        if os.path.lexists(path):
            raise KeyFileError(f"{path} already exists; choose another name (keys are never overwritten)")
    key = ed25519.Ed25519PrivateKey.generate()
    passphrase = os.environ.get(PASSPHRASE_ENV)
    encryption = (
        serialization.BestAvailableEncryption(passphrase.encode()) if passphrase else serialization.NoEncryption()
    )
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        _write_new(private_path, private, 0o600)
        _write_new(public_path, public, 0o644)
    except OSError as error:
        private_path.unlink(missing_ok=True)
        raise KeyFileError(f"cannot write {stem}.key/.pub: {error.strerror or error}") from None
    return private_path, public_path


def _write_new(path: Path, data: bytes, mode: int) -> None:
    handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(handle, "wb") as stream:
        stream.write(data)


def _read_key_file(path: str | Path, what: str) -> bytes:
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_KEY_BYTES + 1)
    except OSError as error:
        raise KeyFileError(f"cannot read the {what} {path}: {error.strerror or error}") from None
    if len(data) > MAX_KEY_BYTES:
        raise KeyFileError(f"{path} is not a {what} (larger than {MAX_KEY_BYTES:,} bytes)")
    return data


def load_signing_key(path: str | Path) -> SigningKey:
    """A private Ed25519 key (PKCS#8 PEM as ``edgec keygen`` writes it, or OpenSSH); encrypted keys take their
    passphrase from ``EDGEC_KEY_PASSPHRASE``."""
    ed25519, serialization, _ = _crypto()
    data = _read_key_file(path, "private key")
    passphrase = os.environ.get(PASSPHRASE_ENV)
    password = passphrase.encode() if passphrase else None
    try:
        if data.lstrip().startswith(b"-----BEGIN OPENSSH PRIVATE KEY"):
            key = serialization.load_ssh_private_key(data, password)
        else:
            key = serialization.load_pem_private_key(data, password)
    except TypeError:  # encrypted without a passphrase, or a passphrase for an unencrypted key
        raise KeyFileError(
            f"{path} is encrypted: set {PASSPHRASE_ENV} to its passphrase"
            if password is None
            else f"{path} is not encrypted: unset {PASSPHRASE_ENV}"
        ) from None
    except (ValueError, binascii.Error) as error:
        raise KeyFileError(f"{path} is not a readable private key ({_short(error)}); see edgec keygen") from None
    except Exception as error:  # cryptography's UnsupportedAlgorithm and relatives
        raise KeyFileError(f"{path} is not a usable private key ({type(error).__name__})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise KeyFileError(f"{path} is a {type(key).__name__}, not an Ed25519 key; make one with edgec keygen")
    return SigningKey(key, Path(path))


def load_public_keys(trust: Any) -> list[Any]:
    """The public keys in ``trust``: a key file (PEM or an OpenSSH ``ssh-ed25519`` line), a key object, or a
    sequence of them (several keys: e.g. the old and the new one while a key is being replaced)."""
    ed25519, serialization, _ = _crypto()
    items = list(trust) if isinstance(trust, Sequence) and not isinstance(trust, (str, bytes)) else [trust]
    if not items:
        raise KeyFileError("trust names no public key")
    keys = []
    for item in items:
        if isinstance(item, ed25519.Ed25519PublicKey):
            keys.append(item)
            continue
        if isinstance(item, SigningKey):
            keys.append(item.key.public_key())
            continue
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(f"trust takes public key files or Ed25519 public keys, not {type(item).__name__}")
        data = _read_key_file(item, "public key")
        try:
            if data.lstrip().startswith(b"ssh-"):
                key = serialization.load_ssh_public_key(data.strip())
            else:
                key = serialization.load_pem_public_key(data)
        except (ValueError, binascii.Error) as error:
            raise KeyFileError(f"{item} is not a readable public key ({_short(error)})") from None
        except Exception as error:  # cryptography's UnsupportedAlgorithm and relatives
            raise KeyFileError(f"{item} is not a usable public key ({type(error).__name__})") from None
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise KeyFileError(f"{item} is a {type(key).__name__}, not an Ed25519 public key")
        keys.append(key)
    return keys


def _short(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:120]


# --- signing and checking ---------------------------------------------------------------------------------------
def sign_document(document: dict[str, Any], key: SigningKey, purpose: str) -> dict[str, Any]:
    """The signature record of ``document`` (a bundle's or a pack's manifest)."""
    digest = canonical_digest(document)
    signature = key.key.sign(PURPOSES[purpose] + digest.encode())
    return {
        "format": SIGNATURE_FORMAT,
        "algorithm": "ed25519",
        "purpose": purpose,
        "key_id": key.key_id,
        "manifest_sha256": digest,
        "signature": base64.b64encode(signature).decode(),
    }


def check_document_signature(
    document: dict[str, Any], record: Any, trust: Any, purpose: str, where: str, names: tuple[str, str]
) -> str:
    """Check ``record`` (a parsed signature file) over ``document``; the id of the trusted key that signed it.
    ``names``: the document's and the signature's file names, for the message (one line naming the file)."""
    _, _, invalid_signature = _crypto()
    keys = {key_id(key): key for key in load_public_keys(trust)}
    document_name, signature_name = names
    if schema_errors(record, SIGNATURE_RECORD, signature_name) or record["format"] != SIGNATURE_FORMAT:
        raise SignatureError(f"{signature_name} in {where} is not an edgec signature")
    if record["algorithm"] != "ed25519" or record["purpose"] != purpose:
        raise SignatureError(f"{signature_name} in {where} is not an Ed25519 signature of a {purpose} manifest")
    signer = record["key_id"]
    if signer not in keys:
        raise SignatureError(
            f"{signature_name} in {where} is by key {show(signer)}, which is not trusted here "
            f"(trusted: {', '.join(keys)})"
        )
    digest = canonical_digest(document)
    if digest != record["manifest_sha256"]:
        raise SignatureError(f"{document_name} in {where} differs from the signed one: changed after signing")
    try:
        keys[signer].verify(base64.b64decode(record["signature"], validate=True), PURPOSES[purpose] + digest.encode())
    except (invalid_signature, binascii.Error, ValueError):
        raise SignatureError(
            f"{signature_name} in {where} is not a valid signature by key {signer}: damaged or forged"
        ) from None
    return signer


def sign_bundle(folder: str | Path, key: SigningKey) -> Path:
    """Write ``signature.json`` into the bundle ``folder`` (its manifest as it is on disk)."""
    folder = Path(folder)
    manifest = read_json(folder / MANIFEST)
    record = sign_document(manifest, key, "bundle")
    temporary = folder / f".{SIGNATURE}.tmp"
    temporary.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    if (epoch := source_date_epoch()) is not None:  # reproducible like the rest of the bundle (Ed25519 is too)
        os.utime(temporary, (epoch, epoch))
    os.replace(temporary, folder / SIGNATURE)
    return folder / SIGNATURE


def bundle_signer(folder: Path) -> str | None:
    """The key id a bundle says it is signed by (unchecked: for a summary), or None when it has no signature."""
    if not os.path.lexists(folder / SIGNATURE):
        return None
    try:
        record = read_json(folder / SIGNATURE, MAX_KEY_BYTES)
    except BundleError:
        return "(unreadable)"
    signer = record.get("key_id") if isinstance(record, dict) else None
    return signer if isinstance(signer, str) else "(unreadable)"


def check_bundle_signature(folder: Path, manifest: dict[str, Any], trust: Any) -> str:
    """The bundle's signature over ``manifest`` (as read by ``read_manifest``) by a trusted key; the key id."""
    path = folder / SIGNATURE
    if not os.path.lexists(path):
        raise SignatureError(
            f"{folder} is not signed (no {SIGNATURE}); with a trust key only bundles built or packed with --sign load"
        )
    try:
        record = read_json(path, MAX_KEY_BYTES)
    except BundleError as error:
        raise SignatureError(str(error)) from None
    return check_document_signature(manifest, record, trust, "bundle", str(folder), (MANIFEST, SIGNATURE))
