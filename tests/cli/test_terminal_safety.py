"""Nothing a model outputs reaches a terminal as raw control characters (issue #22 item 1).

The experiment: a checkpoint whose tokenizer decodes to OSC / SGR / BS / CR / C1 CSI / DEL / NUL (``evil_checkpoint``)
run through ``localdiff gen`` on a pseudo-terminal, through pipes with and without ``--raw-bytes`` and ``--json``,
and through the chat app, whose screen is rendered to the terminal sequence Textual would write.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import subprocess
import sys
import tty
from pathlib import Path

import pytest

from evil_checkpoint import CONTROL_BYTES, EVIL, build_evil_checkpoint
from gen_checkpoint import shared_checkpoint

from localdiff.safetext import has_controls, json_dumps, visible

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--raw", "-p", "x", "--seed", "0", "-n", "16"]


@pytest.fixture(scope="module")
def evil(tmp_path_factory):
    return build_evil_checkpoint(shared_checkpoint(tmp_path_factory), tmp_path_factory.mktemp("evil") / "ck")


def _env(tmp_path):
    (tmp_path / "c.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALDIFF_", "HF_"))}
    env.update(
        LOCALDIFF_CONFIG=str(tmp_path / "c.toml"),
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_OFFLINE="1",
        TERM="xterm-256color",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


def _raw_controls(data: bytes) -> list[bytes]:
    return [c for c in CONTROL_BYTES if c in data]


def test_visible_replaces_c0_c1_del_but_keeps_newlines_tabs_and_text():
    assert visible("a\x1b]0;t\x07b\x08c\rd\x7fe\x9bf\x00g") == "a␛]0;t␇b␈c␍d␡e<U+009B>f␀g"
    assert visible("line 1\n\tline 2 — ünïcode ✓") == "line 1\n\tline 2 — ünïcode ✓"
    text = "".join(EVIL)
    assert not has_controls(visible(text)) and has_controls(text)
    assert visible(text[:5]) + visible(text[5:]) == visible(text)  # fragments (canvases) sanitize the same
    dumped = json_dumps({"t": text})
    assert not has_controls(dumped) and json.loads(dumped)["t"] == text


def test_bidi_overrides_and_isolates_are_shown_not_run_but_rtl_text_and_marks_stay():
    """U+202E and its kin reorder what a terminal shows after them (Trojan Source): shown as <U+202E> etc."""
    text = "ok \u202eevil\u202c \u2066iso\u2069 \u202a\u202b\u202d \u2067\u2068"
    assert visible(text) == ("ok <U+202E>evil<U+202C> <U+2066>iso<U+2069> <U+202A><U+202B><U+202D> <U+2067><U+2068>")
    assert has_controls(text) and not has_controls(visible(text))
    assert (
        visible("\u05e9\u05dc\u05d5\u05dd \u200f\u200e \u0645\u0631\u062d\u0628\u0627")
        == "\u05e9\u05dc\u05d5\u05dd \u200f\u200e \u0645\u0631\u062d\u0628\u0627"
    )  # Hebrew, RLM/LRM, Arabic kept
    dumped = json_dumps({"t": text})
    assert "\u202e" not in dumped and "\\u202e" in dumped and json.loads(dumped)["t"] == text


def test_gen_on_a_pseudo_terminal_gets_no_raw_control_bytes(evil, tmp_path):
    master, slave = pty.openpty()
    tty.setraw(slave)  # no \n → \r\n translation: every byte the program writes arrives as written
    proc = subprocess.Popen(
        [sys.executable, "-m", "localdiff", "gen", "-m", str(evil), *ARGS, "--raw-bytes"],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=_env(tmp_path),
        cwd=ROOT,
    )
    os.close(slave)
    data = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        data += chunk
    os.close(master)
    assert proc.wait(120) == 0, data
    text = data.decode("utf-8")
    assert _raw_controls(data) == [], data
    assert "␛]0;PWNED␇" in text or "␛[31mRED" in text or "␈␈" in text  # the model's text is there, visibly
    assert "--raw-bytes ignored: stdout is a terminal" in text


def test_piped_stdout_is_sanitized_unless_raw_bytes_and_json_stays_escaped(evil, tmp_path):
    def run(*extra):
        r = subprocess.run(
            [sys.executable, "-m", "localdiff", "gen", "-m", str(evil), *ARGS, *extra],
            capture_output=True,
            env=_env(tmp_path),
            cwd=ROOT,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    raw = run("--raw-bytes")
    assert _raw_controls(raw)  # the control experiment: this tokenizer really emits control characters
    shown = run()
    assert _raw_controls(shown) == [] and shown.decode() == visible(raw.decode())
    js = run("--json")
    assert _raw_controls(js) == [] and has_controls(json.loads(js)["text"])  # escaped, and the value intact


def test_chat_transcript_reaches_the_terminal_without_control_characters(evil, tmp_path):
    import localdiff

    from localdiff.tui.app import ChatApp
    from localdiff.tui.settings import ChatSettings
    from localdiff.tui.store import ChatStore
    from tuihelpers import wait_for

    model = localdiff.load(str(evil), device="cpu")

    async def go():
        app = ChatApp(
            "evil",
            store=ChatStore(tmp_path / "h.sqlite3"),
            loader=lambda name, **_: model,
            settings=ChatSettings(seed=0, max_new_tokens=16),
        )
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.model is not None and not app.generating)
            await pilot.press(*"hello", "enter")
            await wait_for(pilot, lambda: app.finished_count > 0)
            await pilot.pause(0.2)
            answer = app.transcript.messages[-1]
            assert answer.role == "assistant" and has_controls(answer.text)  # the model did emit them
            # what App._display would write to a real terminal: the full screen update as terminal bytes
            update = app.screen._compositor.render_update(full=True)
            return answer.text, update.render_segments(app.console)

    answer, out = asyncio.run(go())
    assert out
    for payload in ("\x1b]0;PWNED", "\x07", "\x08", "\x9b", "\x7f", "\x00", "\rOVER", "\x1b[31mRED"):
        assert payload not in out, repr(payload)
    assert any(visible(piece)[:6] in out for piece in answer.split())  # the answer was drawn, made visible


def test_list_and_show_print_model_provided_strings_visibly(evil, tmp_path, monkeypatch, capsys):
    import shutil

    from localdiff.cli import main
    from localdiff.hub import models as hub

    ck = tmp_path / "ck"
    shutil.copytree(evil, ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["architectures"] = ["Evil\x1b]0;PWNED\x07Arch"]
    (ck / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "c.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "c.toml"))
    assert main(["show", str(ck)]) == 0
    out = capsys.readouterr().out
    assert "Evil␛]0;PWNED␇Arch" in out and not has_controls(out)
    row = {
        "name": "acme/x\x1b[2J",
        "repo": "acme/x",
        "revision": "main",
        "commit": "0" * 40,
        "size_bytes": 1,
        "quant": "\x9bq",
        "path": "/p\x08",
        "embedded": False,
        "description": "",
    }
    monkeypatch.setattr(hub, "list_models", lambda: [dict(row)])
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "acme/x␛[2J" in out and "<U+009B>q" in out and not has_controls(out)
    assert main(["list", "--json"]) == 0
    out = capsys.readouterr().out
    assert not has_controls(out) and json.loads(out)[0]["name"] == row["name"]


def test_gen_against_an_endpoint_shows_the_servers_text_visibly(evil, tmp_path, monkeypatch, capsys):
    from servehelpers import Running

    from localdiff.cli import main

    (tmp_path / "c.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "c.toml"))
    from localdiff.serve.names import ModelNames

    server = Running(model=str(evil), names=ModelNames([str(evil)]))  # a folder: offered as `serve -m` gives it
    try:
        argv = ["gen", "--endpoint", server.url, "-m", str(evil), *ARGS]
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert not has_controls(out) and any(s in out for s in ("␛", "␈", "␍", "␡", "␀"))
        rc = main([*argv, "--json"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        last = out.strip().splitlines()[-1]  # (the in-process server's access log shares stdout)
        assert not has_controls(out) and has_controls(json.loads(last)["text"]), out
    finally:
        server.stop()
