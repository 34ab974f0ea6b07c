"""The Hugging Face cache layout, read and written the way huggingface_hub does it.

``<HF_HUB_CACHE>/models--org--name/``::

    refs/<revision>                    text file holding a 40-hex commit
    blobs/<sha256 or git-sha1>         file contents (``.incomplete`` suffix while partial)
    snapshots/<commit>/<path>          relative symlinks into ../../blobs/
    trees/<commit>.json                the repo's file listing at that commit (hf's tree cache, format 1)

A snapshot is *complete* when every file of the tree listing that matches the pull's patterns exists in the
snapshot with the listed size. Snapshots written without a tree listing (older hf versions) are judged from their
``config.json`` and safetensors index instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from localdiff.hub.download import RemoteFile

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
TREE_FORMAT_VERSION = 1


def hub_cache_dir() -> Path:
    """The hub cache folder huggingface_hub uses (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def check_cache_folders() -> None:
    """Refuse a Hugging Face home or hub cache that is not a folder (``HF_HOME=/dev/full``, a file): huggingface_hub
    reads its token from ``HF_HOME/token`` and a pull writes under the hub cache, which failed with a raw
    NotADirectoryError. A folder that does not exist yet is fine (a pull creates it).

    Raises:
        HubError: the first existing path of HF_HOME or of the hub cache is not a folder.
    """
    from huggingface_hub import constants

    from localdiff.errors import HubError

    for path in (Path(constants.HF_HOME).expanduser(), hub_cache_dir()):
        there = path
        while not there.exists() and there != there.parent:
            there = there.parent
        if not there.is_dir():
            what = "is not a folder" if there == path else f"cannot be created: {there} is not a folder"
            raise HubError(f"the Hugging Face cache {path} {what} (set HF_HOME or HF_HUB_CACHE to a folder)")


def storage_folder(repo_id: str, cache_dir: Path | None = None) -> Path:
    """``<cache>/models--org--name`` for a model repo."""
    return (cache_dir or hub_cache_dir()) / ("models--" + repo_id.replace("/", "--"))


def repo_id_from_folder(folder: Path) -> str | None:
    """Inverse of :func:`storage_folder` ("models--org--name" → "org/name"); None for other repo types."""
    name = folder.name
    if not name.startswith("models--"):
        return None
    return name[len("models--") :].replace("--", "/", 1)


def read_ref(storage: Path, revision: str) -> str | None:
    """The commit a revision points to (the revision itself when it is a commit), or None when unknown."""
    if COMMIT_RE.match(revision):
        return revision
    ref = _ref_path(storage, revision)
    if ref is None:
        return None
    try:
        commit = ref.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return commit if COMMIT_RE.match(commit) else None


def write_ref(storage: Path, revision: str, commit: str) -> None:
    """Point ``refs/<revision>`` at ``commit`` atomically (skipped when ``revision`` is the commit itself)."""
    if revision == commit:
        return
    ref = _ref_path(storage, revision)
    if ref is None:
        raise ValueError(f"revision {revision!r} would leave {storage / 'refs'}")
    _atomic_write(ref, commit)


def _ref_path(storage: Path, revision: str) -> Path | None:
    """``refs/<revision>``, or None when that path would not stay inside ``refs/`` (``..``, absolute)."""
    refs = storage / "refs"
    path = refs / revision
    if os.path.isabs(revision) or os.path.normpath(path) != str(path) or not str(path).startswith(str(refs) + os.sep):
        return None
    return path


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_tree(storage: Path, commit: str, files: list[RemoteFile]) -> None:
    """Write hf's tree cache ``trees/<commit>.json`` (format 1) for the full file list of a commit."""
    data = {"format_version": TREE_FORMAT_VERSION, "files": {}}
    for rf in sorted(files, key=lambda r: r.path):
        info: dict = {"size": rf.size, "blob_id": rf.blob_id or ""}
        if rf.sha256:
            info["lfs_sha256"] = rf.sha256
            info["lfs_size"] = rf.size
        data["files"][rf.path] = info
    _atomic_write(storage / "trees" / f"{commit}.json", json.dumps(data, indent=1))


def read_tree(storage: Path, commit: str) -> list[RemoteFile] | None:
    """The tree listing of a commit from hf's tree cache, or None when absent / unreadable / unknown format."""
    try:
        data = json.loads((storage / "trees" / f"{commit}.json").read_text(encoding="utf-8"))
        if data.get("format_version") != TREE_FORMAT_VERSION:
            return None
        return [
            RemoteFile(path=p, size=int(i["size"]), blob_id=i.get("blob_id") or None, sha256=i.get("lfs_sha256"))
            for p, i in data["files"].items()
        ]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def filter_files(files: list[RemoteFile], allow, ignore) -> list[RemoteFile]:
    """Files matching ``allow`` and not ``ignore`` (fnmatch globs, as hf's ``filter_repo_objects``)."""
    from huggingface_hub.utils import filter_repo_objects

    return list(
        filter_repo_objects(
            files, allow_patterns=list(allow) or None, ignore_patterns=list(ignore) or None, key=lambda r: r.path
        )
    )


@dataclass(frozen=True)
class SnapshotStatus:
    """How complete a snapshot is.

    Attributes:
        complete: all expected files present with the right sizes.
        missing: repo paths absent or with a wrong size.
        size_bytes: bytes of the expected files that are present.
        verified_by: "tree" (checked against the tree listing) or "config" (fallback heuristics).
    """

    complete: bool
    missing: tuple[str, ...]
    size_bytes: int
    verified_by: str


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size  # follows the symlink into blobs/
    except OSError:
        return None


def snapshot_status(storage: Path, commit: str, allow, ignore) -> SnapshotStatus:
    """Check ``snapshots/<commit>`` against the tree listing filtered by the pull patterns."""
    snap = storage / "snapshots" / commit
    tree = read_tree(storage, commit)
    if tree is not None:
        expected = filter_files(tree, allow, ignore)
        missing, total = [], 0
        for rf in expected:
            got = _size(snap / rf.path)
            if got != rf.size:
                missing.append(rf.path)
            else:
                total += got
        ok = bool(expected) and not missing
        return SnapshotStatus(ok, tuple(missing), total, "tree")
    return _heuristic_status(snap)


def _heuristic_status(snap: Path) -> SnapshotStatus:
    """Completeness without a tree listing: config.json plus every shard the safetensors index names."""
    missing: list[str] = []
    if _size(snap / "config.json") is None:
        missing.append("config.json")
    index = snap / "model.safetensors.index.json"
    shards: set[str] = set()
    if index.exists():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            missing.append("model.safetensors.index.json")
    elif snap.is_dir():
        shards = {p.name for p in snap.glob("*.safetensors")}
        if not shards:
            missing.append("*.safetensors")
    for s in sorted(shards):
        if not _size(snap / s):
            missing.append(s)
    total = sum(_size(p) or 0 for p in snap.rglob("*") if p.is_file()) if snap.is_dir() else 0
    return SnapshotStatus(not missing, tuple(missing), total, "config")


def snapshot_blobs(snap: Path) -> set[str]:
    """Names of the blobs a snapshot's symlinks point to."""
    out: set[str] = set()
    if not snap.is_dir():
        return out
    for p in snap.rglob("*"):
        if p.is_symlink():
            out.add(Path(os.readlink(p)).name)
    return out


def remove_snapshot(storage: Path, commit: str) -> int:
    """Delete a snapshot, the refs pointing at it, its tree listing, the blobs no other snapshot uses and its partial
    files; delete the whole repo folder (and its hf lock folder) when nothing is left.

    Returns:
        Bytes freed (blob and partial file sizes).
    """
    freed = 0
    snaps = storage / "snapshots"
    mine = snapshot_blobs(snaps / commit)
    tree = read_tree(storage, commit) or []
    mine |= {rf.blob_name for rf in tree if rf.sha256 or rf.blob_id}
    others: set[str] = set()
    if snaps.is_dir():
        for other in snaps.iterdir():
            if other.name != commit:
                others |= snapshot_blobs(other)
    shutil.rmtree(snaps / commit, ignore_errors=True)
    for ref in list((storage / "refs").rglob("*")) if (storage / "refs").is_dir() else []:
        if ref.is_file() and read_ref(storage, str(ref.relative_to(storage / "refs"))) == commit:
            ref.unlink()
    (storage / "trees" / f"{commit}.json").unlink(missing_ok=True)
    shutil.rmtree(storage / ".no_exist" / commit, ignore_errors=True)
    blobs = storage / "blobs"
    remaining = [p for p in snaps.iterdir()] if snaps.is_dir() else []
    if blobs.is_dir():
        for b in blobs.iterdir():
            base = b.name.split(".", 1)[0]
            partial = b.name.endswith(".incomplete")
            if (base in mine and base not in others) or (partial and not remaining):
                freed += b.stat().st_size if b.is_file() else 0
                b.unlink(missing_ok=True)
    refs_left = any(p.is_file() for p in (storage / "refs").rglob("*")) if (storage / "refs").is_dir() else False
    if not remaining and not refs_left:
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(storage.parent / ".locks" / storage.name, ignore_errors=True)
    return freed


def cached_repos(cache_dir: Path | None = None) -> list[Path]:
    """Storage folders of model repos in the cache (sorted)."""
    root = cache_dir or hub_cache_dir()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("models--"))


def repo_refs(storage: Path) -> dict[str, str]:
    """revision name → commit for every ref of a repo folder."""
    out: dict[str, str] = {}
    refs = storage / "refs"
    if refs.is_dir():
        for ref in refs.rglob("*"):
            if ref.is_file():
                rev = str(ref.relative_to(refs))
                commit = read_ref(storage, rev)
                if commit:
                    out[rev] = commit
    return out


def repo_revisions(storage: Path) -> dict[str, str]:
    """revision → commit for everything pulled into a repo folder: its refs (:func:`repo_refs`) plus each snapshot
    that no ref points to, under its own commit (a pull *at* a commit, e.g. a catalog-pinned revision, writes no ref)."""
    out = repo_refs(storage)
    snaps = storage / "snapshots"
    if snaps.is_dir():
        referenced = set(out.values())
        for snap in snaps.iterdir():
            if snap.is_dir() and COMMIT_RE.match(snap.name) and snap.name not in referenced:
                out[snap.name] = snap.name
    return out
