"""``localdiff pull / list / rm`` against a local Hub stand-in, driven through the real huggingface_hub 2.4.0.

Most tests run in-process (huggingface_hub's cache constant patched to tmp_path); the kill -9, CLI and offline tests
run ``python -m localdiff`` in subprocesses with a fresh environment.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hub_fixtures import REPO, WEIGHTS, blob_of, cache, stand_in  # noqa: F401  (fixtures)
from hub_stand_in import StandInHub, tiny_checkpoint_files

from localdiff.hub import models as hub
from localdiff.errors import HubError, ModelNotFoundError, UsageError

ROOT = Path(__file__).resolve().parents[2]


def subprocess_env(tmp_path: Path, stand_in: StandInHub, **extra) -> dict:
    (tmp_path / "none.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LOCALDIFF_"))}
    env.update(
        HF_HOME=str(tmp_path / "hf"),
        HF_ENDPOINT=stand_in.url,
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        LOCALDIFF_CONFIG=str(tmp_path / "none.toml"),
        NO_COLOR="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.update(extra)
    return env


def run_cli(args, env, timeout=120, **kw):
    return subprocess.run(
        [sys.executable, "-m", "localdiff", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        **kw,
    )


def test_pull_writes_hf_layout_and_hf_reuses_it(cache, stand_in):
    files = tiny_checkpoint_files()
    res = hub.pull(REPO, quiet=True)
    assert not res["up_to_date"] and res["files"] == 4  # config, generation_config, tokenizer, weights
    snap = Path(res["path"])
    assert snap == cache / "models--acme--tiny-diff" / "snapshots" / res["commit"]
    for name in ("config.json", "generation_config.json", "tokenizer.json", WEIGHTS):
        assert (snap / name).is_symlink() and (snap / name).read_bytes() == files[name]
    assert not (snap / "pytorch_model.bin").exists() and not (snap / "README.md").exists()
    assert stand_in.stats.gets(REPO, "pytorch_model.bin") == []
    assert blob_of(cache, REPO, files[WEIGHTS], lfs=True).is_file()  # blob named by the LFS sha256, as hf does
    assert blob_of(cache, REPO, files["config.json"], lfs=False).is_file()  # git sha1 for small files
    assert (cache / "models--acme--tiny-diff" / "refs" / "main").read_text() == res["commit"]
    assert hub.resolve_model(REPO) == snap
    assert [m["name"] for m in hub.list_models() if not m["embedded"]] == [REPO]

    # huggingface_hub sees a complete snapshot: no file is fetched again.
    from huggingface_hub import scan_cache_dir, snapshot_download

    n_gets = len([r for r in stand_in.stats.requests if r[0] == "GET"])
    path = snapshot_download(
        REPO, allow_patterns=["*.json", "*.safetensors"], cache_dir=str(cache), endpoint=stand_in.url
    )
    assert Path(path) == snap
    assert len([r for r in stand_in.stats.requests if r[0] == "GET"]) == n_gets
    report = scan_cache_dir(cache)
    assert report.warnings == [] and [r.repo_id for r in report.repos] == [REPO]


def test_pull_reuses_files_from_hf_download(cache, stand_in):
    from huggingface_hub import snapshot_download

    snapshot_download(REPO, allow_patterns=["*.json", "*.safetensors"], cache_dir=str(cache), endpoint=stand_in.url)
    served = stand_in.stats.served(REPO, WEIGHTS)
    res = hub.pull(REPO, quiet=True)
    assert res["up_to_date"] and res["downloaded_bytes"] == 0
    assert stand_in.stats.served(REPO, WEIGHTS) == served


def test_repull_is_up_to_date(cache, stand_in):
    first = hub.pull(REPO, quiet=True)
    second = hub.pull(REPO, quiet=True)
    assert second["up_to_date"] and second["downloaded_bytes"] == 0 and second["commit"] == first["commit"]
    assert len(stand_in.stats.gets(REPO, WEIGHTS)) == 1


def test_cut_connection_resumes_with_range_in_same_run(cache, stand_in):
    size = len(tiny_checkpoint_files()[WEIGHTS])
    stand_in.cut_after[(REPO, WEIGHTS)] = 70_000
    hub.pull(REPO, quiet=True)
    assert stand_in.stats.gets(REPO, WEIGHTS) == [None, "bytes=70000-"]
    assert stand_in.stats.served(REPO, WEIGHTS) == size  # not a byte fetched twice


def test_truncated_and_empty_cached_files_are_fetched_again(cache, stand_in):
    files = tiny_checkpoint_files()
    hub.pull(REPO, quiet=True)
    weights = blob_of(cache, REPO, files[WEIGHTS], lfs=True)
    config = blob_of(cache, REPO, files["config.json"], lfs=False)
    with open(weights, "r+b") as f:
        f.truncate(1000)
    config.write_bytes(b"")
    assert REPO not in [m["name"] for m in hub.list_models()]
    with pytest.raises(ModelNotFoundError, match="partly pulled"):
        hub.resolve_model(REPO)
    res = hub.pull(REPO, quiet=True)
    assert not res["up_to_date"]
    assert any("truncated (1000 of" in w for w in res["warnings"]) and any("empty" in w for w in res["warnings"])
    assert weights.read_bytes() == files[WEIGHTS] and config.read_bytes() == files["config.json"]


def test_verify_rehashes_and_corrupt_download_is_rejected(cache, stand_in):
    files = tiny_checkpoint_files()
    hub.pull(REPO, quiet=True)
    weights = blob_of(cache, REPO, files[WEIGHTS], lfs=True)
    data = bytearray(weights.read_bytes())
    data[5000] ^= 1  # same size, same mtime, wrong content: only --verify can see it
    st = weights.stat()
    os.chmod(weights, 0o644)
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert hub.pull(REPO, quiet=True)["up_to_date"]
    stand_in.corrupt.add((REPO, WEIGHTS))  # now the server itself sends bad bytes
    with pytest.raises(HubError, match="failed verification twice"):
        hub.pull(REPO, quiet=True, verify=True)
    assert not weights.exists() and not list(weights.parent.glob("*.incomplete"))
    stand_in.corrupt.clear()
    assert not hub.pull(REPO, quiet=True)["up_to_date"] and weights.read_bytes() == files[WEIGHTS]


def test_gated_repo_message_and_token(cache, stand_in, monkeypatch):
    with pytest.raises(HubError) as e:
        hub.pull("acme/gated", quiet=True)
    msg = str(e.value)
    assert f"{stand_in.url}/acme/gated" in msg and "hf auth login" in msg and "HF_TOKEN" in msg and "\n" not in msg
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")  # 403: authenticated but licence not accepted
    with pytest.raises(HubError, match="is gated: accept its licence"):
        hub.pull("acme/gated", quiet=True)
    monkeypatch.setenv("HF_TOKEN", stand_in.token)
    assert hub.pull("acme/gated", quiet=True)["files"] == 4


def test_not_found_errors(cache, stand_in):
    with pytest.raises(HubError, match="acme/nope not found on the Hub"):
        hub.pull("acme/nope", quiet=True)
    with pytest.raises(HubError, match="revision 'v9' not found in acme/tiny-diff"):
        hub.pull("acme/tiny-diff@v9", quiet=True)
    with pytest.raises(HubError, match="only pickled .bin weights"):
        hub.pull("acme/pickles", quiet=True)
    with pytest.raises(ModelNotFoundError, match=r"did you mean 'diffusiongemma:26b-a4b'"):
        hub.pull("difusiongemma", quiet=True)
    with pytest.raises(ModelNotFoundError, match="not pulled: run `localdiff pull acme/tiny-diff`"):
        hub.resolve_model(REPO)
    with pytest.raises(UsageError, match="embedded"):
        hub.remove("tiny")


def test_unreachable_and_offline(cache, stand_in, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(HubError, match=r"cannot reach the Hub at http://127.0.0.1:9"):
        hub.pull(REPO, quiet=True)
    monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match=r"offline mode \(HF_HUB_OFFLINE=1\)"):
        hub.pull(REPO, quiet=True)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub.pull(REPO, quiet=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n = len(stand_in.stats.requests)
    assert hub.pull(REPO, quiet=True)["up_to_date"] and len(stand_in.stats.requests) == n


def test_disk_full_then_a_later_pull_resumes(cache, stand_in, monkeypatch):
    import shutil as _shutil

    import localdiff.hub.download as dl
    import localdiff.hub.pull as hp

    real_usage = _shutil.disk_usage
    monkeypatch.setattr(hp.shutil, "disk_usage", lambda p: real_usage(p)._replace(free=1000))
    with pytest.raises(HubError, match="not enough disk space"):
        hub.pull(REPO, quiet=True)
    monkeypatch.setattr(hp.shutil, "disk_usage", real_usage)

    class FullDisk:  # a file that accepts 50,000 bytes of the weights and then reports ENOSPC
        def __init__(self, f):
            self.f = f

        def write(self, b):
            room = 50_000 - self.f.tell()
            if len(b) > room:  # like a real disk: what fits is written, then ENOSPC
                self.f.write(b[: max(room, 0)])
                self.f.flush()
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, k):
            return getattr(self.f, k)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    real_open = open
    monkeypatch.setattr(
        dl,
        "open",
        lambda p, m="r", *a: FullDisk(real_open(p, m, *a)) if ("a" in m or "w" in m) else real_open(p, m, *a),
        raising=False,
    )
    with pytest.raises(HubError, match="disk full while downloading model.safetensors"):
        hub.pull(REPO, quiet=True)
    monkeypatch.delattr(dl, "open")
    res = hub.pull(REPO, quiet=True)
    assert not res["up_to_date"]
    assert stand_in.stats.gets(REPO, WEIGHTS)[-1] == "bytes=50000-"  # resumed from the bytes on disk
    assert hub.resolve_model(REPO) == Path(res["path"])


def test_catalog_alias_pull_list_rm(cache, stand_in):
    res = hub.pull("diffusiongemma:26b-a4b", quiet=True)
    assert res["repo"] == "google/diffusiongemma-26B-A4B-it"
    names = [m["name"] for m in hub.list_models()]
    assert "diffusiongemma:26b-a4b" in names
    assert hub.resolve_model("diffusiongemma:26b-a4b") == Path(res["path"])
    hub.remove("diffusiongemma:26b-a4b")
    assert not (cache / "models--google--diffusiongemma-26B-A4B-it").exists()
    assert "diffusiongemma:26b-a4b" not in [m["name"] for m in hub.list_models()]


def test_rm_keeps_shared_blobs_and_cache_consistent(cache, stand_in):
    from huggingface_hub import scan_cache_dir

    files = tiny_checkpoint_files()
    v2 = dict(files, **{WEIGHTS: tiny_checkpoint_files(seed=7)[WEIGHTS]})
    stand_in.add_repo(REPO, v2, revision="v2")
    main = hub.pull(REPO, quiet=True)
    other = hub.pull(f"{REPO}@v2", quiet=True)
    storage = cache / "models--acme--tiny-diff"
    # a partial file of v2's weights, as an interrupted re-pull would leave
    partial = blob_of(cache, REPO, v2[WEIGHTS], lfs=True).with_suffix(".incomplete")
    partial.write_bytes(b"x" * 10)
    res = hub.remove(f"{REPO}@v2")
    assert res["commit"] == other["commit"] and res["freed_bytes"] >= len(v2[WEIGHTS])
    assert not (storage / "snapshots" / other["commit"]).exists() and not (storage / "refs" / "v2").exists()
    assert not blob_of(cache, REPO, v2[WEIGHTS], lfs=True).exists() and not partial.exists()
    assert blob_of(cache, REPO, files["config.json"], lfs=False).exists()  # shared with main: kept
    assert hub.resolve_model(REPO) == Path(main["path"])
    report = scan_cache_dir(cache)
    assert report.warnings == []
    assert {r.commit_hash for r in next(iter(report.repos)).revisions} == {main["commit"]}
    hub.remove(REPO)
    assert not storage.exists() and scan_cache_dir(cache).repos == frozenset()
    with pytest.raises(ModelNotFoundError, match="nothing to remove"):
        hub.remove(REPO)


def test_kill_9_mid_file_then_resume_from_bytes_on_disk(tmp_path, stand_in, cache):
    size = len(tiny_checkpoint_files()[WEIGHTS])
    cut = 100_000
    release = threading.Event()
    stand_in.pause_after[(REPO, WEIGHTS)] = (cut, release)
    env = subprocess_env(tmp_path, stand_in)
    proc = subprocess.Popen(
        [sys.executable, "-m", "localdiff", "pull", REPO, "-q"],
        env=env,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    blobs = cache / "models--acme--tiny-diff" / "blobs"
    deadline = time.monotonic() + 90
    partials = []
    while time.monotonic() < deadline:
        partials = list(blobs.glob("*.incomplete")) if blobs.is_dir() else []
        if partials and partials[0].stat().st_size == cut:
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the pull never reached the pause point")
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    release.set()
    assert stand_in.stats.served(REPO, WEIGHTS) == cut
    assert REPO not in [m["name"] for m in hub.list_models()]  # partial pulls are not listed
    r = run_cli(["pull", REPO], env)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stderr and "resuming at" in r.stderr
    assert stand_in.stats.gets(REPO, WEIGHTS) == [None, f"bytes={cut}-"]
    assert stand_in.stats.served(REPO, WEIGHTS) == size  # first run's bytes + the rest, nothing twice
    blob = blob_of(cache, REPO, tiny_checkpoint_files()[WEIGHTS], lfs=True)
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
    assert [m["name"] for m in hub.list_models() if not m["embedded"]] == [REPO]


def test_cli_pull_list_rm_and_offline(tmp_path, stand_in):
    env = subprocess_env(tmp_path, stand_in)
    r = run_cli(["pull", REPO], env)
    assert r.returncode == 0 and "pulled acme/tiny-diff" in r.stderr and r.stdout == ""
    r = run_cli(["pull", REPO], env)
    assert r.returncode == 0 and "up to date" in r.stderr
    r = run_cli(["list", "--json"], env)
    listed = json.loads(r.stdout)
    assert [m["name"] for m in listed if not m["embedded"]] == [REPO]
    r = run_cli(["pull", "acme/gated"], dict(env, HF_HUB_OFFLINE="1"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "offline" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli(["rm", REPO], env)
    assert r.returncode == 0 and "removed" in r.stderr
    assert not (tmp_path / "hf" / "hub" / "models--acme--tiny-diff").exists()


def test_memory_estimate_before_download():
    """The estimate says which precision fits (bf16 → int8 → int4, the first) and whether it fits at all."""
    from localdiff.hub.pull import memory_estimate

    cfg = json.loads((ROOT / "models" / "offline" / "diffusiongemma-26b-a4b" / "config.json").read_text())
    text, fits = memory_estimate(cfg, 51_600_000_000, gpu=24 * 2**30, ram=64 * 2**30)
    assert fits and "fits this 24.00 GiB GPU in int4, everything on the GPU, not in bf16 or int8" in text
    text, fits = memory_estimate(cfg, 51_600_000_000, gpu=16 * 2**30, ram=64 * 2**30)
    assert fits and "in int4 with the experts of 3 layers" in text
    text, fits = memory_estimate(cfg, 51_600_000_000, gpu=4 * 2**30, ram=2 * 2**30)
    assert not fits and text.startswith(
        "needs about 16.97 GiB of RAM in int4, the smallest precision localdiff "
        "offers, and this machine has a 4.00 GiB GPU and 2.00 GiB of RAM (no "
        "precision fits this 4.00 GiB GPU"
    )
    text, fits = memory_estimate(cfg, 51_600_000_000, gpu=0, ram=32 * 2**30)
    assert fits and "fits 32.00 GiB of RAM in int8 on the CPU, not in bf16" in text
    # a config the planner does not understand: the byte rule
    assert memory_estimate({}, 10**9, gpu=0, ram=64 * 2**30) is None
    text, fits = memory_estimate({}, 100 * 10**9, gpu=0, ram=64 * 2**30)
    assert fits and "in int8" in text
    text, fits = memory_estimate({}, 100 * 10**9, gpu=0, ram=48 * 2**30)
    assert fits and "in int4" in text
    text, fits = memory_estimate({}, 100 * 10**9, gpu=0, ram=8 * 2**30)
    assert not fits and "in int4" in text


def test_pull_a_real_checkpoint_then_show_and_generate_from_the_cache(cache, stand_in, tmp_path_factory, capsys):
    import localdiff
    from gen_checkpoint import shared_checkpoint
    from localdiff.cli import main

    src = shared_checkpoint(tmp_path_factory)
    stand_in.add_repo("acme/real", {p.name: p.read_bytes() for p in src.iterdir() if not p.name.startswith(".")})
    assert main(["show", "acme/real", "--json"]) == 0  # before a pull: config.json alone is fetched
    before = json.loads(capsys.readouterr().out)
    assert before["path"] is None and "from the Hub" in before["source"]
    assert before["summary"]["hidden_size"] == 64 and stand_in.stats.gets("acme/real", "model.safetensors") == []
    with pytest.raises(ModelNotFoundError, match="is not pulled"):
        hub.resolve_model("acme/real")
    res = hub.pull("acme/real", quiet=True)
    assert main(["show", "acme/real", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["path"] == res["path"] and shown["summary"]["hidden_size"] == 64
    m = localdiff.load("acme/real")
    assert m.path == Path(res["path"])
    g = m.generate("What is 1 + 1?", max_new_tokens=8, seed=0, max_denoising_steps=2)
    assert len(g.token_ids) == 8 and g.text == m.tokenizer.decode(g.token_ids)


def test_ctrl_c_mid_file_keeps_the_partial_and_exits_130(cache, stand_in, monkeypatch, capsys):
    from localdiff.hub import pull as hub_pull
    from localdiff.cli import main
    from localdiff.hub.progress import QuietProgress

    class CtrlC(QuietProgress):  # the user presses Ctrl-C once 60,000 bytes of the weights are on disk
        seen = 0

        def file_start(self, name, size, initial=0):
            self.name = name

        def advance(self, n):
            if self.name == WEIGHTS:
                CtrlC.seen += n
                if CtrlC.seen >= 60_000:
                    raise KeyboardInterrupt

    real = hub_pull.make_progress
    monkeypatch.setattr(hub_pull, "make_progress", lambda: CtrlC())
    assert main(["pull", REPO]) == 130
    err = capsys.readouterr().err
    assert "run `localdiff pull acme/tiny-diff` again to resume" in err
    partial = next((cache / "models--acme--tiny-diff" / "blobs").glob("*.incomplete"))
    have = partial.stat().st_size
    assert have >= 60_000
    monkeypatch.setattr(hub_pull, "make_progress", real)
    res = hub.pull(REPO, quiet=True)
    assert stand_in.stats.gets(REPO, WEIGHTS)[-1] == f"bytes={have}-" and not res["up_to_date"]


def test_suggestions_are_near_names_only():
    """A typo offers the near catalog name(s) only; a name near nothing offers nothing (was: an unrelated alias)."""
    from localdiff.hub import catalog

    assert catalog.suggest("lada:8b") == ["llada:8b"]
    assert catalog.suggest("sdar1.7b") == ["sdar:1.7b"]
    assert catalog.suggest("bad name!") == []
    assert catalog.suggest("foo") == []


def test_pull_at_a_commit_is_listed_under_it_and_removable(cache, stand_in):
    """A pull *at* a commit (a catalog pin, or org/repo@<40 hex>) writes no ref, as huggingface_hub does; the list
    still shows its snapshot, and rm by the same name removes it."""
    commit = stand_in.repos[REPO].revisions["main"]
    res = hub.pull(f"{REPO}@{commit}", quiet=True)
    storage = cache / "models--acme--tiny-diff"
    assert res["commit"] == commit and not any(p.is_file() for p in (storage / "refs").rglob("*"))
    assert f"{REPO}@{commit}" in [m["name"] for m in hub.list_models()]
    hub.remove(f"{REPO}@{commit}")
    assert f"{REPO}@{commit}" not in [m["name"] for m in hub.list_models()] and not storage.exists()
