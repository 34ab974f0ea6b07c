"""Pull robustness against the Hub stand-in (issue #22 items 2, 4–8): a ``../`` revision, 5xx / 429 retries with
backoff, empty responses, same-size corruption noticed without hashing on every start, ``rm`` during a pull, the
free-space margin, offline ``pull`` of a present model and a second concurrent pull."""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path

import pytest

from hub_stand_in import tiny_checkpoint_files
from hub_fixtures import REPO, WEIGHTS, blob_of, cache, stand_in  # noqa: F401 (fixtures)

import localdiff.hub.download as dl
from localdiff.errors import CheckpointError, HubError, UsageError
from localdiff.hub import models as hub


@pytest.fixture
def sleeps(monkeypatch):
    """Record the backoff waits instead of sleeping."""
    seen: list[float] = []
    monkeypatch.setattr(dl, "sleep", seen.append)
    return seen


def _files_outside(root: Path, inside: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and inside not in p.parents and ".locks" not in p.parts]


def test_a_dotdot_revision_is_refused_and_nothing_is_written_outside_the_repo(cache, stand_in, tmp_path):
    stand_in.add_repo(REPO, tiny_checkpoint_files(), revision="../../x")  # a server that answers such a name
    with pytest.raises(UsageError, match=r"invalid revision '../../x'"):
        hub.pull(f"{REPO}@../../x", quiet=True)
    for bad in ("a/../../b", ".hidden", "v1.lock", "a//b", "main/"):
        with pytest.raises(UsageError, match="invalid revision"):
            hub.parse_name(f"{REPO}@{bad}")
    assert _files_outside(tmp_path, cache / "models--acme--tiny-diff") == []
    assert hub.parse_name(f"{REPO}@refs/pr/1").revision == "refs/pr/1"


def test_5xx_answers_are_retried_with_backoff(cache, stand_in, sleeps):
    stand_in.fail_next[(REPO, None)] = [(502, {})]
    stand_in.fail_next[(REPO, WEIGHTS)] = [(500, {}), (503, {})]
    res = hub.pull(REPO, quiet=True)
    assert not res["up_to_date"] and hub.resolve_model(REPO) == Path(res["path"])
    assert sleeps == [0.5, 0.5, 1.0]  # revision info once; the file twice, doubling


def test_429_retry_after_is_honoured(cache, stand_in, sleeps):
    stand_in.fail_next[(REPO, WEIGHTS)] = [(429, {"Retry-After": "7"})]
    stand_in.fail_next[(REPO, None)] = [(429, {"Retry-After": "3"})]
    hub.pull(REPO, quiet=True)
    assert sleeps == [3.0, 7.0]


def test_a_server_that_keeps_failing_says_that_a_later_pull_resumes(cache, stand_in, sleeps):
    stand_in.fail_next[(REPO, WEIGHTS)] = [(503, {})] * 20
    with pytest.raises(
        HubError,
        match=r"kept answering 503 for model.safetensors \(6 tries\).*run the same pull "
        r"again later",
    ):
        hub.pull(REPO, quiet=True)
    assert len(sleeps) == 5 and sleeps == sorted(sleeps)
    stand_in.fail_next[(REPO, None)] = [(500, {})] * 20
    with pytest.raises(HubError, match=r"kept answering 500 for acme/tiny-diff .*run the same pull again later"):
        hub.pull(REPO, quiet=True)


def test_empty_responses_back_off_before_retrying(cache, stand_in, sleeps):
    stand_in.short_next[(REPO, WEIGHTS)] = 3
    hub.pull(REPO, quiet=True)
    assert sleeps == [0.5, 1.0, 2.0]


def test_same_size_corruption_is_noticed_by_list_load_and_pull(cache, stand_in, capsys):
    from localdiff.cli import main

    files = tiny_checkpoint_files()
    hub.pull(REPO, quiet=True)
    weights = blob_of(cache, REPO, files[WEIGHTS], lfs=True)
    data = bytearray(weights.read_bytes())
    data[5000] ^= 1
    os.chmod(weights, 0o644)
    weights.write_bytes(bytes(data))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a different mtime even on coarse clocks
    assert hub.list_models()[-1]["changed"] == [WEIGHTS]
    assert main(["list"]) == 0
    assert (
        f"model.safetensors changed on disk since it was verified; run `localdiff pull {REPO} --verify`"
        in capsys.readouterr().err
    )
    with pytest.raises(CheckpointError, match=r"changed on disk since it was verified; run `localdiff pull "):
        hub.resolve_model(REPO)
    res = hub.pull(REPO, quiet=True)  # re-hashes only the changed file, finds it corrupt, fetches it again
    assert not res["up_to_date"] and any("corrupt (checksum mismatch)" in w for w in res["warnings"])
    assert weights.read_bytes() == files[WEIGHTS] and hub.list_models()[-1]["changed"] == []
    assert hub.resolve_model(REPO) == Path(res["path"])
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))  # touched but intact: re-verified, kept
    assert hub.pull(REPO, quiet=True)["up_to_date"] and hub.list_models()[-1]["changed"] == []


