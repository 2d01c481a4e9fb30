"""Hypothesis fuzz of what a bundle or pack from anywhere may hold (issue 15): a structure-aware mutation of a real
manifest.json and of a real PACK.json — values replaced with hostile ones (paths outside the bundle, links, huge
and negative numbers, markup, escape codes, wrong types), keys removed and added, the JSON text itself broken —
must never give a traceback (only the documented exceptions, or one error line from the CLI) and never read a
file outside the bundle (watched by the kernel, so ONNX Runtime's and tokenizers' own reads count)."""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import tarfile

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from edgec.cli import main
from edgec.errors import BundleError, GenerationError, KeyFileError
from edgec.pack import pack, unpack
from edgec.runtime import Model
from edgec.verify import verify
from tests.hostile import FileWatch, file_entry

DOCUMENTED = (BundleError, GenerationError, KeyFileError, TypeError)
OUTSIDE_FILES = ("tokenizer.json", "model.onnx", "model.onnx.data")
HOSTILE_PATHS = (
    "../outside/tokenizer.json",
    "{outside}/tokenizer.json",
    "..\\outside\\tokenizer.json",
    "sub/../../outside/model.onnx",
    "link.json",
    "linkdir/tokenizer.json",
    "linkdir/model.onnx",
    "./tokenizer.json",
    "tokenizer.json/",
    "",
    "tok\x1b[2Jen.json",
    "tokenizer.json\x00",
    "~/outside/tokenizer.json",
    "C:/outside/tokenizer.json",
    "file:///etc/passwd",
    "model.onnx.data",
    "manifest.json",
    "signature.json",
    "validation.npz",
    "[/]",
)
scalars = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2, 3, 16, 127, 128, 383, 384, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.sampled_from(HOSTILE_PATHS),
    st.sampled_from(["float16", "int4", "chunk", "numbers", "CPUExecutionProvider", "AzureExecutionProvider"]),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=6,
)
RAW_EDITS = (
    lambda text: text.replace('"format_version": 1', '"format_version": 1, "format_version": 1', 1),
    lambda text: text.replace("128", "1e999", 1),
    lambda text: text.replace("128", "NaN", 1),
    lambda text: text.replace("128", "9" * 5000, 1),
    lambda text: "[" * 50_000 + text + "]" * 50_000,
    lambda text: text[: len(text) // 2],
    lambda text: text.replace('"', "\udcff", 1),
)


def _paths(document, prefix=()):
    """Every place in a JSON document: its keys and list indices, containers included."""
    yield prefix
    if isinstance(document, dict):
        for key, value in document.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            yield from _paths(value, (*prefix, index))


def _parent(document, path):
    for key in path[:-1]:
        document = document[key]
    return document


def mutate(data, base: dict, outside, extra_values=(), listed: dict | None = None) -> str:
    """A hostile variant of ``base`` as JSON text: a few mutations at places drawn from its structure.
    ``listed``: file entries an attacker may add to ``files`` (a name outside or a link, with the right hash)."""
    document = copy.deepcopy(base)
    if listed and data.draw(st.booleans(), label="list a hostile file"):
        name = data.draw(st.sampled_from(sorted(listed)), label="listed")
        document["files"][name.format(outside=outside)] = copy.deepcopy(listed[name])
        field = data.draw(st.sampled_from([("tokenizer", "file"), ("model", "file"), None]), label="pointed")
        if field:
            document[field[0]][field[1]] = name.format(outside=outside)
    for _ in range(data.draw(st.integers(0, 3), label="mutations")):
        places = [path for path in _paths(document) if path]
        path = data.draw(st.sampled_from(places), label="where")
        parent = _parent(document, path)
        operation = data.draw(st.sampled_from(["nudge"] * 4 + ["replace", "delete", "add", "path"]), label="how")
        current = parent[path[-1]]
        if operation == "nudge":  # a plausible value of the same type: what makes a manifest load and then misbehave
            if isinstance(current, bool):
                parent[path[-1]] = not current
            elif isinstance(current, int):
                parent[path[-1]] = data.draw(st.integers(0, 2 * abs(current) + 2), label="number")
            elif isinstance(current, float):
                parent[path[-1]] = data.draw(st.floats(0, 2 * min(abs(current), 1e300) + 1), label="fraction")
            elif isinstance(current, str):
                parent[path[-1]] = data.draw(st.one_of(st.text(max_size=12), st.sampled_from(HOSTILE_PATHS)))
            elif isinstance(current, list) and current:
                parent[path[-1]] = current[: data.draw(st.integers(0, len(current) - 1), label="keep")]
            elif isinstance(current, dict) and current:
                del current[data.draw(st.sampled_from(sorted(current)), label="drop key")]
        elif operation == "delete":
            del parent[path[-1]]
        elif operation == "add" and isinstance(parent, dict):
            parent[data.draw(st.text(max_size=10), label="new key")] = data.draw(values, label="new value")
        elif operation == "path":
            hostile = data.draw(st.sampled_from(HOSTILE_PATHS + tuple(extra_values)), label="path").format(
                outside=outside
            )
            parent[path[-1]] = hostile
        else:
            parent[path[-1]] = data.draw(values, label="value")
    text = json.dumps(document, indent=1)
    if data.draw(st.booleans(), label="raw edit"):
        text = data.draw(st.sampled_from(RAW_EDITS), label="edit")(text)
    return text


@pytest.fixture(scope="module")
def arena(tiny_bundle, tmp_path_factory):
    """A copy of the tiny bundle with links to a folder of real bundle files beside it (what hostile paths name),
    the manifest the attacker starts from, and file entries for the outside files (hashes right) to list."""
    root = tmp_path_factory.mktemp("fuzz")
    outside = root / "outside"
    outside.mkdir()
    for name in OUTSIDE_FILES:
        shutil.copy(tiny_bundle / name, outside / name)
    bundle = root / "bundle.edgec"
    shutil.copytree(tiny_bundle, bundle)
    os.symlink(outside / "tokenizer.json", bundle / "link.json")
    os.symlink(outside, bundle / "linkdir")
    base = json.loads((tiny_bundle / "manifest.json").read_text())
    tokenizer, graph = file_entry(outside / "tokenizer.json"), file_entry(outside / "model.onnx")
    listed = {
        "link.json": tokenizer,
        "linkdir/tokenizer.json": tokenizer,
        "linkdir/model.onnx": graph,
        "../outside/tokenizer.json": tokenizer,
        "{outside}/model.onnx": graph,
    }
    return bundle, outside, base, listed


def _watch_is_live(watch, outside) -> None:
    (outside / "model.onnx").read_bytes()
    assert str(outside / "model.onnx") in watch.events(), "the read watch does not see reads"


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_hostile_manifest_never_gives_a_traceback_or_reads_outside(arena, data):
    bundle, outside, base, listed = arena
    watch = FileWatch(outside)
    try:
        _watch_is_live(watch, outside)
        (bundle / "manifest.json").write_text(mutate(data, base, outside, listed=listed), errors="surrogateescape")
        try:
            model = Model.load(bundle, check_hashes=data.draw(st.booleans(), label="check hashes"))
            text = model.generate("def f(x):", max_new_tokens=2)
            assert isinstance(text, str)
            event("loaded and generated")
        except DOCUMENTED as error:
            event(f"refused: {type(error).__name__}")
        assert all(check.status in ("pass", "fail", "skip") for check in verify(bundle))
        for command in (["inspect", str(bundle)], ["run", str(bundle), "hi", "-n", "1"]):
            result = CliRunner().invoke(main, command)
            assert result.exit_code in (0, 2) and isinstance(result.exception, (SystemExit, type(None))), (
                command,
                result.output,
                result.exception,
            )
            if result.exit_code == 2:
                lines = [line for line in result.stderr.splitlines() if line.strip()]
                assert len(lines) == 1 and lines[0].startswith("error: ") and "\x1b" not in lines[0], result.stderr
        assert watch.events() == [], "a file outside the bundle was read"
    finally:
        watch.close()


@pytest.fixture(scope="module")
def pack_arena(tiny_bundle, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-pack")
    outside = root / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for a pack")
    work = root / "work"
    work.mkdir()
    archive = pack(tiny_bundle, root / "base.tar")
    with tarfile.open(archive) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    return work, outside, members


def _write_pack(path, members: dict[str, bytes], document: str) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, content in {**members, "PACK.json": document.encode("utf-8", "surrogateescape")}.items():
            entry = tarfile.TarInfo(name)
            entry.size = len(content)
            tar.addfile(entry, io.BytesIO(content))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_hostile_pack_json_never_gives_a_traceback_or_writes_outside(pack_arena, data):
    work, outside, members = pack_arena
    base = json.loads(members["PACK.json"])
    document = mutate(data, base, outside, extra_values=("../outside", "{outside}", "tiny.cpu.edgec/../../x"))
    # the archive holds whatever PACK.json now lists (an attacker ships the members they name)
    try:
        listed = json.loads(document).get("files", {})
    except (ValueError, AttributeError, RecursionError):
        listed = {}
    shipped = dict(members)
    if isinstance(listed, dict):
        for name in listed:
            if isinstance(name, str) and name and "\x00" not in name and name not in shipped:
                shipped[name] = b"x"
    if data.draw(st.booleans(), label="drop a member"):
        shipped.pop(data.draw(st.sampled_from(sorted(shipped)), label="dropped"), None)
    archive = work / "p.tar"
    try:
        _write_pack(archive, shipped, document)
    except (ValueError, UnicodeEncodeError):
        return  # a name tar cannot even hold
    out = work / "out"
    watch = FileWatch(outside)
    try:
        try:
            bundle = unpack(archive, out)
            assert bundle.parent == out and bundle.is_dir()
            event("unpacked")
        except BundleError:
            assert not out.exists()
            event("refused")
        result = CliRunner().invoke(main, ["unpack", str(archive), "-o", str(work / "cli")])
        assert result.exit_code in (0, 2) and isinstance(result.exception, (SystemExit, type(None))), result.output
        assert watch.events() == [], "a file outside the output was read"
        assert sorted(os.listdir(work)) in (["p.tar"], ["out", "p.tar"], ["cli", "p.tar"], ["cli", "out", "p.tar"])
        assert sorted(os.listdir(outside)) == ["secret.txt"]
        assert not (work.parent / "x").exists()
    finally:
        watch.close()
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(work / "cli", ignore_errors=True)
