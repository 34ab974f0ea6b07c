"""Resumable single-file download into the Hugging Face cache's blob store, with size and hash verification.

huggingface_hub 2.4.0 restarts an interrupted file from byte 0 and deletes its partial file, so a 5 GB shard cut at
4.9 GB costs 4.9 GB again. Here a partial file is kept as ``blobs/<blob>.incomplete`` (hf itself now uses
``<blob>.<random>.incomplete`` names, so the two never collide) and the next attempt sends ``Range: bytes=N-``.
When the file is whole it is verified — size, plus sha256 for LFS files or the git blob sha1 for small files — and
renamed to ``blobs/<blob>``, which is exactly the name ``hf_hub_download`` gives it (the X-Linked-Etag / ETag), so
``hf download`` and ``localdiff pull`` reuse each other's files. The same per-blob lock file as hf is held.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from localdiff.errors import HubError

CHUNK = 1 << 20  # bytes per read / write
RETRY_STATUSES = (429, 500, 502, 503, 504)  # transient: retried with backoff (Retry-After honoured)
RETRY_BASE_S = 0.5  # first backoff; doubles per consecutive failure
RETRY_MAX_S = 30.0  # longest single wait (a longer Retry-After is capped to this)


def sleep(seconds: float) -> None:
    """``time.sleep`` (one place, so tests can record the backoff instead of waiting)."""
    time.sleep(seconds)


def retry_delay(retry_after: str | None, failures: int) -> float:
    """Seconds to wait before retry number ``failures`` (1-based): the server's ``Retry-After`` (seconds or an HTTP
    date) when given, else ``RETRY_BASE_S * 2**(failures-1)``; capped at ``RETRY_MAX_S``."""
    if retry_after:
        try:
            return min(max(float(retry_after), 0.0), RETRY_MAX_S)
        except ValueError:
            from email.utils import parsedate_to_datetime

            try:
                when = parsedate_to_datetime(retry_after).timestamp()
                return min(max(when - time.time(), 0.0), RETRY_MAX_S)
            except (TypeError, ValueError, OverflowError):
                pass
    return min(RETRY_BASE_S * 2 ** max(failures - 1, 0), RETRY_MAX_S)


@dataclass(frozen=True)
class RemoteFile:
    """A file of a repo at a commit, from the Hub's revision info (``siblings[]`` with ``blobs=true``).

    Attributes:
        path: repo-relative path ("model-00001-of-00002.safetensors").
        size: bytes.
        blob_id: git blob sha1 (40 hex), the ETag of a non-LFS file.
        sha256: LFS sha256 (64 hex) or None for a file stored in git.
    """

    path: str
    size: int
    blob_id: str | None = None
    sha256: str | None = None

    @property
    def blob_name(self) -> str:
        """The blob file name hf uses: the LFS sha256, else the git blob sha1."""
        name = self.sha256 or self.blob_id
        if not name:
            raise HubError(f"the Hub gave no blob id for {self.path}")
        return name


def git_blob_sha1_hasher(size: int):
    """A sha1 hasher primed with git's blob header, so feeding the content yields the git blob id."""
    h = hashlib.sha1()
    h.update(b"blob %d\0" % size)
    return h


def new_hasher(rf: RemoteFile):
    """The hasher whose hexdigest must equal ``rf.sha256`` (LFS) or ``rf.blob_id`` (git); None if neither is known."""
    if rf.sha256:
        return hashlib.sha256()
    if rf.blob_id:
        return git_blob_sha1_hasher(rf.size)
    return None


def hash_file(path: Path, hasher, limit: int | None = None):
    """Feed the first ``limit`` bytes (default all) of ``path`` into ``hasher``; returns the hasher."""
    left = limit
    with open(path, "rb") as f:
        while left is None or left > 0:
            buf = f.read(CHUNK if left is None else min(CHUNK, left))
            if not buf:
                break
            hasher.update(buf)
            if left is not None:
                left -= len(buf)
    return hasher


