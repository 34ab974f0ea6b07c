"""Keyboard bytes that are not UTF-8 reach ``localdiff chat`` as "�", never a crash (newcomer check, session 8).

Before: ``\\xff`` typed at the terminal raised UnicodeDecodeError in Textual's input thread — a Rich traceback, the
chat closed with exit code 0 and the message being typed was lost. The experiment: ``localdiff chat`` on a
pseudo-terminal with the embedded model; one message, then ``\\xff`` and a second message, then ctrl+c; both turns
must be saved in the history and the terminal must show no traceback.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from localdiff.tui.decode import REPLACEMENT, install_lenient_decoder
from localdiff.tui.store import ChatStore

ROOT = Path(__file__).resolve().parents[2]


def test_the_drivers_decoder_replaces_invalid_bytes():
    """The name the Linux drivers decode through is rebound (a Textual release that drops it fails here)."""
    from textual.drivers import linux_driver, linux_inline_driver

    assert install_lenient_decoder() and install_lenient_decoder()  # idempotent
    for mod in (linux_driver, linux_inline_driver):
        decode = mod.getincrementaldecoder("utf-8")().decode
        assert decode(b"a\xffb") == f"a{REPLACEMENT}b"
        assert decode(b"\xc3") == "" and decode(b"\xa9") == "é"  # a character split across reads still joins


class Terminal:
    """``localdiff chat`` on a pseudo-terminal (80x24); ``out`` collects everything it wrote."""

    def __init__(self, tmp_path: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALDIFF_", "HF_"))}
        (tmp_path / "c.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
        env.update(
            LOCALDIFF_DATA_DIR=str(tmp_path),
            LOCALDIFF_CONFIG=str(tmp_path / "c.toml"),
            HF_HOME=str(tmp_path / "hf"),
            HF_HUB_OFFLINE="1",
            TERM="xterm-256color",
            PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "localdiff", "chat", "--seed", "1"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        os.close(slave)
        self.out = b""

    def read(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if select.select([self.master], [], [], 0.1)[0]:
                try:
                    self.out += os.read(self.master, 65536)
                except OSError:  # the child closed the terminal
                    return

    def wait_for(self, text: bytes, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        start = len(self.out)
        while text not in self.out[start:]:
            assert time.monotonic() < end and self.proc.poll() is None, self.out[-2000:]
            self.read(0.2)

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        os.close(self.master)


def test_a_non_utf8_key_keeps_the_chat_and_its_history(tmp_path):
    term = Terminal(tmp_path)
    try:
        term.wait_for(b"ready")
        term.type(b"What is 41 + 93?\r")
        term.wait_for(b"134")
        term.type(b"\xff")
        term.read(0.5)
        term.type(b"What is 27 + 58?\r")
        term.wait_for(b"85.")
        term.read(0.5)
        term.type(b"\x03")  # ctrl+c when idle quits
        rc = term.proc.wait(30)
        term.read(0.5)
    finally:
        term.close()
    assert b"Traceback" not in term.out and b"UnicodeDecodeError" not in term.out
    assert rc == 0
    [conv] = ChatStore(tmp_path / "chat.sqlite3").list_conversations()
    users = [t.content for t in ChatStore(tmp_path / "chat.sqlite3").load(conv.id).turns if t.role == "user"]
    assert users == ["What is 41 + 93?", f"{REPLACEMENT}What is 27 + 58?"]
