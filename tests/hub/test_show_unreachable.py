"""``show org/repo`` with the Hub unreachable fails as ``pull`` does: one line at once (it took 23.5 s and printed
12 lines of huggingface_hub's retry messages first)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["show", "pull"])
def test_show_and_pull_fail_at_once_with_one_line_when_the_hub_is_unreachable(command, tmp_path):
    (tmp_path / "none.toml").touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LOCALDIFF_"))}
    env.update(
        HF_HOME=str(tmp_path / "hf"),
        HF_ENDPOINT="http://127.0.0.1:9",  # nothing listens on the discard port
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        LOCALDIFF_CONFIG=str(tmp_path / "none.toml"),
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "localdiff", command, "acme/not-pulled"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    seconds = time.monotonic() - t0
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("error: cannot reach the Hub at http://127.0.0.1:9"), r.stderr
    assert seconds < 10  # no retries with backoff (≈ 23 s before)
