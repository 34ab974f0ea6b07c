"""Issue #40 items 2, 3, 6, 10, 11, 12: thread counts bounded wherever read, the config file bounded and regular, a
named config file that is missing, negative flag values, the chat's failed switch / plurals / no Python ``None``,
and the thread count picked by model size."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from cli_fixtures import clear_user_settings
from localdiff.cli import main
from localdiff.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
N = os.cpu_count() or 1
RULE = f"must be an integer in 1..{4 * N} (1 to 4 × the {N} CPU{'s' if N != 1 else ''} here)"


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No user LOCALDIFF_* settings; an empty config file named by LOCALDIFF_CONFIG; torch's threads restored."""
    import torch

    clear_user_settings(tmp_path, monkeypatch, "c.toml")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = torch.get_num_threads()
    yield tmp_path
    torch.set_num_threads(before)


def _sub_env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALDIFF_", "HF_"))}
    (tmp_path / "c.toml").touch()
    env.update(
        LOCALDIFF_CONFIG=str(tmp_path / "c.toml"),
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.update(extra)
    return env


def _one_error(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------------------------------- item 2
@pytest.mark.parametrize(
    "argv, env, shown",
    [
        (["gen", "--threads", "100000", "-p", "x"], {}, "--threads"),
        (["gen", "--threads", "0", "-p", "x"], {}, "--threads"),
        (["gen", "-p", "x"], {"LOCALDIFF_THREADS": "100000"}, "LOCALDIFF_THREADS"),
        (["list"], {"LOCALDIFF_THREADS": "30000"}, "LOCALDIFF_THREADS"),
        (["chat", "--threads", "100000"], {}, "--threads"),
        (["serve", "--threads", "100000"], {}, "--threads"),
        (["bench", "--threads", "100000"], {}, "--threads"),
        (["gen", "--threads", "-inf", "-p", "x"], {}, "--threads"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else str(v),
)
def test_huge_thread_counts_are_refused_with_the_rule_before_torch_sees_them(
    argv, env, shown, isolated, monkeypatch, capsys
):
    import torch

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert main(argv) == 2
    line = _one_error(capsys)
    assert line.startswith(f"error: {shown}: {RULE} (got "), line
    assert calls == []


def test_threads_in_the_config_file_and_the_library_are_bounded_too(isolated, monkeypatch, capsys):
    import torch

    import localdiff

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    (isolated / "c.toml").write_text("threads = 100000\n")
    assert main(["gen", "-p", "x"]) == 2
    assert _one_error(capsys) == f"error: {isolated / 'c.toml'}: 'threads': {RULE} (got 100000)"
    with pytest.raises(UsageError, match=r"threads: must be an integer in 1\.\."):
        localdiff.load("tiny", threads=100000)
    assert calls == []


def test_gen_threads_100000_is_a_usage_error_not_a_crash(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "localdiff", "gen", "--threads", "100000", "-p", "x"],
        env=_sub_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 2 and r.stderr.strip() == f"error: --threads: {RULE} (got '100000')", r.stderr


# ---------------------------------------------------------------------------------------------------- item 3
def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))  # /dev/zero read to the end fails, not the VM


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo"])
def test_a_config_file_that_is_not_regular_fails_fast_with_one_line(kind, tmp_path):
    path = kind
    if kind == "fifo":
        path = str(tmp_path / "fifo.toml")
        os.mkfifo(path)  # nobody writes: an open that blocks would hang until the timeout
    r = subprocess.run(
        [sys.executable, "-m", "localdiff", "list"],
        env=_sub_env(tmp_path, LOCALDIFF_CONFIG=path),
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_limit_memory,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        f"error: config file {path} is not a regular file (a device or a pipe); it must be a TOML file"
    )


def test_a_config_file_over_the_limit_is_refused_unread(isolated, capsys):
    from localdiff.config import MAX_CONFIG_BYTES

    assert 2**20 <= MAX_CONFIG_BYTES <= 16 * 2**20  # "a few MiB"
    (isolated / "c.toml").write_text("# " + "x" * MAX_CONFIG_BYTES + "\n")  # valid TOML, one comment
    assert main(["list"]) == 2
    assert _one_error(capsys) == (
        f"error: config file {isolated / 'c.toml'} is over {MAX_CONFIG_BYTES // 2**20} "
        "MiB; a config file holds a few settings"
    )
    (isolated / "c.toml").write_text("# " + "x" * (MAX_CONFIG_BYTES - 100) + "\n")
    assert main(["config", "show", "--json"]) == 0


# ---------------------------------------------------------------------------------------------------- item 6
@pytest.mark.parametrize(
    "argv",
    [
        ["gen", "-p", "x"],
        ["list"],
        ["chat"],
        ["show", "tiny"],
        ["config", "show"],
        ["serve", "--port", "1"],
        ["rm", "acme/x"],
        ["pull", "tiny"],
    ],
    ids=lambda v: " ".join(v),
)
def test_a_named_config_file_that_is_missing_is_an_error(argv, isolated, monkeypatch, capsys):
    monkeypatch.setenv("LOCALDIFF_CONFIG", "/nonexistent/config.toml")
    assert main(argv) == 2
    assert _one_error(capsys) == (
        "error: config file /nonexistent/config.toml (LOCALDIFF_CONFIG) does not exist; "
        "create it (an empty file is fine) or unset LOCALDIFF_CONFIG"
    )


def test_config_path_still_prints_a_missing_named_file_and_the_default_place_may_be_missing(
    isolated, monkeypatch, capsys
):
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(isolated / "not-yet.toml"))
    assert main(["config", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(isolated / "not-yet.toml")
    monkeypatch.delenv("LOCALDIFF_CONFIG")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(isolated / "xdg"))  # the default place, nothing there
    assert main(["list", "--json"]) == 0


# ---------------------------------------------------------------------------------------------------- item 10
@pytest.mark.parametrize(
    "argv, line",
    [
        (["--entropy-bound", "-inf"], "error: --entropy-bound: must be a number > 0 (got '-inf')"),
        (["--entropy-bound", "-1e3"], "error: --entropy-bound: must be a number > 0 (got '-1e3')"),
        (["--steps", "-nan"], "error: --steps: must be an integer in [1, 100000] (got '-nan')"),
        (["--threshold", "-.5"], "error: --threshold: must be a number in (0, 1] (got '-.5')"),
        (
            ["--temperature", "-1:0.5"],
            "error: --temperature: must be 0 or a number in [0.001, 100], or a pair MAX:MIN of such (got '-1:0.5')",
        ),
        (
            ["--temperature", ":"],
            "error: --temperature: must be 0 or a number in [0.001, 100], or a pair MAX:MIN of such (got ':')",
        ),
        (
            ["--temperature", "0.5:"],
            "error: --temperature: must be 0 or a number in [0.001, 100], or a pair MAX:MIN of such (got '0.5:')",
        ),
        (["--kv-budget", "-1GiB"], "error: --kv-budget: a size must be ≥ 0, got '-1GiB'"),
    ],
)
def test_negative_and_odd_flag_values_get_the_flags_own_message(argv, line, isolated, capsys):
    assert main(["gen", "-m", "tiny", "-p", "x", "-n", "2", *argv]) == 2
    assert _one_error(capsys) == line


def test_joining_negative_values_leaves_switches_and_words_alone():
    from localdiff.cli.argv import join_negative_values
    from localdiff.cli.dispatch import build_parser

    def _join_negative_values(argv):
        return join_negative_values(argv, build_parser)

    assert _join_negative_values(["gen", "--entropy-bound", "-inf", "-n", "-5", "-p", "-x"]) == [
        "gen",
        "--entropy-bound=-inf",
        "-n=-5",
        "-p",
        "-x",
    ]
    assert _join_negative_values(["gen", "-q", "-1", "--raw", "--", "--seed", "-1"]) == [
        "gen",
        "-q",
        "-1",
        "--raw",
        "--",
        "--seed",
        "-1",
    ]
    assert _join_negative_values(["bench", "--threads", "-Infinity"]) == ["bench", "--threads=-Infinity"]


def test_a_bad_pair_for_a_remote_gen_names_the_whole_value():
    from localdiff.cli.dispatch import build_parser
    from localdiff.cli.remote import _flag_options

    args = build_parser().parse_args(["gen", "--endpoint", "http://127.0.0.1:9/v1", "--temperature", "0.9:x"])
    with pytest.raises(UsageError, match=r"^--temperature: must be .*, or a pair MAX:MIN of such \(got '0.9:x'\)$"):
        _flag_options(args)
    args = build_parser().parse_args(["gen", "--endpoint", "http://127.0.0.1:9/v1", "--temperature", "0.9:0.1"])
    assert _flag_options(args) == {"t_max": 0.9, "t_min": 0.1}


# ---------------------------------------------------------------------------------------------------- item 11
def test_config_show_and_show_print_no_python_none(isolated, capsys):
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert "device: (unset)" in out and "exists: true" in out and "sampler: (none)" in out
    assert main(["show", "tiny"]) == 0
    out += capsys.readouterr().out
    for word in ("None", "True", "False", "{}"):
        assert word not in out, word


def test_stats_say_one_canvas_not_one_canvases():
    from localdiff.tui.slash import format_stats

    one = format_stats({"canvases": 1, "new_tokens": 1, "forwards": 1, "prompt_tokens": 1})
    assert "answer 1 token in 1 canvas · 1 forward ·" in one and "prompt 1 token (" in one
    two = format_stats({"canvases": 2, "new_tokens": 5, "forwards": 3, "prompt_tokens": 0})
    assert "answer 5 tokens in 2 canvases · 3 forwards ·" in two and "prompt 0 tokens (" in two


def test_a_failed_model_switch_keeps_the_old_model_and_a_clean_exit(tiny, tmp_path):
    from tuihelpers import send, wait_for

    from localdiff.errors import ModelNotFoundError
    from localdiff.tui.app import ChatApp
    from localdiff.tui.settings import ChatSettings
    from localdiff.tui.store import ChatStore

    def loader(name, **_):
        if name == "nonexistent":
            raise ModelNotFoundError("unknown model 'nonexistent'")
        return tiny

    async def go():
        app = ChatApp("tiny", store=ChatStore(tmp_path / "h.sqlite3"), loader=loader, settings=ChatSettings(seed=0))
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.model is not None)
            await pilot.press(*"/model nonexistent")
            await pilot.press("enter")
            await wait_for(
                pilot,
                lambda: any("could not load nonexistent" in str(w.render()) for w in app.transcript.query(".error")),
            )
            await pilot.pause(0.1)
            notes = " ".join(str(w.render()) for w in app.transcript.query(".note"))
            assert "exit code 1" not in notes and "still on tiny" in notes
            assert app.status.line().startswith("ready │ tiny"), app.status.line()
            await send(pilot, app, "What is 1 + 2?")  # the old model still answers
            await pilot.press("ctrl+q")
        assert app.return_code == 0

    asyncio.run(go())


# ---------------------------------------------------------------------------------------------------- item 12
def test_auto_threads_picks_one_thread_for_a_small_model_only_when_none_was_set(isolated, monkeypatch):
    import torch

    import localdiff
    from localdiff import capability

    torch.set_num_threads(2)
    m = localdiff.load("tiny-mdm", device="cpu", threads="auto")
    assert torch.get_num_threads() == 1 and "under 10M parameters" in m.threads_why
    monkeypatch.setattr(capability, "SMALL_MODEL_PARAMS", 1)  # as if tiny were large: torch's default back
    m = localdiff.load("tiny-mdm", device="cpu", threads="auto")
    assert torch.get_num_threads() == capability._INITIAL_THREADS[0] and m.threads_why == "all cores"
    m = localdiff.load("tiny-mdm", device="cpu", threads=2)  # a count the user set wins
    assert torch.get_num_threads() == 2 and m.threads_why is None


def test_gen_without_a_thread_setting_runs_a_small_model_on_one_thread(isolated, capsys):
    import torch

    torch.set_num_threads(2)
    assert main(["gen", "-m", "tiny-mdm", "-p", "x", "-n", "2", "-v"]) == 0
    err = capsys.readouterr().err
    assert ", 1 thread (model under 10M parameters; --threads N to change)" in err, err
    assert main(["gen", "-m", "tiny-mdm", "-p", "x", "-n", "2", "-v", "--threads", "2"]) == 0
    line = next(s for s in capsys.readouterr().err.splitlines() if s.startswith("backend: "))
    assert line.endswith(", 2 threads"), line


def test_a_folder_named_gguf_is_not_the_gguf_extra(tmp_path, monkeypatch, capsys):
    """`python -m localdiff convert` from a folder holding a ``gguf/`` folder: Python imports that folder as a
    namespace package; convert must say the extra is missing, not fail inside it (was ``internal error:
    AttributeError: module 'gguf' has no attribute 'GGUFWriter'``)."""
    import types

    fake = types.ModuleType("gguf")
    fake.__path__ = [str(tmp_path / "gguf")]  # what a namespace package looks like: a path, no __file__
    monkeypatch.setitem(sys.modules, "gguf", fake)
    assert main(["convert", "tiny-bd", "-o", str(tmp_path / "x.gguf")]) == 1
    err = capsys.readouterr().err
    assert "convert needs the gguf extra" in err and "internal error" not in err
    assert not (tmp_path / "x.gguf").exists()
