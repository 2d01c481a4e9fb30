"""A model named by its Hugging Face id comes from the local cache (laid out as huggingface_hub lays it out: refs,
snapshots of symbolic links into blobs), never from the network; every way of not finding it is one error line."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgec.errors import ModelLoadError
from edgec.hub import looks_like_repo_id, resolve_source
from edgec.plan import model_shape

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo: str, files: dict[str, Path], revision: str = COMMIT) -> Path:
    """``files`` (name → a local file) put in the cache as the Hub client does: a blob per content, a snapshot of
    relative links to the blobs, refs/main naming the snapshot."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / revision
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        shutil.copyfile(source, root / "blobs" / digest)
        os.symlink(Path("../../blobs") / digest, snapshot / name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_llama):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # read at import; the tests set it afterwards
    cache_repo(cache, "acme/tiny-llama", {p.name: p for p in tiny_llama.iterdir() if p.is_file()})
    gguf = tmp_path / "tiny.Q8_0.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    cache_repo(cache, "acme/tiny-gguf", {"tiny.Q8_0.gguf": gguf})
    cache_repo(cache, "acme/two-ggufs", {"a.Q4_0.gguf": gguf, "b.Q8_0.gguf": gguf})
    return cache


def test_an_id_in_the_cache_is_its_snapshot_folder(hub_cache, tiny_llama):
    folder = resolve_source("acme/tiny-llama")
    assert folder == hub_cache / "models--acme--tiny-llama" / "snapshots" / COMMIT
    assert model_shape("acme/tiny-llama").parameters() == model_shape(tiny_llama).parameters()


def test_a_gguf_repository_is_its_one_gguf_or_the_named_one(hub_cache):
    snapshot = hub_cache / "models--acme--two-ggufs" / "snapshots" / COMMIT
    assert resolve_source("acme/tiny-gguf").name == "tiny.Q8_0.gguf"
    assert resolve_source("acme/two-ggufs/b.Q8_0.gguf") == snapshot / "b.Q8_0.gguf"
    assert resolve_source(f"acme/two-ggufs@{COMMIT}/a.Q4_0.gguf") == snapshot / "a.Q4_0.gguf"
    with pytest.raises(ModelLoadError, match="several GGUF files; name one: acme/two-ggufs/a.Q4_0.gguf"):
        resolve_source("acme/two-ggufs")
    with pytest.raises(ModelLoadError, match="has no c.gguf"):
        resolve_source("acme/two-ggufs/c.gguf")


def test_an_id_not_in_the_cache_is_never_downloaded(hub_cache):
    with pytest.raises(ModelLoadError, match="never downloads; on a connected machine: huggingface-cli download"):
        resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ModelLoadError, match="acme/tiny-llama@v2 is neither"):
        resolve_source("acme/tiny-llama@v2")


def test_paths_and_odd_names_are_not_ids(tmp_path):
    assert resolve_source(tmp_path) == tmp_path  # an existing path wins over an id of the same spelling
    for text in ("../x/y", "/abs/path", "a/b/c", "a/../b", "x", "a/b/weights.bin", "-a/b"):
        assert not looks_like_repo_id(text), text
    assert looks_like_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_build_from_an_id_in_the_cache(hub_cache, tmp_path):
    """End to end through the CLI in a fresh process: the id builds the same bundle as the folder would."""
    out = tmp_path / "b.edgec"
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "edgec.cli", "build", "acme/tiny-llama", "-o", str(out), "--context", "64"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "manifest.json").is_file()
    missing = subprocess.run(
        [sys.executable, "-m", "edgec.cli", "build", "acme/absent", "-o", str(tmp_path / "c.edgec")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert missing.returncode == 2
    assert missing.stderr.startswith("error: acme/absent is neither a local path nor in the Hugging Face cache")
    assert "Traceback" not in missing.stderr and not (tmp_path / "c.edgec").exists()
