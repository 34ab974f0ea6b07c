"""`localdiff chat` in a real terminal (tmux at 80x24), issue #23's acceptance: a three-turn conversation with the
embedded model where every answer is non-empty and right for its task family; ctrl+c stops an answer and the next
prompt works; a bracketed paste holding escape sequences stays text; ctrl+c when idle quits with exit code 0.
Skipped when tmux is not installed."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (real-terminal test)")

ROOT = Path(__file__).resolve().parents[2]


class Tmux:
    """One detached tmux session on a private server socket."""

    def __init__(self, socket: str) -> None:
        self.base = ["tmux", "-L", socket]

    def __call__(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], check=True, capture_output=True, text=True, timeout=20).stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "chat")

    def wait(self, cond, timeout: float = 60.0) -> str:
        t0 = time.monotonic()
        while True:
            text = self.screen()
            if cond(text):
                return text
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out; the screen was:\n{text}")
            time.sleep(0.2)

    def type(self, text: str, enter: bool = True) -> None:
        self("send-keys", "-t", "chat", "-l", text)
        if enter:
            self("send-keys", "-t", "chat", "Enter")


def test_three_turns_ctrl_c_and_paste_in_tmux(tmp_path):
    script = tmp_path / "run.sh"
    (tmp_path / "c.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    env = {"PYTHONPATH": str(ROOT), "LOCALDIFF_DATA_DIR": str(tmp_path), "LOCALDIFF_CONFIG": str(tmp_path / "c.toml")}
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    script.write_text(
        f"#!/bin/sh\ncd {shlex.quote(str(ROOT))}\nexport {exports}\n"
        f"{shlex.quote(sys.executable)} -m localdiff chat --seed 1\n"
        f"echo $? > {shlex.quote(str(tmp_path / 'exit'))}\nsleep 60\n"
    )
    script.chmod(0o755)
    tmux = Tmux(f"localdiff-test-{os.getpid()}")
    tmux("new-session", "-d", "-s", "chat", "-x", "80", "-y", "24", str(script))
    try:
        tmux.wait(lambda s: "ready │ tiny" in s and "lists the commands." in s)
        for prompt, answer in [
            ("What is 41 + 93?", "41 + 93 = 134."),
            ("Reverse the letters: d r a g o n", "n o g a r d"),
            ("Sort these words: elk cat gnu", "cat elk gnu"),
        ]:
            tmux.type(prompt)
            screen = tmux.wait(lambda s, a=answer: f"█ {a}" in s and s.lstrip().startswith("ready"))
            assert "(empty answer)" not in screen
        # a long answer (steps forced up), stopped with ctrl+c; the next prompt works
        tmux.type("/set steps 3000")
        tmux.type("/set stability_threshold 100000")
        tmux.wait(lambda s: "stability_threshold = 100000" in s)
        tmux.type("What is 27 + 58?")
        tmux.wait(lambda s: s.lstrip().startswith("generating"))
        tmux("send-keys", "-t", "chat", "C-c")
        screen = tmux.wait(lambda s: "stopped —" in s and s.lstrip().startswith("ready"))
        assert "│ What is 27 + 58?" in screen  # the dropped message is back in the prompt box
        tmux("send-keys", "-t", "chat", "C-a", "C-k")
        tmux.type("/set steps default")
        tmux.type("/set stability_threshold default")
        tmux.wait(lambda s: "stability_threshold = model default" in s)
        tmux.type("What is 27 + 58?")
        tmux.wait(lambda s: "█ 27 + 58 = 85." in s and s.lstrip().startswith("ready"))
        # a bracketed paste with escape sequences and a carriage return: text in the box, nothing sent
        tmux("set-buffer", "-b", "p", "What is\x1b[2J 1 + 2?\rsecond\x1b")
        tmux("paste-buffer", "-p", "-b", "p", "-t", "chat")
        screen = tmux.wait(lambda s: "second␛" in s)
        assert "│ What is␛[2J 1 + 2?" in screen and "█ 1 + 2" not in screen
        tmux("send-keys", "-t", "chat", "C-c")  # idle: quits
        t0 = time.monotonic()
        while not (tmp_path / "exit").exists() and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        assert (tmp_path / "exit").read_text().strip() == "0"
    finally:
        subprocess.run([*tmux.base, "kill-server"], capture_output=True, timeout=20)