def verify_file(path: Path, rf: RemoteFile) -> str | None:
    """Check a finished file against the Hub's metadata. Returns None when it matches, else a short reason."""
    size = path.stat().st_size
    if size != rf.size:
        return f"size {size} != expected {rf.size}"
    h = new_hasher(rf)
    if h is None:
        return None
    digest = hash_file(path, h).hexdigest()
    want = rf.sha256 or rf.blob_id
    return None if digest == want else f"checksum {digest[:12]}… != expected {want[:12]}…"


def _disk_full(e: OSError, path: Path, rf: RemoteFile, have: int) -> HubError:
    need = rf.size - have
    return HubError(
        f"disk full while downloading {rf.path} into {path.parent} ({need / 1e9:.2f} GB still needed); "
        "free some space and run the same pull again — it resumes from the bytes already on disk"
    )


def fetch_blob(
    url: str,
    blob_path: Path,
    rf: RemoteFile,
    headers: dict,
    progress,
    lock_path: Path | None = None,
    max_retries: int = 5,
    timeout: float = 10.0,
) -> int:
    """Download ``url`` into ``blob_path`` (resuming ``blob_path + '.incomplete'``), verify it, and move it in place.

    Args:
        url: the ``/resolve/<commit>/<path>`` URL (redirects are followed; hf's session adds auth / proxies).
        blob_path: final ``blobs/<blob>`` path.
        rf: expected size and hash.
        headers: request headers (``huggingface_hub.utils.build_hf_headers``).
        progress: a reporter from ``localdiff.hub.progress`` (gets ``file_start`` / ``advance`` / ``file_done``).
        lock_path: hf's per-blob lock file (held while downloading), or None.
        max_retries: consecutive failed attempts (no new bytes, or HTTP 429 / 5xx) before giving up; a cut
            connection that delivered bytes resets the count. Each retry waits (``retry_delay``: Retry-After, else
            exponential backoff) and resumes with ``Range``.
        timeout: seconds without data before an attempt fails.
    Returns:
        Bytes received over the network in this call.
    Raises:
        HubError: HTTP error, too many failed attempts, checksum mismatch twice, or disk full.
    """
    from huggingface_hub.utils import WeakFileLock

    blob_path.parent.mkdir(parents=True, exist_ok=True)
    if lock_path is None:
        return _fetch_locked(url, blob_path, rf, headers, progress, max_retries, timeout)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock_path):
        return _fetch_locked(url, blob_path, rf, headers, progress, max_retries, timeout)


