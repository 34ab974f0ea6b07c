"""``localdiff pull``: revision info from the Hub, pre-flight checks, resumable downloads into the HF cache.

Steps: (1) ``HfApi.model_info(files_metadata=True)`` gives the commit and every file's size / blob id / LFS sha256;
(2) the files matching the catalog's patterns are checked against the cache (present, truncated, partial);
(3) total size, free disk and a memory-fit estimate are reported before any large transfer; (4) missing files are
fetched smallest first with :func:`localdiff.hub.download.fetch_blob` (HTTP Range resume, hash verification) and linked
into ``snapshots/<commit>/`` exactly as ``hf_hub_download`` does; ``refs/<revision>`` and hf's tree listing are
written up front so an interrupted pull is visible to ``hf`` as partial, never as complete.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from localdiff.hub import download as dl
from localdiff.hub.download import RETRY_STATUSES, RemoteFile, fetch_blob, retry_delay, verify_file
from localdiff.errors import HubError, UsageError
from localdiff.hub.guard import changed_since_verified, pull_lock, record_verified
from localdiff.hub.hf_cache import (
    check_cache_folders,
    filter_files,
    read_ref,
    read_tree,
    snapshot_status,
    storage_folder,
    write_ref,
    write_tree,
)
from localdiff.hub.fit import catalog_config, check_fit, gpu_mem_bytes, memory_estimate  # noqa: F401 — re-exported
from localdiff.hub.progress import QuietProgress, human_bytes, make_progress

DISK_MARGIN = 64 * 1024 * 1024  # bytes kept free beyond the download (said in the message; --no-space-check skips)
INFO_RETRIES = 5  # retries of the revision-info request on 429 / 5xx


def endpoint() -> str:
    """The Hub endpoint: ``HF_ENDPOINT`` at call time, else huggingface_hub's default."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set (read at call time, as well as huggingface_hub's own flag)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE") or constants.HF_HUB_OFFLINE


