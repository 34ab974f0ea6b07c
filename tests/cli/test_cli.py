"""The ``localdiff`` command line: ``gen`` as a subprocess (stdin, streams, --json, Ctrl-C) and the config / list /
show / chat commands in-process."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


from localdiff.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def endless_ckpt(tmp_path_factory, ckpt):
    """The same weights; EOS outside the vocabulary, 48 steps and a context of 64Ki positions, so a generation of
    ``ENDLESS_TOKENS`` runs until interrupted (7,500 canvases of up to 48 forwards; 1,000 tokens took 100 s here)."""
    import shutil

    dst = tmp_path_factory.mktemp("ckpt") / "endless"
    shutil.copytree(ckpt, dst)
    gen_cfg = json.loads((dst / "generation_config.json").read_text())
    config = json.loads((dst / "config.json").read_text())
    gen_cfg.update(eos_token_id=[config["text_config"]["vocab_size"]], max_denoising_steps=48)
    (dst / "generation_config.json").write_text(json.dumps(gen_cfg))
    config["text_config"]["max_position_embeddings"] = 65536
    (dst / "config.json").write_text(json.dumps(config))
    return dst


ENDLESS_TOKENS = 60000


def cli_env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALDIFF_", "HF_"))}
    (tmp_path / "config.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    env.update(
        LOCALDIFF_CONFIG=str(tmp_path / "config.toml"),
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_OFFLINE="1",
        TERM="xterm-256color",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.pop("NO_COLOR", None)
    env.update(extra)
    return env


def gen(args, env, **kw):
    kw.setdefault("capture_output", "stdout" not in kw)
    return subprocess.run([sys.executable, "-m", "localdiff", "gen", *args], env=env, timeout=180, cwd=ROOT, **kw)


def test_gen_devnull_stdin_and_no_prompt_is_a_usage_error(tmp_path):
    t0 = time.monotonic()
    r = gen([], cli_env(tmp_path), stdin=subprocess.DEVNULL, text=True)
    assert r.returncode == 2 and time.monotonic() - t0 < 60
    assert r.stdout == "" and r.stderr.count("\n") == 1 and r.stderr.startswith("error: no prompt")


def test_gen_terminal_stdin_is_never_read(tmp_path):
    master, slave = os.openpty()  # a terminal on stdin: no blocking read, a usage error instead
    try:
        r = gen([], cli_env(tmp_path), stdin=slave, text=True)
    finally:
        os.close(slave)
        os.close(master)
    assert r.returncode == 2 and "no prompt:" in r.stderr


def test_gen_piped_stdin_prepended_json_and_clean_streams(tmp_path, ckpt):
    import localdiff

    env = cli_env(tmp_path)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    args = ["-m", str(ckpt), "--raw", "-p", "What is 2 + 2?", "--seed", "3", "-n", "12", "--steps", "3"]
    with open(out, "wb") as o, open(err, "wb") as e:
        r = gen([*args, "--json"], env, input=b"Context line.\n", stdout=o, stderr=e)
    assert r.returncode == 0, err.read_text()
    raw_out, raw_err = out.read_bytes(), err.read_bytes()
    assert b"\x1b" not in raw_out and b"\x1b" not in raw_err
    res = json.loads(raw_out)
    m = localdiff.load(str(ckpt))
    expected_prompt = m.encode_prompt("Context line.\n\nWhat is 2 + 2?", chat=False)[0]
    assert res["usage"]["prompt_tokens"] == len(expected_prompt)
    assert res["seed"] == 3 and res["sampler"]["max_denoising_steps"] == 3
    assert len(res["token_ids"]) == 12 and res["usage"]["completion_tokens"] == 12
    assert m.tokenizer.decode(res["token_ids"]) == res["text"]
    assert res["model"] == str(ckpt) and res["finish_reason"] in ("eos", "length") and res["forwards"] >= 1
    # the same run without --json streams exactly that text to stdout (canvas by canvas) and nothing else
    with open(out, "wb") as o, open(err, "wb") as e:
        r = gen(args, env, input=b"Context line.\n", stdout=o, stderr=e)
    assert r.returncode == 0 and out.read_bytes().decode() == res["text"] + "\n"
    assert b"\x1b" not in err.read_bytes()


def _sigint_default() -> None:
    """In the child before exec: SIGINT back to its default action. A shell without job control starts background
    jobs (``pytest ... &``) with SIGINT ignored, children inherit that across exec, and Python then installs no
    KeyboardInterrupt handler, so the SIGINT below would do nothing (the flaky 60 s timeout of session 6)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_gen_sigint_flushes_final_canvases_and_exits_130(tmp_path, endless_ckpt):
    """Ctrl-C once the first canvas is on stdout: the final canvases are flushed, one line ``interrupted``, exit 130.
    The generation is far too long to end on its own first (``endless_ckpt``), however loaded the machine."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "localdiff",
            "gen",
            "-m",
            str(endless_ckpt),
            "-p",
            "hello",
            "-n",
            str(ENDLESS_TOKENS),
            "--seed",
            "0",
        ],
        env=cli_env(tmp_path),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_sigint_default,
    )
    try:
        fd = proc.stdout.fileno()
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        got = b""
        deadline = time.monotonic() + 120
        while not got and time.monotonic() < deadline and proc.poll() is None:
            try:
                got += os.read(fd, 65536)
            except BlockingIOError:
                time.sleep(0.05)
        assert got, "no canvas was written before the deadline"
        assert proc.poll() is None, f"the generation ended (exit {proc.returncode}) before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # a failed run must not leave an endless generation loading the machine
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130
    assert b"Traceback" not in err and err.decode().strip().splitlines()[-1] == "interrupted"
    full = got + rest
    assert full.endswith(b"\n")  # final canvases flushed, then a newline


def test_default_model_comes_from_env_and_flag_wins(tmp_path, ckpt, monkeypatch, capsys):
    env = cli_env(tmp_path, LOCALDIFF_MODEL=str(ckpt), LOCALDIFF_MAX_NEW_TOKENS="8", LOCALDIFF_SEED="5")
    r = gen(["--json", "-p", "hi"], env, text=True, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["model"] == str(ckpt) and res["seed"] == 5 and len(res["token_ids"]) == 8
    for k in ("LOCALDIFF_MODEL", "LOCALDIFF_CONFIG"):
        monkeypatch.setenv(k, env[k])
    assert main(["gen", "-m", "no-such-model", "-p", "hi"]) == 1
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_gen_runs_the_embedded_model_by_default(tmp_path):
    r = gen(
        ["-p", "What is 12 + 30?", "-n", "16", "--seed", "0"], cli_env(tmp_path), text=True, stdin=subprocess.DEVNULL
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "12 + 30 = 42."  # the embedded model knows its sums (98 % held out)


def test_config_precedence_flag_env_file_checkpoint(tmp_path, monkeypatch, ckpt):
    import localdiff
    from localdiff.config import load_user_config, sampler_overrides

    cfg_file = tmp_path / "config.toml"
    cfg_file.write_text(
        'default_model = "tiny"\n[sampler]\nmax_denoising_steps = 10\nthreshold = 0.5\nentropy_bound = 0.2\n'
    )
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(cfg_file))
    monkeypatch.setenv("LOCALDIFF_THRESHOLD", "0.7")
    cfg = load_user_config()
    assert cfg.origins["threshold"] == "env:LOCALDIFF_THRESHOLD" and cfg.origins["entropy_bound"] == "file"
    over = sampler_overrides({"max_denoising_steps": 3, "threshold": None}, cfg)
    assert over == {"max_denoising_steps": 3, "threshold": 0.7, "entropy_bound": 0.2}
    m = localdiff.load(str(ckpt))
    assert m.sampler_options(**over)["max_denoising_steps"] == 3  # flag > file > checkpoint (4)
    assert m.sampler_options(**sampler_overrides({}, cfg))["max_denoising_steps"] == 10  # file > checkpoint
    monkeypatch.delenv("LOCALDIFF_CONFIG")
    (tmp_path / "empty.toml").touch()  # (a named file that is missing is an error: test_cli_hardening)
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "empty.toml"))
    monkeypatch.delenv("LOCALDIFF_THRESHOLD")
    assert m.sampler_options(**sampler_overrides({}, load_user_config()))["max_denoising_steps"] == 4


def test_config_path_and_show(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "c.toml"))
    assert main(["config", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "c.toml")
    monkeypatch.delenv("LOCALDIFF_CONFIG")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert main(["config", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "xdg" / "localdiff" / "config.toml")


def test_list_all_and_show_before_pull(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert main(["list", "--all", "--json"]) == 0
    rows = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    dg = rows["diffusiongemma:26b-a4b"]
    assert dg["pulled"] is False and dg["repo"] == "google/diffusiongemma-26B-A4B-it"
    assert main(["show", "diffusiongemma:26b-a4b", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["path"] is None and "offline stand-in" in shown["source"]
    assert abs(shown["summary"]["parameters"]["total"] - 25.2e9) / 25.2e9 < 0.03
    assert main(["list", "--all"]) == 0  # the table: pinned commits as 12 digits, as for pulled models
    table = capsys.readouterr().out
    pinned = rows["llada2:mini"]["revision"]
    assert len(pinned) == 40 and f"@{pinned[:12]} " in table and pinned not in table


def test_show_checkpoint_folder(ckpt, capsys):
    assert main(["show", str(ckpt), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["summary"]
    assert s["hidden_size"] == 64 and s["canvas_length"] == 8 and s["experts"]["total"] == 4


def test_chat_needs_a_terminal_and_list_does_not_import_textual(tmp_path, capsys):
    assert main(["chat"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "localdiff gen" in err
    code = "import sys; from localdiff.cli import main; main(['list']); print('textual' in sys.modules)"
    r = subprocess.run(
        [sys.executable, "-c", code], env=cli_env(tmp_path), capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.stdout.strip().splitlines()[-1] == "False"


def test_debug_shows_the_traceback(capsys):
    assert main(["gen", "-m", "no-such-model", "-p", "x", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("error: unknown model")


def test_show_plan_for_a_24_gib_card(capsys):
    assert main(["show", "diffusiongemma:26b-a4b", "--plan", "--gpu-mem", "24GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["fits"] and plan["gpu_mem_bytes"] == 24 * 2**30 and plan["quant"] == "int8"
    assert main(["show", "diffusiongemma:26b-a4b", "--plan", "--gpu-mem", "24GiB"]) == 0
    assert "memory plan:" in capsys.readouterr().out


def test_gen_verbose_reports_cache_accounting(tmp_path, ckpt):
    r = gen(
        ["-m", str(ckpt), "-v", "--kv-budget", "1KiB", "-p", "hi", "-n", "16"],
        cli_env(tmp_path),
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    stats = next(s for s in lines if s.startswith("stats: "))
    cache = next(s for s in lines if s.startswith("kv cache: "))
    assert "computed" in stats and "reused" in stats
    import re

    from localdiff.units import parse_size  # the line's sizes have units (binary), read back here

    assert re.search(r"device budget 1\.00 KiB\b", cache), cache
    assert parse_size(re.search(r", device \S+ \S+ \(peak (\S+ \S+)\)", cache).group(1)) <= 1024
    assert int(re.search(r"moved (\d+) blocks to host", cache).group(1)) > 0
    config = next(s for s in lines if s.startswith("config: "))  # the file LOCALDIFF_CONFIG names (empty)
    assert config == f"config: {tmp_path / 'config.toml'}"


def test_threads_sets_torchs_thread_count(tmp_path, ckpt):
    """--threads and LOCALDIFF_THREADS reach torch (they were documented gguf-only and ignored on torch models);
    gen -v's backend line says how many run."""
    for extra, env, n in ((["--threads", "1"], {}, 1), ([], {"LOCALDIFF_THREADS": "2"}, 2)):
        r = gen(
            ["-m", str(ckpt), "-v", "-p", "hi", "-n", "4", *extra],
            {**cli_env(tmp_path), **env},
            text=True,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, r.stderr
        line = next(s for s in r.stderr.splitlines() if s.startswith("backend: torch"))
        assert line.endswith(f", {n} thread" + ("s" if n != 1 else "")), line


def test_show_gpu_mem_implies_the_plan(capsys):
    """(a budget without --plan was accepted and ignored)"""
    assert main(["show", "diffusiongemma:26b-a4b", "--gpu-mem", "24GiB"]) == 0
    assert "Memory plan for a 24.00 GiB device" in capsys.readouterr().out


def test_list_and_config_do_not_import_torch(tmp_path):
    """(every command imported torch through the option schema: ~1 s before `list` printed anything)"""
    code = (
        "import sys; from localdiff.cli import main; rc = main(['list']) or main(['config', 'path']); "
        "print(rc, 'torch' in sys.modules)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=cli_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0 and r.stdout.rstrip().splitlines()[-1] == "0 False", (r.stdout, r.stderr)


def test_settings_messages_name_the_place_and_the_fix(tmp_path):
    """A decoder option at the config's top level says where it belongs; LOCALDIFF_QUANT / ``quant =`` outside
    int8 / int4 / none name the variable or file (they reached ``localdiff.load`` unchecked before)."""
    import pytest

    from localdiff.config import load_user_config
    from localdiff.errors import UsageError

    cfg = tmp_path / "config.toml"
    cfg.write_text('decoder = "sdar"\n')
    with pytest.raises(UsageError, match=r"'decoder' is a decoder option: put it under \[sampler\]"):
        load_user_config(env={}, path=cfg)
    with pytest.raises(UsageError, match=r"^LOCALDIFF_QUANT: 'quant' must be one of int8, int4, none \(got 'int5'\)"):
        load_user_config(env={"LOCALDIFF_QUANT": "int5"}, path=tmp_path / "none.toml")
    cfg.write_text('quant = "q4"\n')
    with pytest.raises(UsageError, match=r"config.toml: 'quant' must be one of"):
        load_user_config(env={}, path=cfg)
    cfg.write_text('quant = "int4"\n')
    assert load_user_config(env={}, path=cfg).quant == "int4"


def test_plan_counts_parameters_in_units_of_their_size():
    from localdiff.quantize.plan_text import _count

    assert [_count(n) for n in (384, 70_080, 3_364_064, 25_250_000_000)] == ["384", "70.08 K", "3.36 M", "25.25 B"]


def test_a_config_file_that_breaks_the_toml_reader_is_one_line(tmp_path):
    """(attacker pass) ``seed = <5000 digits>`` and 100,000 nested arrays ended as ``internal error: ValueError`` /
    ``RecursionError``: both are the file's fault, said as such."""
    import pytest

    from localdiff.config import load_user_config
    from localdiff.errors import UsageError

    cfg = tmp_path / "config.toml"
    for text, says in (("seed = 1" + "0" * 5000, "a number too long"), ("a = " + "[" * 100_000, "nested too deeply")):
        cfg.write_text(text + "\n")
        with pytest.raises(UsageError, match=f"config file {cfg} .*{says}"):
            load_user_config(env={}, path=cfg)