def _fetch_locked(url, blob_path: Path, rf: RemoteFile, headers, progress, max_retries, timeout) -> int:
    if blob_path.exists() and blob_path.stat().st_size == rf.size:
        return 0  # another process (or hf) finished it while we waited for the lock
    part = blob_path.with_name(blob_path.name + ".incomplete")
    received = 0
    for attempt in range(2):  # a second full attempt only after a checksum mismatch
        have = part.stat().st_size if part.exists() else 0
        if have > rf.size:
            part.unlink()
            have = 0
        hasher = new_hasher(rf)
        if hasher is not None and have:
            hash_file(part, hasher, have)
        progress.file_start(rf.path, rf.size, have)
        got, hasher = _transfer(url, part, rf, headers, progress, hasher, max_retries, timeout)
        received += got
        problem = None
        size = part.stat().st_size
        if size != rf.size:
            problem = f"size {size} != expected {rf.size}"
        elif hasher is not None and hasher.hexdigest() != (rf.sha256 or rf.blob_id):
            problem = f"checksum mismatch ({hasher.hexdigest()[:12]}… != {(rf.sha256 or rf.blob_id)[:12]}…)"
        if problem is None:
            os.chmod(part, 0o644 & ~_umask())
            os.replace(part, blob_path)
            progress.file_done(rf.path)
            return received
        part.unlink(missing_ok=True)
        progress.note(f"{rf.path}: {problem}; fetching it again from the start")
    raise HubError(f"{rf.path} failed verification twice ({problem}); the server or a proxy is corrupting it")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _transfer(url, part: Path, rf: RemoteFile, headers, progress, hasher, max_retries, timeout):
    """Append bytes to ``part`` until it holds ``rf.size`` bytes, resuming with Range after cuts.

    Returns (bytes received, hasher) — the hasher is replaced when the server forces a restart from byte 0.
    """
    import httpx2
    from huggingface_hub.utils import get_session, hf_raise_for_status

    session = get_session()
    failures = 0
    received = 0
    while True:
        have = part.stat().st_size if part.exists() else 0
        if have >= rf.size:
            return received, hasher
        req_headers = dict(headers)
        req_headers["Accept-Encoding"] = "identity"
        if have:
            req_headers["Range"] = f"bytes={have}-"
        got_this_attempt = 0
        try:
            with session.stream(
                "GET", url, headers=req_headers, timeout=httpx2.Timeout(timeout, read=timeout), follow_redirects=True
            ) as resp:
                if resp.status_code == 416:  # our partial is not a prefix the server accepts: start over
                    part.unlink(missing_ok=True)
                    hasher = _reset(hasher, rf)
                    failures += 1
                    if failures > max_retries:
                        raise HubError(f"{rf.path}: the server refused to resume (416) repeatedly")
                    continue
                if resp.status_code in RETRY_STATUSES:
                    resp.read()
                    failures += 1
                    if failures > max_retries:
                        raise HubError(
                            f"the Hub kept answering {resp.status_code} for {rf.path} ({failures} tries): "
                            "a problem on its side; run the same pull again later — it resumes from the "
                            "bytes already on disk"
                        )
                    sleep(retry_delay(resp.headers.get("Retry-After"), failures))
                    continue
                if resp.status_code >= 400:
                    resp.read()
                    hf_raise_for_status(resp)
                mode = "ab"
                if have and resp.status_code != 206:
                    # The server ignored Range (200): rewrite from byte 0.
                    mode, have = "wb", 0
                    hasher = _reset(hasher, rf)
                    progress.note(f"{rf.path}: server does not support resume; restarting this file")
                elif have:
                    start = _content_range_start(resp.headers.get("Content-Range"))
                    if start != have:
                        raise HubError(f"{rf.path}: server resumed at byte {start}, asked for {have}")
                with open(part, mode) as f:
                    for chunk in resp.iter_bytes():  # as received: a cut loses nothing
                        try:
                            f.write(chunk)
                            f.flush()
                        except OSError as e:
                            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                                raise _disk_full(e, part, rf, have + got_this_attempt) from None
                            raise
                        if hasher is not None:
                            hasher.update(chunk)
                        got_this_attempt += len(chunk)
                        received += len(chunk)
                        progress.advance(len(chunk))
                        if have + got_this_attempt > rf.size:
                            raise HubError(f"{rf.path}: server sent more than the expected {rf.size} bytes")
        except (httpx2.TransportError, httpx2.StreamError) as e:
            failures = 0 if got_this_attempt else failures + 1
            if failures > max_retries:
                raise HubError(
                    f"download of {rf.path} kept failing ({type(e).__name__}: {e}); run the same pull again to resume"
                ) from None
            sleep(retry_delay(None, failures))
            continue
        if have + got_this_attempt < rf.size:  # connection closed early: resume from what we have
            failures = 0 if got_this_attempt else failures + 1
            if failures > max_retries:
                raise HubError(
                    f"download of {rf.path} stopped at {have + got_this_attempt} of {rf.size} bytes "
                    "repeatedly; run the same pull again to resume"
                )
            if failures:
                sleep(retry_delay(None, failures))  # no new bytes: back off before asking again
            continue
        return received, hasher


def _reset(hasher, rf: RemoteFile):
    return new_hasher(rf)


def _content_range_start(value: str | None) -> int | None:
    """Parse ``bytes START-END/TOTAL`` → START (None when absent or malformed)."""
    if not value or not value.startswith("bytes "):
        return None
    try:
        return int(value[6:].split("-", 1)[0])
    except ValueError:
        return None
