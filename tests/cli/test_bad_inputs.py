"""A corpus of bad inputs to the command line: each gives exactly one ``error: ...`` line on stderr, nothing on
stdout, the right exit code (2 usage, 1 runtime) and never a traceback.

Cases run in-process through ``localdiff.cli`` (fast); a few run as real subprocesses to cover the console
entry point, real stdin bytes and the interpreter's own exit path.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_fixtures import isolated  # noqa: F401  (fixture)

from localdiff.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def broken(tmp_path_factory, ckpt):
    """Checkpoint folders with one thing wrong each (copies of the good one)."""
    root = tmp_path_factory.mktemp("broken")

    def variant(name, edit):
        d = root / name
        shutil.copytree(ckpt, d)
        edit(d)
        return d

    def patch_config(**kw):
        def edit(d):
            cfg = json.loads((d / "config.json").read_text())
            cfg.update(kw)
            (d / "config.json").write_text(json.dumps(cfg))

        return edit

    out = {
        "no_config": variant("no_config", lambda d: (d / "config.json").unlink()),
        "corrupt_config": variant("corrupt_config", lambda d: (d / "config.json").write_text('{"model_type": "dif')),
        "config_not_object": variant("config_not_object", lambda d: (d / "config.json").write_text("[1, 2]")),
        "unknown_model_type": variant("unknown_model_type", patch_config(model_type="llama9000")),
        "no_weights": variant("no_weights", lambda d: (d / "model.safetensors").unlink()),
        "truncated_weights": variant("truncated_weights", lambda d: os.truncate(d / "model.safetensors", 100)),
        "missing_shard": variant(
            "missing_shard",
            lambda d: (d / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}})
            ),
        ),
        "no_tokenizer": variant("no_tokenizer", lambda d: (d / "tokenizer.json").unlink()),
        "huge_range_template": variant(
            "huge_range_template", lambda d: (d / "chat_template.jinja").write_text("{{ range(100000000)|list }}")
        ),
        "nonempty_out": variant("nonempty_out", lambda d: None),
    }
    return out


def _stdin(monkeypatch, data: bytes | None):
    """Replace stdin: bytes → a pipe-like stream; None → a terminal (never read)."""
    if data is None:

        class Tty(io.TextIOWrapper):
            def isatty(self):
                return True

            def read(self, *a):
                raise AssertionError("a terminal stdin must never be read")

        monkeypatch.setattr(sys, "stdin", Tty(io.BytesIO(b"")))
    else:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


# (id, argv (with {ckpt} / {broken:NAME} / {tmp} placeholders), stdin bytes or None for a tty, env, exit code,
#  a fragment the message must contain)
LONG = "word " * 3000
CASES = [
    ("empty -p", ["gen", "-p", ""], None, {}, 2, "empty prompt"),
    ("blank -p", ["gen", "-p", "   \n "], None, {}, 2, "empty prompt"),
    ("no prompt, empty stdin", ["gen"], b"", {}, 2, "no prompt (stdin was empty)"),
    ("no prompt, tty stdin", ["gen"], None, {}, 2, "no prompt"),
    ("invalid UTF-8 on stdin", ["gen", "-p", "x"], b"ok \xff\xfe bad", {}, 2, "stdin is not valid UTF-8"),
    ("non-UTF-8 bytes in -p", ["gen", "-p", "ok \udcff bad"], None, {}, 2, "-p is not valid UTF-8 (byte 0xff)"),
    (
        "non-UTF-8 bytes in --system",
        ["gen", "--system", "\udc9b2J", "-p", "x"],
        None,
        {},
        2,
        "--system is not valid UTF-8 (byte 0x9b)",
    ),
    ("missing prompt file", ["gen", "-f", "{tmp}/nope.txt"], None, {}, 2, "cannot read prompt file"),
    ("non-UTF-8 prompt file", ["gen", "-f", "{tmp}/latin1.txt"], None, {}, 2, "is not valid UTF-8"),
    ("endless prompt file", ["gen", "-f", "/dev/zero"], None, {}, 2, "prompt file /dev/zero is over 64 MiB"),
    ("quiet and verbose", ["gen", "-q", "-v", "-p", "x"], None, {}, 2, "-v/--verbose: not allowed with"),
    ("debug switch junk", ["gen", "-p", "x"], None, {"LOCALDIFF_DEBUG": "banana"}, 2, "LOCALDIFF_DEBUG='banana'"),
    ("serve bad steps", ["serve", "--steps", "0"], None, {}, 2, "--steps: must be an integer in [1, 100000]"),
    (
        "serve nan temperature",
        ["serve", "--temperature", "nan"],
        None,
        {},
        2,
        "--temperature: must be 0 or a number in [0.001, 100]",
    ),
    ("chat list and resume", ["chat", "--list", "--resume", "x"], None, {}, 2, "--resume: not allowed with"),
    ("-p and words", ["gen", "-p", "a", "b"], None, {}, 2, "either with -p or as words"),
    (
        "prompt longer than context",
        ["gen", "-m", "{ckpt}", "--raw", "-p", LONG],
        None,
        {},
        2,
        "exceeds the model's context",
    ),
    ("unknown model", ["gen", "-m", "diffusiongema", "-p", "x"], None, {}, 1, "did you mean 'diffusiongemma:26b-a4b'"),
    (
        "unknown model, nothing near",
        ["gen", "-m", "bad name!", "-p", "x"],
        None,
        {},
        1,
        "unknown model 'bad name!' (use a catalog name",
    ),
    ("missing folder", ["gen", "-m", "./no/such/dir", "-p", "x"], None, {}, 1, "does not exist"),
    ("not pulled", ["gen", "-m", "acme/never-pulled", "-p", "x"], None, {}, 1, "not pulled: run `localdiff pull"),
    ("no config.json", ["gen", "-m", "{broken:no_config}", "-p", "x"], None, {}, 1, "config.json"),
    ("corrupt config.json", ["gen", "-m", "{broken:corrupt_config}", "-p", "x"], None, {}, 1, "not valid JSON"),
    ("config.json not an object", ["gen", "-m", "{broken:config_not_object}", "-p", "x"], None, {}, 1, "JSON object"),
    ("unknown model_type", ["gen", "-m", "{broken:unknown_model_type}", "-p", "x"], None, {}, 1, "llama9000"),
    ("no weights", ["gen", "-m", "{broken:no_weights}", "-p", "x"], None, {}, 1, "model.safetensors"),
    ("truncated weights", ["gen", "-m", "{broken:truncated_weights}", "-p", "x"], None, {}, 1, "safetensors"),
    ("shard missing", ["gen", "-m", "{broken:missing_shard}", "-p", "x"], None, {}, 1, "is missing"),
    ("no tokenizer, text prompt", ["gen", "-m", "{broken:no_tokenizer}", "-p", "x"], None, {}, 1, "tokenizer"),
    ("-n not a number", ["gen", "-n", "many", "-p", "x"], None, {}, 2, "invalid int value: 'many'"),
    ("-n zero", ["gen", "-n", "0", "-p", "x"], None, {}, 2, "max_new_tokens"),
    ("negative steps", ["gen", "--steps", "-3", "-p", "x"], None, {}, 2, "--steps: must be an integer in [1, "),
    (
        "temperature reversed",
        ["gen", "--temperature", "0.2:0.9", "-p", "x"],
        None,
        {},
        2,
        "--temperature: must be ≥ t_min (0.9) (got 0.2)",
    ),
    (
        "temperature garbage",
        ["gen", "--temperature", "hot", "-p", "x"],
        None,
        {},
        2,
        "--temperature: must be 0 or a number in [0.001, 100] (got 'hot')",
    ),
    (
        "temperature three parts",
        ["gen", "--temperature", "1:2:3", "-p", "x"],
        None,
        {},
        2,
        "--temperature: expected a value or a pair A:B (got '1:2:3')",
    ),
    ("threshold > 1", ["gen", "--threshold", "1.5", "-p", "x"], None, {}, 2, "threshold"),
    (
        "entropy bound <= 0",
        ["gen", "--entropy-bound", "-1", "-p", "x"],
        None,
        {},
        2,
        "--entropy-bound: must be a number > 0",
    ),
    ("negative seed", ["gen", "--seed", "-5", "-p", "x"], None, {}, 2, "seed"),
    ("unknown device", ["gen", "-m", "{ckpt}", "--device", "tpu", "-p", "x"], None, {}, 2, "device"),
    ("unknown quant", ["gen", "--quant", "int3", "-p", "x"], None, {}, 2, "invalid choice: 'int3'"),
    ("unknown flag", ["gen", "--frobnicate", "-p", "x"], None, {}, 2, "unrecognized arguments"),
    (
        "unknown flag of list",
        ["list", "--frob"],
        None,
        {},
        2,
        "localdiff list: unrecognized arguments: --frob (see `localdiff list --help`)",
    ),
    ("unknown command", ["frob"], None, {}, 2, "invalid choice: 'frob'"),
    (
        "unknown env variable",
        ["gen", "-p", "x"],
        None,
        {"LOCALDIFF_ENTROPYBOUND": "4"},
        2,
        "unknown environment variable LOCALDIFF_ENTROPYBOUND",
    ),
    ("control characters only", ["gen", "-m", "{ckpt}", "-p", "\x01\x02\x03"], None, {}, 2, "no printable characters"),
    (
        "bad env value",
        ["gen", "-p", "x"],
        None,
        {"LOCALDIFF_MAX_DENOISING_STEPS": "lots"},
        2,
        "LOCALDIFF_MAX_DENOISING_STEPS",
    ),
    ("invalid config TOML", ["gen", "-p", "x"], None, {"@config": "steps = = 3"}, 2, "not valid TOML"),
    (
        "unknown config key",
        ["gen", "-p", "x"],
        None,
        {"@config": "[sampler]\nthresold = 0.9\n"},
        2,
        "did you mean 'threshold'",
    ),
    ("pull a folder", ["pull", "{ckpt}"], None, {}, 2, "nothing to pull"),
    (
        "pull a quantization of a safetensors alias",
        ["pull", "sdar:1.7b", "--quant", "Q4_K_M"],
        None,
        {},
        1,
        "sdar:1.7b has no GGUF files in the catalog, so no Q4_K_M quantization",
    ),
    ("pull offline", ["pull", "acme/x"], None, {}, 1, "offline mode"),
    ("serve unknown model", ["serve", "-m", "no-such-model"], None, {}, 1, "unknown model 'no-such-model'"),
    (
        "serve unresolvable host",
        ["serve", "--host", "no-such-host.invalid", "--insecure"],
        None,
        {},
        1,
        "--host no-such-host.invalid: cannot resolve it",
    ),
    ("rm embedded", ["rm", "tiny"], None, {}, 2, "embedded"),
    ("rm never pulled", ["rm", "acme/x"], None, {}, 1, "nothing to remove"),
    ("rm unknown name", ["rm", "nothing-here"], None, {}, 1, "'nothing-here' is not installed"),
    ("bench zero threads", ["bench", "--threads", "0"], None, {}, 2, "--threads: must be an integer in 1.."),
    ("bench --only empty", ["bench", "--only", ""], None, {}, 2, "--only: name at least one section"),
    (
        "env t_max below t_min",
        ["gen", "-p", "x"],
        None,
        {"LOCALDIFF_T_MIN": "5", "LOCALDIFF_T_MAX": "0.1"},
        2,
        "LOCALDIFF_T_MAX: t_max: must be ≥ t_min (5.0) (got 0.1)",
    ),
    (
        "bad native int8 switch",
        ["gen", "-p", "x"],
        None,
        {"LOCALDIFF_NATIVE_INT8": "bogus"},
        2,
        "LOCALDIFF_NATIVE_INT8='bogus': use one of 0, 1, fma",
    ),
    ("show corrupt config", ["show", "{broken:corrupt_config}"], None, {}, 1, "not valid JSON"),
    ("show unknown", ["show", "nosuch"], None, {}, 1, "unknown model 'nosuch'"),
    (
        "show --plan bad size",
        ["show", "diffusiongemma:26b-a4b", "--plan", "--gpu-mem", "lots"],
        None,
        {},
        2,
        "--gpu-mem",
    ),
    ("quantize to nowhere", ["quantize", "acme/never-pulled", "-o", "{tmp}/q"], None, {}, 1, "not pulled"),
    # issue #22
    (
        "template exhausts the sandbox range",
        ["gen", "-m", "{broken:huge_range_template}", "-p", "x"],
        None,
        {},
        1,
        "render failed (OverflowError: Range too big",
    ),
    (
        "steps past int64",
        ["gen", "--steps", "100000000000000000000", "-p", "x"],
        None,
        {},
        2,
        "--steps: must be an integer in [1, 100000]",
    ),
    (
        "steps past int64 in env",
        ["gen", "-p", "x"],
        None,
        {"LOCALDIFF_MAX_DENOISING_STEPS": str(10**20)},
        2,
        "LOCALDIFF_MAX_DENOISING_STEPS: must be an integer in [1, 100000]",
    ),
    ("empty -m", ["gen", "-m", "", "-p", "x"], None, {}, 2, "empty model name"),
    (
        "negative --kv-budget",
        ["gen", "-m", "{ckpt}", "--kv-budget", "-1GiB", "-p", "x"],
        None,
        {},
        2,
        "--kv-budget: a size must be ≥ 0, got '-1GiB'",
    ),
    ("negative --gpu-mem", ["gen", "--gpu-mem", "-2GiB", "-p", "x"], None, {}, 2, "--gpu-mem: a size must be > 0"),
    (
        "--gpu-mem over 1024 PiB",
        ["show", "tiny", "--plan", "--gpu-mem", "99999999999999999999999999999TiB"],
        None,
        {},
        2,
        "--gpu-mem: size too large: '99999999999999999999999999999TiB' (at most 1024 PiB)",
    ),
    ("empty --gpu-mem (show)", ["show", "tiny", "--plan", "--gpu-mem", ""], None, {}, 2, "--gpu-mem: expected a size"),
    (
        "zero --gpu-mem (gen)",
        ["gen", "--gpu-mem", "0", "-p", "x"],
        None,
        {},
        2,
        "--gpu-mem: a size must be > 0, got '0'",
    ),
    (
        "zero --gpu-mem (show)",
        ["show", "tiny", "--plan", "--gpu-mem", "0"],
        None,
        {},
        2,
        "--gpu-mem: a size must be > 0, got '0'",
    ),
    (
        "under a byte --ram",
        ["show", "tiny", "--plan", "--device", "cpu", "--ram", "0.0001KiB"],
        None,
        {},
        2,
        "--ram: a size must be > 0",
    ),
    (
        "quantize into a non-empty folder",
        ["quantize", "{ckpt}", "-o", "{broken:nonempty_out}"],
        None,
        {},
        2,
        "folder is not empty; choose a new folder, or pass --force",
    ),
    # newcomer check, session 5: refused before any model load or network contact (port 1 has no server)
    (
        "--system with --raw",
        ["gen", "-m", "{ckpt}", "--raw", "--system", "be brief", "-p", "x"],
        None,
        {},
        2,
        "--system needs chat mode: drop --raw",
    ),
    (
        "--system with --raw, endpoint",
        ["gen", "--endpoint", "http://127.0.0.1:1", "--raw", "--system", "s", "-p", "x"],
        None,
        {},
        2,
        "--system needs chat mode: drop --raw",
    ),
    (
        "serve --api-key with --insecure",
        ["serve", "--api-key", "k", "--insecure"],
        None,
        {},
        2,
        "--insecure contradicts --api-key: drop --insecure to require the key, or drop --api-key",
    ),
    (
        "serve env key with --insecure",
        ["serve", "--host", "0.0.0.0", "--insecure"],
        None,
        {"LOCALDIFF_API_KEY": "k"},
        2,
        "--insecure contradicts LOCALDIFF_API_KEY (set in the environment)",
    ),
    ("serve empty --api-key", ["serve", "--api-key", ""], None, {}, 2, "--api-key: empty key"),
    ("serve empty --host", ["serve", "--host", ""], None, {}, 2, "--host: empty host name (leave --host out"),
    ("serve blank --host with a key", ["serve", "--host", " ", "--api-key", "k"], None, {}, 2, "--host: empty host"),
    ("list with invalid config TOML", ["list"], None, {"@config": "steps = = 3"}, 2, "not valid TOML"),
    (
        "ls --json with unknown config key",
        ["ls", "--json"],
        None,
        {"@config": "[sampler]\nthresold = 0.9\n"},
        2,
        "did you mean 'threshold'",
    ),
    ("show NAME with invalid config TOML", ["show", "tiny"], None, {"@config": "x = [1,"}, 2, "not valid TOML"),
    ("pull with invalid config TOML", ["pull", "tiny"], None, {"@config": "x = [1,"}, 2, "not valid TOML"),
    ("rm with invalid config TOML", ["rm", "acme/x"], None, {"@config": "x = [1,"}, 2, "not valid TOML"),
    (
        "--timeout not a number",
        ["gen", "--endpoint", "http://127.0.0.1:1", "--timeout", "soon", "-p", "x"],
        None,
        {},
        2,
        "--timeout: expected a number of seconds > 0, e.g. 60 (got 'soon')",
    ),
    (
        "--timeout zero",
        ["gen", "--endpoint", "http://127.0.0.1:1", "--timeout", "0", "-p", "x"],
        None,
        {},
        2,
        "--timeout: expected a number of seconds > 0",
    ),
    (
        "--timeout nan",
        ["gen", "--endpoint", "http://127.0.0.1:1", "--timeout", "nan", "-p", "x"],
        None,
        {},
        2,
        "--timeout: expected a number of seconds > 0",
    ),
    (
        "LOCALDIFF_TIMEOUT negative",
        ["gen", "--endpoint", "http://127.0.0.1:1", "-p", "x"],
        None,
        {"LOCALDIFF_TIMEOUT": "-5"},
        2,
        "LOCALDIFF_TIMEOUT: expected a number of seconds > 0, e.g. 60 (got '-5')",
    ),
    (
        "--timeout without --endpoint",
        ["gen", "-m", "{ckpt}", "--timeout", "5", "-p", "x"],
        None,
        {},
        2,
        "--timeout applies to --endpoint URL",
    ),
    (
        "--api-key without --endpoint",
        ["gen", "-m", "{ckpt}", "--api-key", "k", "-p", "x"],
        None,
        {},
        2,
        "--api-key applies to --endpoint URL",
    ),
    ("empty --endpoint", ["gen", "--endpoint", "", "-p", "x"], None, {}, 2, "--endpoint: empty URL"),
    (
        "serve --keep-alive nan",
        ["serve", "--keep-alive", "nan"],
        None,
        {},
        2,
        "--keep-alive must be a number of seconds ≥ 0; 0 = never unload (got nan)",
    ),
    ("serve --max-body 0", ["serve", "--max-body", "0"], None, {}, 2, "--max-body: a size must be > 0, got '0'"),
    ("show empty name", ["show", ""], None, {}, 2, "empty model name"),
    ("quantize -o empty", ["quantize", "{ckpt}", "-o", ""], None, {}, 2, "-o: empty folder name"),
    (
        "pull --quant empty",
        ["pull", "acme/x", "--quant", ""],
        None,
        {},
        2,
        "--quant: '' is not a GGUF quantization label",
    ),
    (
        "--endpoint unclosed IPv6 bracket",
        ["gen", "--endpoint", "http://[::1", "-p", "x"],
        None,
        {},
        2,
        "--endpoint must be an http(s) URL such as",
    ),
    (
        "--endpoint port not a number",
        ["gen", "--endpoint", "http://127.0.0.1:abc", "-p", "x"],
        None,
        {},
        2,
        "(got 'http://127.0.0.1:abc')",
    ),
    (
        "--endpoint port out of range",
        ["gen", "--endpoint", "http://127.0.0.1:99999", "-p", "x"],
        None,
        {},
        2,
        "(got 'http://127.0.0.1:99999')",
    ),
    (
        "--endpoint with a control character",
        ["gen", "--endpoint", "http://127.0.0.1:1/\x1b[31m", "-p", "x"],
        None,
        {},
        2,
        "(got 'http://127.0.0.1:1/\\x1b[31m')",
    ),
    (
        "--api-key not ASCII",
        ["gen", "--endpoint", "http://127.0.0.1:1", "--api-key", "ключ", "-p", "x"],
        None,
        {},
        2,
        "--api-key: use visible ASCII characters only",
    ),
    (
        "--api-key with a newline",
        ["serve", "--api-key", "k\nX-Evil: 1"],
        None,
        {},
        2,
        "--api-key: use visible ASCII characters only",
    ),
    (
        "LOCALDIFF_API_KEY with a space",
        ["serve"],
        None,
        {"LOCALDIFF_API_KEY": "two words"},
        2,
        "LOCALDIFF_API_KEY: use visible ASCII characters only",
    ),
    (
        "bench --readme missing, before any section",
        ["bench", "--quick", "--only", "ref", "--readme", "{tmp}/no.md"],
        None,
        {},
        2,
        "--readme: ",
    ),
    (
        "bench --out a folder",
        ["bench", "--quick", "--only", "ref", "--out", "{tmp}"],
        None,
        {},
        2,
        "is a folder; give a file name",
    ),
    (
        "bench --out a device",
        ["bench", "--quick", "--only", "ref", "--out", "/dev/full"],
        None,
        {},
        2,
        "--out /dev/full: not a regular file; give a file name",
    ),
    (
        "bench --md under a file",
        ["bench", "--quick", "--only", "ref", "--md", "{tmp}/latin1.txt/r.md"],
        None,
        {},
        2,
        "cannot create",
    ),
    (
        "--raw-bytes with --json",
        ["gen", "-m", "{ckpt}", "--json", "--raw-bytes", "-p", "x"],
        None,
        {},
        2,
        "--raw-bytes does nothing with --json",
    ),
    (
        "serve --kv-budget not a size",
        ["serve", "--kv-budget", "lots"],
        None,
        {},
        2,
        "--kv-budget: expected a size like 2GiB or 512MB, got 'lots'",
    ),
    (
        "serve --max-batch 0",
        ["serve", "--max-batch", "0"],
        None,
        {},
        2,
        "--max-batch must be between 1 and 256 (got 0)",
    ),
    (
        "serve --max-batch huge",
        ["serve", "--max-batch", "999999999999"],
        None,
        {},
        2,
        "--max-batch must be between 1 and 256 (got 999999999999)",
    ),
    (
        "--threads with --endpoint",
        ["gen", "--endpoint", "http://127.0.0.1:1", "--threads", "2", "-p", "x"],
        None,
        {},
        2,
        "--threads applies to local models, not to --endpoint",
    ),
    (
        "empty -m with --endpoint",
        ["gen", "--endpoint", "http://127.0.0.1:1", "-m", "", "-p", "x"],
        None,
        {},
        2,
        "empty model name (leave -m out for the server's first model)",
    ),
    # newcomer check, session 8: raw exception text ("[Errno 21]", "expected int", a codec's words) in the line
    (
        "config path a folder",
        ["gen", "-p", "x"],
        None,
        {"LOCALDIFF_CONFIG": "{tmp}"},
        2,
        "is a folder; it must be a TOML file (or set LOCALDIFF_CONFIG to one)",
    ),
    (
        "non-UTF-8 config file",
        ["gen", "-p", "x"],
        None,
        {"@config": b'steps = "caf\xe9"\n'},
        2,
        "config.toml is not valid UTF-8 (byte 0xe9 at offset 12); TOML files are UTF-8",
    ),
    (
        "seed nan in env",
        ["gen", "-p", "x"],
        None,
        {"LOCALDIFF_SEED": "nan"},
        2,
        "LOCALDIFF_SEED: invalid value 'nan' for 'seed' (expected an integer)",
    ),
    (
        "data folder a file",
        ["chat", "--list"],
        None,
        {"LOCALDIFF_DATA_DIR": "{tmp}/latin1.txt/d"},
        1,
        "latin1.txt is not a folder (set LOCALDIFF_DATA_DIR to a folder)",
    ),
    (
        "hub cache a file",
        ["pull", "acme/x"],
        None,
        {"@hub": "{tmp}/latin1.txt"},
        1,
        "latin1.txt is not a folder (set HF_HOME or HF_HUB_CACHE to a folder)",
    ),
    # newcomer check, round 3: a name past the file system's 255 bytes was "internal error: OSError: [Errno 36]"
    (
        "model name too long",
        ["gen", "-m", "a" * 5000, "-p", "x"],
        None,
        {},
        2,
        "name too long for a file or folder: 'aaaa",
    ),
    ("show a name too long", ["show", "b" * 300], None, {}, 2, "(300 characters; the file system allows 255"),
    ("pull a name too long", ["pull", "c" * 300], None, {}, 2, "give a shorter model name or path"),
    ("rm a name too long", ["rm", "d" * 300], None, {}, 2, "name too long for a file or folder"),
    (
        "bench --model unknown, before any section",
        ["bench", "--only", "eval", "--model", "no-such-model"],
        None,
        {},
        1,
        "unknown model 'no-such-model'",
    ),
    (
        "bench --model of another family",
        ["bench", "--only", "eval", "--model", "tiny-mdm"],
        None,
        {},
        2,
        "--model tiny-mdm: a llada checkpoint; --model runs a DiffusionGemma model such as tiny",
    ),
    (
        "bench --model not a checkpoint",
        ["bench", "--only", "eval", "--model", "{tmp}"],
        None,
        {},
        1,
        "config.json: file not found",
    ),
    (
        "bench --eval-file a device",
        ["bench", "--eval", "--eval-file", "/dev/zero"],
        None,
        {},
        2,
        "--eval-file /dev/zero: is not a regular file; give a JSONL file of eval items",
    ),
    (
        "bench --eval-file a folder",
        ["bench", "--eval", "--eval-file", "{tmp}"],
        None,
        {},
        2,
        ": is a folder; give a JSONL",
    ),
    (
        "bench --readme a folder",
        ["bench", "--quick", "--only", "ref", "--readme", "{tmp}"],
        None,
        {},
        2,
        "is a folder; give the README file",
    ),
    (
        "bench --random-model not a checkpoint",
        ["bench", "--only", "ref", "--ref-on", "random", "--random-model", "{tmp}"],
        None,
        {},
        2,
        "not a checkpoint folder (no config.json)",
    ),
    (
        "quantize on a device torch does not know",
        ["quantize", "{ckpt}", "-o", "{tmp}/q", "--device", "tpu"],
        None,
        {},
        2,
        "--device: invalid device 'tpu' (use cpu, cuda or cuda:N)",
    ),
    (
        "quantize on the meta device",
        ["quantize", "{ckpt}", "-o", "{tmp}/q", "--device", "meta"],
        None,
        {},
        2,
        "--device: unsupported device 'meta'",
    ),
]


def _fill(argv, ckpt, broken, tmp):
    out = []
    for a in argv:
        a = a.replace("{ckpt}", str(ckpt)).replace("{tmp}", str(tmp))
        if a.startswith("{broken:"):
            a = str(broken[a[len("{broken:") : -1]])
        out.append(a)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line_and_exit_code(case, ckpt, broken, isolated, monkeypatch, capsys):
    _, argv, stdin, env, code, fragment = case
    (isolated / "latin1.txt").write_bytes("café".encode("latin-1"))
    for k, v in env.items():
        if k == "@config":
            (isolated / "config.toml").write_bytes(v if isinstance(v, bytes) else v.encode())
        elif k == "@hub":  # the hub cache huggingface_hub read from the environment at import
            from huggingface_hub import constants

            monkeypatch.setattr(constants, "HF_HUB_CACHE", v.replace("{tmp}", str(isolated)))
        else:
            monkeypatch.setenv(k, v.replace("{tmp}", str(isolated)))
    _stdin(monkeypatch, stdin)
    rc = main(_fill(argv, ckpt, broken, isolated))
    out, err = capsys.readouterr()
    assert rc == code, err
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    assert fragment in err


def test_serve_on_a_taken_port_is_one_line(capsys):
    """(uvicorn alone logged six lines and exited 3)"""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use (is another server running "
        "there? use --port)"
    ]


@pytest.mark.parametrize(
    "which,said",
    [
        ("{tmp}", "config.json: file not found"),
        ("{broken:no_config}", "config.json: file not found"),
        ("{broken:corrupt_config}", "config.json: not valid JSON"),
    ],
    ids=["not-a-checkpoint", "no-config", "corrupt-config"],
)
def test_serve_a_folder_that_cannot_load_is_one_line_before_listening(which, said, broken, isolated, capsys):
    """(`serve -m /etc` listened, logged "could not load /etc" and answered every request with an error; the port
    here is taken so that the old order, port check first, fails fast instead of serving)"""
    import socket

    folder = _fill([which], None, broken, isolated)[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert main(["serve", "-m", folder, "--port", str(s.getsockname()[1])]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: -m {folder}: ") and said in err, err


def test_corpus_names_are_unique_and_fragments_specific():
    """Each case is its own scenario (ids unique) and checks a message fragment more specific than the prefix."""
    ids = [c[0] for c in CASES]
    assert len(set(ids)) == len(ids)
    assert all(len(c[5]) >= 4 and c[5] not in ("error", "error: ") for c in CASES)


def test_quantize_on_cuda_without_a_gpu_is_one_line_and_writes_nothing(ckpt, isolated, capsys, monkeypatch):
    """(it was "internal error: AssertionError: Torch not compiled with CUDA enabled", after -o was created)"""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["quantize", str(ckpt), "-o", str(isolated / "q"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --device cuda: no CUDA GPU is available (leave --device out to quantize on the CPU)\n"
    assert not (isolated / "q").exists()


def test_quantize_refusal_leaves_the_folder_untouched(broken, isolated, ckpt, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in broken["nonempty_out"].iterdir()}
    assert main(["quantize", str(ckpt), "-o", str(broken["nonempty_out"])]) == 2
    assert {p.name: p.stat().st_mtime_ns for p in broken["nonempty_out"].iterdir()} == before


def _sub_env(tmp_path) -> dict:
    """A subprocess environment without the user's LOCALDIFF_* / HF_* settings, config and caches in tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALDIFF_", "HF_"))}
    (tmp_path / "c.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    env.update(
        LOCALDIFF_CONFIG=str(tmp_path / "c.toml"),
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    return env


def test_stdout_closed_is_one_clear_line(ckpt, tmp_path):
    env = _sub_env(tmp_path)
    cmd = f"exec {sys.executable} -m localdiff gen -m {ckpt} -p x >&-"
    r = subprocess.run(
        ["bash", "-c", cmd], capture_output=True, env=env, cwd=ROOT, timeout=120, stdin=subprocess.DEVNULL, text=True
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: stdout is closed") and "internal error" not in r.stderr


def test_an_endless_stdin_is_one_clear_line(ckpt, tmp_path):
    """(`yes | localdiff gen` and `-f /dev/zero` read forever, growing memory)"""
    env = _sub_env(tmp_path)
    cmd = f"exec </dev/zero {sys.executable} -m localdiff gen -m {ckpt} -p x"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, env=env, cwd=ROOT, timeout=120, text=True)
    assert r.returncode == 2 and r.stderr == "error: stdin is over 64 MiB, far past any model's context\n", r.stderr


def test_a_stdin_pipe_that_stays_open_is_announced_after_a_second(ckpt, tmp_path):
    import time

    env = _sub_env(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "localdiff", "gen", "-m", str(ckpt), "--raw", "-p", "x", "-n", "8"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    try:
        os.set_blocking(proc.stderr.fileno(), False)
        err, deadline = b"", time.monotonic() + 60
        while b"to skip stdin, run with </dev/null" not in err:
            assert time.monotonic() < deadline and proc.poll() is None, err
            time.sleep(0.1)
            err += proc.stderr.read() or b""
        proc.stdin.write(b"context\n")
        proc.stdin.close()  # the prompt is read; generation goes on
        os.set_blocking(proc.stderr.fileno(), True)
        out, rest = proc.stdout.read(), proc.stderr.read()
        proc.wait(120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err + rest
    assert err.count(b"waiting for stdin") == 1 and out.strip()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_named_pipe_as_prompt_file_is_announced_then_read(ckpt, tmp_path):
    """(`-f FIFO` with no writer yet waited without a word, where a stdin pipe says so after a second)"""
    import time

    fifo = tmp_path / "prompt.fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "-m", "localdiff", "gen", "-m", str(ckpt), "--raw", "-f", str(fifo), "-n", "8"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_sub_env(tmp_path),
        cwd=ROOT,
    )
    try:
        os.set_blocking(proc.stderr.fileno(), False)
        err, deadline = b"", time.monotonic() + 60
        while b"nothing has written to it yet" not in err:
            assert time.monotonic() < deadline and proc.poll() is None, err
            time.sleep(0.1)
            err += proc.stderr.read() or b""
        fifo.write_bytes(b"context\n")  # the writer comes: the prompt is read, generation goes on
        os.set_blocking(proc.stderr.fileno(), True)
        out, rest = proc.stdout.read(), proc.stderr.read()
        proc.wait(120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.strip(), err + rest
    assert err.decode().startswith(f"waiting for prompt file {fifo}: it is a pipe and nothing has written to it yet")


@pytest.mark.parametrize(
    "argv,stdin,code,env",
    [
        (["gen", "-p", "x"], b"\xc3\x28 invalid", 2, {}),
        (["gen", "--steps", "abc", "-p", "x"], b"", 2, {}),
        (["gen", "-m", "{broken:corrupt_config}", "-p", "x"], b"", 1, {}),
        (["pull", "acme/x"], b"", 1, {"HF_HOME": os.devnull, "HF_HUB_OFFLINE": "0"}),  # was "internal error: ..."
    ],
    ids=["invalid-utf8-stdin", "bad-flag", "corrupt-config", "HF_HOME-a-file"],
)
def test_bad_inputs_as_subprocess(argv, stdin, code, env, ckpt, broken, tmp_path):
    env = {**_sub_env(tmp_path), **env}
    r = subprocess.run(
        [sys.executable, "-m", "localdiff", *_fill(argv, ckpt, broken, tmp_path)],
        input=stdin,
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == code
    assert r.stdout == b"" and r.stderr.count(b"\n") == 1 and b"Traceback" not in r.stderr
    assert b"internal error" not in r.stderr and b"offline mode" not in r.stderr, r.stderr


@pytest.mark.parametrize("json_out", [False, True], ids=["table", "json"])
def test_list_with_a_hub_cache_that_is_a_file_warns_and_lists_the_embedded(json_out, isolated, monkeypatch, capsys):
    """(the embedded models alone, without a word, where pull says the cache is not a folder)"""
    from huggingface_hub import constants

    (isolated / "latin1.txt").write_bytes(b"caf\xe9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(isolated / "latin1.txt"))
    assert main(["list", *(["--json"] if json_out else [])]) == 0
    out, err = capsys.readouterr()
    assert err == (
        f"warning: the Hugging Face cache {isolated / 'latin1.txt'} is not a folder (set HF_HOME or "
        "HF_HUB_CACHE to a folder); only the embedded models are listed\n"
    )
    assert "tiny" in out


def test_config_path_answers_with_an_invalid_config_file(isolated, capsys):
    """Every command refuses a broken config file except ``config path``, which is how to find it."""
    (isolated / "config.toml").write_text("steps = = 3")
    assert main(["config", "path"]) == 0
    assert capsys.readouterr().out == f"{isolated / 'config.toml'}\n"
    assert main(["config"]) == 2 and "not valid TOML" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["gen", "-m", "{ckpt}", "-p", "x", "-n", "8"], ["list"]], ids=["gen", "list"])
def test_a_full_output_device_is_one_line(argv, ckpt, broken, tmp_path):
    """(`>/dev/full` was "internal error: OSError: [Errno 28] ...")"""
    env = _sub_env(tmp_path)
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "localdiff", *_fill(argv, ckpt, broken, tmp_path)],
            stdout=full,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=ROOT,
            timeout=120,
            text=True,
        )
    assert r.returncode == 1 and r.stderr == "error: No space left on device\n", r.stderr