def _pull_in_thread(stand_in, pause_at=100_000):
    release = threading.Event()
    stand_in.pause_after[(REPO, WEIGHTS)] = (pause_at, release)
    result: dict = {}

    def run():
        try:
            result["res"] = hub.pull(REPO, quiet=True)
        except BaseException as e:  # noqa: BLE001 — reported by the test
            result["error"] = e

    th = threading.Thread(target=run)
    th.start()
    deadline = time.monotonic() + 60
    while stand_in.stats.served(REPO, WEIGHTS) < pause_at:
        assert time.monotonic() < deadline and th.is_alive(), result
        time.sleep(0.02)
    return th, release, result


def test_rm_refuses_while_a_pull_runs_and_the_pull_finishes(cache, stand_in):
    th, release, result = _pull_in_thread(stand_in)
    blobs = cache / "models--acme--tiny-diff" / "blobs"
    try:
        deadline = time.monotonic() + 30  # bytes served may reach the client's file a moment later (loaded CPU)
        while not list(blobs.glob("*.incomplete")):
            assert time.monotonic() < deadline, "the paused pull wrote no .incomplete file"
            time.sleep(0.02)
        with pytest.raises(HubError, match=r"a pull of acme/tiny-diff is running; wait for it"):
            hub.remove(REPO)
        assert list(blobs.glob("*.incomplete"))  # untouched
    finally:
        release.set()
        th.join(60)
    assert "error" not in result and hub.resolve_model(REPO) == Path(result["res"]["path"])
    assert hub.remove(REPO)["freed_bytes"] > 0  # no pull running: rm works


def test_a_second_pull_says_it_waits_and_counts_what_the_first_left(cache, stand_in):
    from localdiff.hub.progress import PlainProgress

    th, release, result = _pull_in_thread(stand_in)
    out = io.StringIO()
    second: dict = {}
    th2 = threading.Thread(target=lambda: second.setdefault("res", hub.pull(REPO, progress=PlainProgress(out))))
    th2.start()
    try:
        deadline = time.monotonic() + 30
        while "waiting for another pull of acme/tiny-diff" not in out.getvalue():
            assert time.monotonic() < deadline, out.getvalue()
            time.sleep(0.02)
    finally:
        release.set()
        th.join(60)
        th2.join(60)
    assert "error" not in result and second["res"]["up_to_date"] and second["res"]["downloaded_bytes"] == 0
    assert "downloading" not in out.getvalue()  # nothing re-counted: the first pull had finished it


def test_free_space_margin_is_said_and_can_be_overridden(cache, stand_in, monkeypatch):
    import shutil as _shutil

    import localdiff.hub.pull as hp

    need = sum(len(v) for k, v in tiny_checkpoint_files().items() if k not in ("pytorch_model.bin", "README.md"))
    real_usage = _shutil.disk_usage
    monkeypatch.setattr(hp.shutil, "disk_usage", lambda p: real_usage(p)._replace(free=need + 1000))
    with pytest.raises(HubError, match=r"still to download \+ a 67.1 MB margin kept free.*--no-space-check"):
        hub.pull(REPO, quiet=True)
    assert not hub.pull(REPO, quiet=True, check_space=False)["up_to_date"]


def test_offline_pull_of_a_present_model_reports_its_size_and_the_note(cache, stand_in, monkeypatch, capsys):
    from localdiff.cli import main
    from localdiff.hub.progress import human_bytes

    res = hub.pull(REPO, quiet=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["pull", REPO]) == 0
    err = capsys.readouterr().err
    assert f"is up to date (acme/tiny-diff@{res['commit'][:12]}, {human_bytes(res['total_bytes'])})" in err
    assert "offline: not checked for updates" in err and "0 B" not in err
