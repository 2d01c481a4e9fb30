"""A model named by its Hugging Face id (``owner/name``, ``owner/name@revision`` or ``owner/name/FILE.gguf``), taken
from the local Hugging Face cache and never downloaded: edgec builds offline, so a model that is not in the cache
is one clear error naming the command that would fetch it on a connected machine."""

from __future__ import annotations

import re
from pathlib import Path

from edgec.errors import ModelLoadError

# owner/name[@revision][/FILE.gguf]: the characters the Hub allows in names; no "..", no absolute paths
_REPO_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95})"
    r"(?:@(?P<revision>[A-Za-z0-9._/-]{1,100}?))?(?:/(?P<file>[A-Za-z0-9][A-Za-z0-9._-]*\.gguf))?$"
)


def looks_like_repo_id(text: str) -> bool:
    return ".." not in text and _REPO_ID.match(text) is not None


def resolve_source(source: str | Path) -> Path:
    """``source`` as a local path: itself when it exists, else the snapshot of a Hub id in the local cache (a folder
    with config.json, the one .gguf of a GGUF-only repository, or the named ``FILE.gguf``)."""
    path = Path(source)
    if path.exists() or not looks_like_repo_id(str(source)):
        return path
    match = _REPO_ID.match(str(source))
    repo, revision, file = match["repo"], match["revision"], match["file"]
    snapshot = _cached_snapshot(repo, revision)
    if file is not None:
        chosen = snapshot / file
        if not chosen.is_file():
            raise ModelLoadError(f"the cached {repo} has no {file} ({_listing(snapshot)})")
        return chosen
    if (snapshot / "config.json").is_file():
        return snapshot
    ggufs = sorted(p.name for p in snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return snapshot / ggufs[0]
    if ggufs:
        raise ModelLoadError(f"{repo} holds several GGUF files; name one: " + ", ".join(f"{repo}/{g}" for g in ggufs))
    raise ModelLoadError(f"the cached {repo} has neither config.json nor a .gguf ({_listing(snapshot)})")


def _cached_snapshot(repo: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        at = f"@{revision}" if revision else ""
        raise ModelLoadError(
            f"{repo}{at} is neither a local path nor in the Hugging Face cache (edgec never downloads; on a connected "
            f"machine: huggingface-cli download {repo}, or pass the model folder or .gguf file)"
        ) from None
    except Exception as error:  # a corrupt cache entry or a bad revision name: one line, not a traceback
        reason = f"{type(error).__name__}: {error}"
        raise ModelLoadError(f"cannot read {repo} from the Hugging Face cache ({reason})") from None


def _listing(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir())[:8]
    return "it has " + (", ".join(names) if names else "no files")
