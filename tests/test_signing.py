"""Ed25519 signatures: edgec keygen, edgec build --sign, edgec verify --trust, Model.load(trust=...). A signed
bundle with one changed byte anywhere fails with one line naming the file; unsigned bundles keep working unless a
trust key is given."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
from click.testing import CliRunner

from edgec.cli import main
from edgec.errors import KeyFileError, SignatureError
from edgec.runtime import Model
from edgec.signing import generate_keypair, load_public_keys, load_signing_key, sign_bundle, sign_document

PROMPT = "def f(x):"


def invoke(*args, **kwargs):
    return CliRunner().invoke(main, [str(a) for a in args], **kwargs)


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    result = invoke("keygen", folder / "release")
    assert result.exit_code == 0, result.output
    other = generate_keypair(folder / "other")
    return {"key": folder / "release.key", "pub": folder / "release.pub", "other": other[1]}


@pytest.fixture(scope="module")
def signed_bundle(tmp_path_factory, tiny_llama, keys):
    """edgec build --sign, through the command line."""
    out = tmp_path_factory.mktemp("signed") / "signed.edgec"
    result = invoke("build", tiny_llama, "-o", out, "--context", "64", "--sign", keys["key"])
    assert result.exit_code == 0, result.output
    assert "signed by key" in result.output
    return out


@pytest.fixture
def signed_copy(signed_bundle, tmp_path):
    copy = tmp_path / "copy.edgec"
    shutil.copytree(signed_bundle, copy)
    return copy


def test_keygen_writes_a_private_and_a_public_key(keys):
    assert stat.S_IMODE(keys["key"].stat().st_mode) == 0o600
    assert keys["pub"].read_text().startswith("-----BEGIN PUBLIC KEY-----")
    assert one_error_line(invoke("keygen", keys["key"].with_suffix(""))).endswith("(keys are never overwritten)")


def test_a_signed_bundle_verifies_and_loads_with_its_key(signed_bundle, keys):
    assert (signed_bundle / "signature.json").is_file()
    result = invoke("verify", signed_bundle, "--trust", keys["pub"])
    assert result.exit_code == 0, result.output
    assert "PASS  signature: manifest signed by trusted key" in result.output
    model = Model.load(signed_bundle, trust=keys["pub"])
    assert model.generate(PROMPT, max_new_tokens=4) == Model.load(signed_bundle).generate(PROMPT, max_new_tokens=4)
    ran = invoke("run", signed_bundle, PROMPT, "-n", "2", "--trust", keys["pub"])
    assert ran.exit_code == 0, ran.output
    done = subprocess.run(
        [sys.executable, "-m", "edgec.runtime", str(signed_bundle), PROMPT, "-n", "2", "--trust", str(keys["pub"])],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "signed by key" in invoke("inspect", signed_bundle).output


def _flip_middle_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _change_manifest_value(path) -> None:
    manifest = json.loads(path.read_text())
    manifest["tokenizer"]["chat_note"] = manifest["tokenizer"]["chat_note"][:-1] + "?"  # one character
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _change_signature(path) -> None:
    record = json.loads(path.read_text())
    signature = record["signature"]
    record["signature"] = signature[:10] + ("A" if signature[10] != "A" else "B") + signature[11:]
    path.write_text(json.dumps(record))


BUNDLE_FILES = [
    "model.onnx",
    "model.onnx.data",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "validation.npz",
]


@pytest.mark.parametrize("name", [*BUNDLE_FILES, "manifest.json", "signature.json"])
def test_one_changed_byte_anywhere_fails_naming_the_file(signed_copy, keys, name):
    change = {"manifest.json": _change_manifest_value, "signature.json": _change_signature}.get(name, _flip_middle_byte)
    change(signed_copy / name)
    with pytest.raises(SignatureError, match=name.replace(".", r"\.")):
        Model.load(signed_copy, trust=keys["pub"])
    result = invoke("verify", signed_copy, "--trust", keys["pub"])
    assert result.exit_code == 1
    failed = [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert failed and name in failed[0], result.output
    assert name in one_error_line(invoke("run", signed_copy, PROMPT, "-n", "1", "--trust", keys["pub"]))


def test_a_changed_file_with_its_hash_recomputed_names_the_manifest(signed_copy, keys):
    """The attacker changes the weights and rewrites the manifest's hash: the manifest no longer matches."""
    _flip_middle_byte(signed_copy / "model.onnx.data")
    manifest = json.loads((signed_copy / "manifest.json").read_text())
    from edgec.bundle import sha256_file

    manifest["files"]["model.onnx.data"]["sha256"] = sha256_file(signed_copy / "model.onnx.data")
    (signed_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SignatureError, match=r"manifest\.json .* changed after signing"):
        Model.load(signed_copy, trust=keys["pub"])
    Model.load(signed_copy, check_hashes=True)  # without a trust key the rewrite is self-consistent: hence --trust


def test_an_added_file_fails_with_trust_only(signed_copy, keys):
    (signed_copy / "notes.txt").write_text("added later")
    with pytest.raises(SignatureError, match="notes.txt"):
        Model.load(signed_copy, trust=keys["pub"])
    Model.load(signed_copy)


def test_unsigned_bundles_work_unless_a_trust_key_is_given(tiny_bundle, keys):
    Model.load(tiny_bundle)
    assert invoke("verify", tiny_bundle).exit_code == 0
    with pytest.raises(SignatureError, match="is not signed"):
        Model.load(tiny_bundle, trust=keys["pub"])
    result = invoke("verify", tiny_bundle, "--trust", keys["pub"])
    assert result.exit_code == 1 and "FAIL  signature" in result.output


