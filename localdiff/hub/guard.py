"""What keeps pulled models trustworthy between runs: a per-repo pull lock and a record of verified files.

* **Pull lock.** ``<cache>/.locks/models--org--name.localdiff-pull.lock`` (a ``filelock`` lock beside hf's own
  per-blob locks): ``pull`` holds it for the whole transfer, a second concurrent ``pull`` of the same repo waits for
  it (and says so), and ``rm`` refuses while it is held, so it never deletes a partial file under a running pull.
* **Verified record.** ``models--org--name/.localdiff/verified.json`` maps a blob name to ``[size, mtime_ns, hash]``
  as they were when the blob's hash was last checked (after a download, or by ``pull --verify``). ``list``, ``load``
  and ``pull`` compare a blob's size and mtime with it (one ``stat`` per file, no hashing) and notice a file changed
  since; ``pull`` then re-hashes just that file. Blobs without a record (e.g. written by ``hf download``) are trusted
  as hf verified them.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from localdiff.errors import HubError


def pull_lock_path(storage: Path) -> Path:
    """The pull lock file of a repo's storage folder (kept outside it, so ``rm`` can delete the folder)."""
    return storage.parent / ".locks" / f"{storage.name}.localdiff-pull.lock"


@contextmanager
def pull_lock(storage: Path, on_wait=None):
    """Hold the repo's pull lock; when another process holds it, call ``on_wait()`` once, then wait for it."""
    from filelock import FileLock, Timeout

    path = pull_lock_path(storage)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if on_wait is not None:
            on_wait()
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextmanager
def no_pull_running(storage: Path, name: str):
    """Hold the repo's pull lock for ``rm``; raise at once when a pull holds it.

    Raises:
        HubError: a pull of this repo is running.
    """
    from filelock import FileLock, Timeout

    path = pull_lock_path(storage)
    if not path.parent.is_dir():
        yield
        return
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise HubError(
            f"a pull of {name} is running; wait for it to finish (or stop it), then run `localdiff rm {name}` again"
        ) from None
    try:
        yield
    finally:
        lock.release()


def _record_file(storage: Path) -> Path:
    return storage / ".localdiff" / "verified.json"


def _read(storage: Path) -> dict:
    try:
        data = json.loads(_record_file(storage).read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def record_verified(storage: Path, blob: Path, digest: str | None = None) -> None:
    """Note that ``blob`` (in ``storage/blobs``) matched its hash just now: its size and mtime are recorded."""
    try:
        st = blob.stat()
    except OSError:
        return
    data = _read(storage)
    data[blob.name] = [st.st_size, st.st_mtime_ns, digest or blob.name]
    path = _record_file(storage)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def changed_since_verified(storage: Path, blob: Path) -> bool:
    """True when ``blob`` has a verified record and its size or mtime differs from it (or it is gone)."""
    rec = _read(storage).get(blob.name)
    if not isinstance(rec, list) or len(rec) < 2:
        return False
    try:
        st = blob.stat()
    except OSError:
        return True
    return [st.st_size, st.st_mtime_ns] != rec[:2]


def changed_files(storage: Path, commit: str, allow, ignore) -> list[str]:
    """Repo paths of a snapshot whose blobs changed since they were verified (one stat per file, no hashing)."""
    from localdiff.hub.hf_cache import filter_files, read_tree

    tree = read_tree(storage, commit)
    if tree is None or not _record_file(storage).is_file():
        return []
    out = []
    for rf in filter_files(tree, allow, ignore):
        if (rf.sha256 or rf.blob_id) and changed_since_verified(storage, storage / "blobs" / rf.blob_name):
            out.append(rf.path)
    return out
