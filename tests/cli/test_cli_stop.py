"""How localdiff stops (issue 40 item 9): ``serve`` stopped by Ctrl-C or SIGTERM drains and exits 0 with one calm log
line, as the README says; ``gen``'s Ctrl-C is the same line ``interrupted`` (exit 130) at load as during the
generation; and the README's ``| head -c 10`` → 141 says when it holds."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from localdiff.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALDIFF_", "HF_"))}
    (tmp_path / "config.toml").touch()  # a LOCALDIFF_CONFIG file must exist
    env.update(
        LOCALDIFF_CONFIG=str(tmp_path / "config.toml"),
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


def _sigint_default() -> None:
    """SIGINT back to its default in the child (a background shell starts jobs with it ignored: test_cli.py)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, alive=lambda: True, limit: float = 120.0) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and alive():
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def test_serve_stopped_by_sigterm_drains_and_exits_0(tmp_path):
    """A process of its own: before, SIGTERM killed it once drained (exit 143)."""
    sig = signal.SIGTERM
    own = tmp_path / "mine"
    shutil.copytree(ROOT / "models" / "tiny-mdm", own)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "localdiff", "serve", "-m", "tiny", "-m", str(own), "--port", str(port)],
        env=_env(tmp_path),
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_sigint_default,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, lambda: proc.poll() is None)
        assert proc.poll() is None, proc.communicate()[1].decode()
        listed = [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
        assert listed[:2] == ["tiny", str(own)]  # -m twice: both offered, the first loaded
        assert (
            httpx.post(
                url + "/v1/completions", json={"model": str(ROOT / "models" / "tiny-mdm"), "prompt": "1"}, timeout=30
            ).status_code
            == 404
        )  # a folder not on the command line
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = err.decode()
    assert proc.returncode == 0, text
    assert text.rstrip().splitlines()[-1] == "INFO:     stopped by SIGTERM after draining; exit 0", text
    assert "error" not in text.lower() and "Traceback" not in text


def test_serve_stopped_by_ctrl_c_drains_and_exits_0(tmp_path, monkeypatch, capsys, caplog):
    """In this process (``main`` as the command line runs it): before, Ctrl-C ended ``error: interrupted``, 130."""
    (tmp_path / "config.toml").touch()  # a LOCALDIFF_CONFIG file must exist
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "config.toml"))
    port = _free_port()

    def ctrl_c():
        _wait_healthy(f"http://127.0.0.1:{port}")
        os.kill(os.getpid(), signal.SIGINT)  # (also when it never got healthy: the test must not hang)

    poke = threading.Thread(target=ctrl_c, daemon=True)
    poke.start()
    with caplog.at_level(logging.INFO, logger="localdiff.serve"):
        rc = main(["serve", "-m", "tiny", "--port", str(port)])
    poke.join(10)
    assert rc == 0, capsys.readouterr().err
    assert "stopped by Ctrl-C (SIGINT) after draining; exit 0" in [r.getMessage() for r in caplog.records]
    assert "interrupted" not in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own handler is back


def test_gen_ctrl_c_is_the_same_line_at_load_and_while_generating(monkeypatch, capsys, tmp_path, tiny):
    import localdiff.cli.gen as gen_mod

    (tmp_path / "config.toml").touch()  # a LOCALDIFF_CONFIG file must exist
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "config.toml"))

    def interrupted_load(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(gen_mod, "_load", interrupted_load)
    assert main(["gen", "-p", "What is 1 + 2?"]) == 130
    at_load = capsys.readouterr().err

    def interrupted_stream(*a, **kw):
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(gen_mod, "_load", lambda *a, **kw: tiny)
    monkeypatch.setattr(tiny, "stream", interrupted_stream)
    assert main(["gen", "-p", "What is 1 + 2?"]) == 130
    generating = capsys.readouterr().err
    assert at_load == generating == "interrupted\n"


def test_gen_exit_141_only_when_text_comes_after_the_reader_left(tmp_path):
    args = [sys.executable, "-m", "localdiff", "gen", "-p", "What is 12 + 30?", "-n", "16", "--seed", "0"]
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write: SIGPIPE's 141
    try:
        gone = subprocess.run(
            args, env=_env(tmp_path), cwd=ROOT, stdin=subprocess.DEVNULL, stdout=w, stderr=subprocess.PIPE, timeout=180
        )
    finally:
        os.close(w)
    assert gone.returncode == 141 and gone.stderr == b""
    r, w = os.pipe()  # `| head -c 10` that reads after the answer is written:
    try:  # 14 bytes, longer than head reads, and still exit 0
        done = subprocess.run(
            args, env=_env(tmp_path), cwd=ROOT, stdin=subprocess.DEVNULL, stdout=w, stderr=subprocess.PIPE, timeout=180
        )
        os.close(w)
        w = None
        head = os.read(r, 10)
    finally:
        os.close(r)
        if w is not None:
            os.close(w)
    assert done.returncode == 0 and head == b"12 + 30 = " and done.stderr == b""
    # the README says both (it said 141 for `| head -c 10` whatever the answer's length)
    said = " ".join(README[README.find("130 on Ctrl-C") : README.find("130 on Ctrl-C") + 500].split())
    assert re.search(r"head -c 10` when text still comes after head has read its 10 bytes and quit", said)
    assert "an answer written before that, however long, ends 0" in said


def test_readme_says_serve_stops_with_exit_0_on_ctrl_c_and_sigterm():
    text = " ".join(README.split())
    assert "exit 143" not in text
    assert "`stopped by Ctrl-C (SIGINT) after draining; exit 0` (SIGTERM: the same shutdown and exit 0)" in text