def test_another_key_is_refused_and_several_keys_are_accepted(signed_bundle, keys):
    with pytest.raises(SignatureError, match="not trusted here"):
        Model.load(signed_bundle, trust=keys["other"])
    Model.load(signed_bundle, trust=[keys["other"], keys["pub"]])  # e.g. while a key is being replaced
    assert invoke("verify", signed_bundle, "--trust", keys["other"], "--trust", keys["pub"]).exit_code == 0


def test_a_pack_signature_cannot_stand_in_for_a_bundle_signature(signed_copy, keys):
    manifest = json.loads((signed_copy / "manifest.json").read_text())
    record = sign_document(manifest, load_signing_key(keys["key"]), "pack")
    (signed_copy / "signature.json").write_text(json.dumps(record))
    with pytest.raises(SignatureError, match="not an Ed25519 signature of a bundle manifest"):
        Model.load(signed_copy, trust=keys["pub"])


def test_signing_again_after_a_change_is_the_signer_s_choice(signed_copy, keys):
    """sign_bundle signs what is there: the key holder vouches for it (this is what the key must be kept for)."""
    (signed_copy / "signature.json").unlink()
    sign_bundle(signed_copy, load_signing_key(keys["key"]))
    Model.load(signed_copy, trust=keys["pub"])


def test_key_files_are_checked(tmp_path, keys, signed_bundle):
    (tmp_path / "junk.pub").write_text("not a key")
    with pytest.raises(KeyFileError, match="not a readable public key"):
        Model.load(signed_bundle, trust=tmp_path / "junk.pub")
    with pytest.raises(KeyFileError, match="cannot read"):
        Model.load(signed_bundle, trust=tmp_path / "missing.pub")
    assert "not a readable public key" in one_error_line(
        invoke("verify", signed_bundle, "--trust", tmp_path / "junk.pub")
    )
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    other = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ec.key").write_bytes(
        other.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    with pytest.raises(KeyFileError, match="not an Ed25519 key"):
        load_signing_key(tmp_path / "ec.key")
    # an OpenSSH public key line is accepted
    public = load_public_keys(keys["pub"])[0]
    (tmp_path / "release.ssh").write_bytes(
        public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )
    Model.load(signed_bundle, trust=tmp_path / "release.ssh")


def test_an_encrypted_key_needs_its_passphrase(tmp_path, monkeypatch, tiny_llama):
    monkeypatch.setenv("EDGEC_KEY_PASSPHRASE", "correct horse")
    private, _ = generate_keypair(tmp_path / "locked")
    assert b"ENCRYPTED" in private.read_bytes()
    load_signing_key(private)
    monkeypatch.delenv("EDGEC_KEY_PASSPHRASE")
    with pytest.raises(KeyFileError, match="EDGEC_KEY_PASSPHRASE"):
        load_signing_key(private)
    # the build reads the key first: a missing passphrase costs no build and leaves nothing
    out = tmp_path / "b.edgec"
    assert "is encrypted" in one_error_line(invoke("build", tiny_llama, "-o", out, "--sign", private))
    assert not out.exists()


def test_without_cryptography_trust_is_one_clear_line(signed_bundle, keys):
    """The runtime needs cryptography only for trust=: without it, loading works and trust= says what to install."""
    code = (
        "import sys\n"
        "sys.modules['cryptography'] = None\n"
        "from edgec.runtime import Model, BundleError\n"
        f"Model.load({str(signed_bundle)!r})\n"
        "try:\n"
        f"    Model.load({str(signed_bundle)!r}, trust={str(keys['pub'])!r})\n"
        "except BundleError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ})
    assert done.returncode == 0, done.stderr
    assert "pip install 'edgec[trust]'" in done.stdout


@pytest.mark.parametrize(
    "text",
    ["[]", "{}", '"signature"', "null", "format-change", "extra-field"],
    ids=["list", "empty", "string", "null", "newer-format", "extra-field"],
)
def test_a_signature_file_that_is_not_edgec_s_is_one_line(signed_copy, keys, text):
    """signature.json from an attacker: not an object, missing fields, a format this edgec does not know or a field
    it does not expect. Refused in one line naming the file, never a traceback."""
    path = signed_copy / "signature.json"
    if text in ("format-change", "extra-field"):
        record = json.loads(path.read_text())
        record |= {"format": record["format"] + "-next"} if text == "format-change" else {"comment": "trust me"}
        text = json.dumps(record)
    path.write_text(text)
    with pytest.raises(SignatureError, match=r"signature\.json in .* is not an edgec signature"):
        Model.load(signed_copy, trust=keys["pub"])
    assert "is not an edgec signature" in one_error_line(
        invoke("run", signed_copy, PROMPT, "-n", "1", "--trust", keys["pub"])
    )
    assert invoke("verify", signed_copy, "--trust", keys["pub"]).exit_code == 1


def test_a_trust_key_of_another_kind_or_size_is_one_line(tmp_path, signed_bundle):
    """--trust with an EC public key, or a file far larger than any key (read no further than the limit)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    public = ec.generate_private_key(ec.SECP256R1()).public_key()
    (tmp_path / "ec.pub").write_bytes(
        public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    with pytest.raises(KeyFileError, match="not an Ed25519 public key"):
        Model.load(signed_bundle, trust=tmp_path / "ec.pub")
    (tmp_path / "huge.pub").write_bytes(b"-----BEGIN PUBLIC KEY-----\n" + b"A" * (1 << 20))
    with pytest.raises(KeyFileError, match="larger than 65,536 bytes"):
        Model.load(signed_bundle, trust=tmp_path / "huge.pub")
    for name in ("ec.pub", "huge.pub"):
        assert "public key" in one_error_line(invoke("verify", signed_bundle, "--trust", tmp_path / name))