def translate(e: BaseException, t: Target, what: str = "") -> HubError:
    """Turn a huggingface_hub / httpx2 exception into a one-line HubError with the fix."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    ep = endpoint()
    if isinstance(e, GatedRepoError):
        return HubError(
            f"{t.repo} is gated: accept its licence at {ep}/{t.repo} and log in with `hf auth login` "
            "(or set HF_TOKEN to a token of the account that accepted it)"
        )
    if isinstance(e, RevisionNotFoundError):
        return HubError(f"revision '{t.revision}' not found in {t.repo}")
    if isinstance(e, RemoteEntryNotFoundError):
        return HubError(f"{what or 'file'} not found in {t.repo}@{t.revision}")
    if isinstance(e, RepositoryNotFoundError):
        return HubError(
            f"{t.repo} not found on the Hub ({ep}); if it is private, log in with `hf auth login` or set HF_TOKEN"
        )
    if isinstance(e, OfflineModeIsEnabled):
        return HubError(f"offline mode (HF_HUB_OFFLINE=1): cannot download {t.name}; unset HF_HUB_OFFLINE to pull")
    if isinstance(e, (httpx2.TransportError,)):
        return HubError(
            f"cannot reach the Hub at {ep} ({type(e).__name__}); check the network or HTTPS_PROXY — "
            "pulled models keep working offline"
        )
    if isinstance(e, HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", "?")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return HubError(f"the Hub answered {status} for {t.repo}: {first}")
    return HubError(f"{type(e).__name__}: {e}")


def remote_files(t: Target) -> tuple[str, list[RemoteFile]]:
    """Ask the Hub for the commit of ``t.revision`` and the metadata of every file.

    Returns:
        (commit sha, list of RemoteFile for the whole repo).
    Raises:
        HubError: offline, unreachable, gated, not found, or a reply without sizes.
    """
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if offline():
        raise HubError(f"offline mode (HF_HUB_OFFLINE=1): cannot download {t.name}; unset HF_HUB_OFFLINE to pull")
    for attempt in range(1, INFO_RETRIES + 2):
        try:
            info = HfApi(endpoint=endpoint()).model_info(t.repo, revision=t.revision, files_metadata=True)
            break
        except (HfHubHTTPError, httpx2.TransportError, OfflineModeIsEnabled) as e:
            resp = getattr(e, "response", None)
            status = getattr(resp, "status_code", None)
            if status not in RETRY_STATUSES:
                raise translate(e, t) from None
            if attempt > INFO_RETRIES:
                raise HubError(
                    f"the Hub kept answering {status} for {t.repo} ({attempt} tries): a problem on its "
                    "side; run the same pull again later"
                ) from None
            dl.sleep(retry_delay(resp.headers.get("Retry-After") if resp is not None else None, attempt))
    if not info.sha or info.siblings is None:
        raise HubError(f"the Hub's reply for {t.repo}@{t.revision} has no commit or file list")
    files = []
    for s in info.siblings:
        if s.size is None:
            raise HubError(f"the Hub's reply for {t.repo} lacks file sizes ({s.rfilename})")
        files.append(
            RemoteFile(
                path=s.rfilename,
                size=int(s.size),
                blob_id=s.blob_id,
                sha256=s.lfs.sha256 if s.lfs is not None else None,
            )
        )
    return info.sha, files


def _link(blob: Path, pointer: Path) -> None:
    pointer.parent.mkdir(parents=True, exist_ok=True)
    try:
        from huggingface_hub.file_download import _create_symlink  # hf's own (handles no-symlink systems)

        _create_symlink(str(blob), str(pointer), new_blob=False)
    except ImportError:  # pragma: no cover
        if pointer.is_symlink() or pointer.exists():
            pointer.unlink()
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)


def pull(
    t: "Target", quiet: bool = False, progress=None, verify: bool = False, check_space: bool = True, force: bool = False
) -> dict:
    """Download (or finish downloading) a model into the HF cache.

    Args:
        t: the parsed name (``localdiff.hub.models.parse_name``) of a catalog alias or ``org/name[@revision]``.
        quiet: no progress output.
        progress: a reporter from ``localdiff.hub.progress`` (default: rich on a tty, plain lines otherwise).
        verify: re-hash files already in the cache (otherwise their sizes are checked, and files changed since they
            were verified — ``localdiff.hub.guard`` — are re-hashed).
        check_space: refuse when free disk < what is left to download + ``DISK_MARGIN``.
        force: pull even when the model fits this machine in no precision (the fit check: from the catalog's
            config before any network access, else from config.json before the weights).
    Returns:
        dict: name, repo, revision, commit, path, files, total_bytes, downloaded_bytes, reused_bytes, up_to_date,
        seconds, warnings (list of str).
    Raises:
        UsageError: a folder or embedded model (nothing to pull).
        HubError: the model fits this machine in no precision (without ``force``; raised before any request),
            offline, unreachable, gated, not found, no loadable files, not enough disk, failed verification,
            HF_HOME / the hub cache not a folder.

    A second pull of the same repo waits for the first (the repo's pull lock; a note says so) and then looks at the
    cache afresh, so it counts what the first one left.
    """
    name = t.name
    if t.kind == "embedded":
        return {
            "name": name,
            "path": str(t.path),
            "embedded": True,
            "up_to_date": True,
            "files": 0,
            "total_bytes": 0,
            "downloaded_bytes": 0,
            "reused_bytes": 0,
            "warnings": [],
        }
    if t.kind == "path":
        raise UsageError(f"{name} is a local folder; there is nothing to pull")
    check_cache_folders()
    progress = progress or (QuietProgress() if quiet else make_progress())
    t0 = time.monotonic()
    storage = storage_folder(t.repo)
    if offline():
        commit = read_ref(storage, t.revision)
        if commit and snapshot_status(storage, commit, t.allow_patterns, t.ignore_patterns).complete:
            files = filter_files(read_tree(storage, commit) or [], t.allow_patterns, t.ignore_patterns)
            return _result(
                t, commit, storage, files, 0, sum(f.size for f in files), True, t0, ["offline: not checked for updates"]
            )
    cfg = catalog_config(t)
    if cfg is not None:  # the fit check from the catalog, before any network access (offline too)
        check_fit(t, cfg, t.entry.approx_size_bytes, force, progress)
    commit, all_files = remote_files(t)
    with pull_lock(storage, lambda: progress.note(f"waiting for another pull of {t.name} to finish…")):
        return _pull_locked(t, progress, verify, check_space, t0, storage, commit, all_files, force or cfg is not None)


def _pull_locked(
    t,
    progress,
    verify: bool,
    check_space: bool,
    t0: float,
    storage: Path,
    commit: str,
    all_files: list,
    checked: bool = False,
) -> dict:
    files = sorted(filter_files(all_files, t.allow_patterns, t.ignore_patterns), key=lambda r: (r.size, r.path))
    if getattr(t, "quant", None):
        from localdiff.hub.gguf_names import pick

        files = pick(all_files, t.quant, t.label)  # one GGUF file: the quantization the name asks for
    elif not any(f.path.endswith(".safetensors") for f in files) or not any(f.path == "config.json" for f in files):
        has_bin = any(f.path.endswith((".bin", ".pt", ".pth")) for f in all_files)
        why = "only pickled .bin weights, which localdiff does not load" if has_bin else "no config.json + safetensors"
        raise HubError(f"{t.repo}@{t.revision} has {why}")
    write_ref(storage, t.revision, commit)
    write_tree(storage, commit, all_files)
    snap, blobs = storage / "snapshots" / commit, storage / "blobs"
    todo, reused, partial, warnings = [], 0, 0, []
    for rf in files:
        blob = blobs / rf.blob_name
        size = blob.stat().st_size if blob.is_file() else None
        recheck = verify or (size == rf.size and changed_since_verified(storage, blob))
        if size == rf.size and (not recheck or verify_file(blob, rf) is None):
            if recheck:
                record_verified(storage, blob)
            reused += rf.size
            if not (snap / rf.path).exists():
                _link(blob, snap / rf.path)
            continue
        if size is not None:
            what = (
                "empty"
                if size == 0
                else (f"truncated ({size} of {rf.size} bytes)" if size != rf.size else "corrupt (checksum mismatch)")
            )
            warnings.append(f"{rf.path} in the cache is {what}; fetching it again")
            progress.note(warnings[-1])
            blob.unlink()
        inc = blob.with_name(blob.name + ".incomplete")
        partial += min(inc.stat().st_size, rf.size) if inc.is_file() else 0
        todo.append(rf)
    total = sum(f.size for f in files)
    if not todo:
        return _result(t, commit, storage, files, 0, reused, True, t0, warnings)
    need = sum(f.size for f in todo) - partial
    free = shutil.disk_usage(_existing_parent(blobs)).free
    if check_space and need + DISK_MARGIN > free:
        raise HubError(
            f"not enough disk space for {t.label}: {human_bytes(need)} still to download + a "
            f"{human_bytes(DISK_MARGIN)} margin kept free, {human_bytes(free)} free in {storage.parent} "
            "(free space, point HF_HOME/HF_HUB_CACHE at a bigger disk, or pass --no-space-check)"
        )
    progress.note(
        f"pulling {t.name} ({t.repo}@{commit[:12]}): {len(files)} files, {human_bytes(total)}"
        + (f", {human_bytes(need)} to download" if need != total else "")
    )
    weights = sum(f.size for f in files if f.path.endswith(".safetensors"))
    todo.sort(key=lambda r: (r.path != "config.json", r.size, r.path))  # config first: the memory estimate
    url_base = f"{endpoint()}/{t.repo}/resolve/{commit}/"
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers()
    locks = storage.parent / ".locks" / storage.name

    def warn_memory() -> None:
        """Without a catalog config (and without --force): the fit check from the repo's config.json, which is
        fetched first, before the weights."""
        if not checked and not getattr(t, "quant", None):
            check_fit(
                t,
                _load_json(snap / "config.json"),
                weights,
                False,
                progress,
                "only config.json was downloaded, not the weights",
            )

    if (snap / "config.json").exists():
        warn_memory()
    progress.start(need + partial, partial)
    downloaded = 0
    try:
        for rf in todo:
            downloaded += _fetch(t, rf, url_base, blobs, locks, headers, progress)
            record_verified(storage, blobs / rf.blob_name)  # fetch_blob checked size and hash
            _link(blobs / rf.blob_name, snap / rf.path)
            if rf.path == "config.json":
                warn_memory()
    finally:
        progress.close()
    return _result(t, commit, storage, files, downloaded, reused, False, t0, warnings)


def _fetch(t: Target, rf: RemoteFile, url_base: str, blobs: Path, locks: Path, headers: dict, progress) -> int:
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError
    from urllib.parse import quote

    url = url_base + quote(rf.path)
    try:
        return fetch_blob(url, blobs / rf.blob_name, rf, headers, progress, lock_path=locks / f"{rf.blob_name}.lock")
    except (HfHubHTTPError, httpx2.TransportError) as e:
        raise translate(e, t, rf.path) from None


def _load_json(path: Path) -> dict:
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _existing_parent(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _result(
    t: Target,
    commit: str,
    storage: Path,
    files,
    downloaded: int,
    reused: int,
    up_to_date: bool,
    t0: float,
    warnings: list,
) -> dict:
    return {
        "name": t.name,
        "repo": t.repo,
        "revision": t.revision,
        "commit": commit,
        "path": str(storage / "snapshots" / commit),
        "files": len(files),
        "total_bytes": sum(f.size for f in files),
        "downloaded_bytes": downloaded,
        "reused_bytes": reused,
        "up_to_date": up_to_date,
        "seconds": round(time.monotonic() - t0, 3),
        "warnings": list(warnings),
        "embedded": False,
    }


def fetch_config(t: Target) -> Path:
    """Download only ``config.json`` of a repo into the HF cache (for ``show`` before a pull); returns its path."""
    import httpx2
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    if offline():
        raise HubError(f"offline mode (HF_HUB_OFFLINE=1) and {t.label} is not pulled: no config.json to show")
    try:
        # one request without retries first, as pull's: hf_hub_download retries an unreachable Hub 5 times with
        # backoff (23 s and 12 lines of retry messages on stderr before the one-line error)
        HfApi(endpoint=endpoint()).model_info(t.repo, revision=t.revision)
        return Path(hf_hub_download(t.repo, "config.json", revision=t.revision, endpoint=endpoint()))
    except (HfHubHTTPError, httpx2.TransportError, OfflineModeIsEnabled) as e:
        raise translate(e, t, "config.json") from None
    except LocalEntryNotFoundError as e:
        raise HubError(f"cannot reach the Hub at {endpoint()} for {t.label}: {str(e).splitlines()[0]}") from None
