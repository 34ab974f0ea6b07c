"""``localdiff`` command line: argument parsing and dispatch only.

Subcommands: gen, chat, serve, pull, list, rm, show, config, bench, quantize, convert. Heavy imports (torch, textual,
the engine) happen inside the command that needs them, so ``localdiff list`` / ``pull`` start fast and ``textual`` is
imported only for ``chat``.

Exit codes: 0 ok; 1 runtime error; 2 usage error; 130 interrupted (Ctrl-C: the line ``interrupted``, at load
as during a generation; ``serve`` stopped by Ctrl-C or SIGTERM after draining exits 0). Errors are one line on stderr
(``error: ...``); ``--debug`` (or ``LOCALDIFF_DEBUG=1``) prints the traceback too.
"""
from __future__ import annotations

import argparse
import errno
import os
import sys
import traceback

from localdiff.errors import LocaldiffError, UsageError
from localdiff.cli.argv import join_negative_values as _join_negative_values, name_too_long
from localdiff.usage_parser import UsageParser as _Parser

SAMPLER_HELP = "sampler settings (flag > LOCALDIFF_* env > config file > checkpoint generation_config > built-in)"


def _dtype(value: str) -> str:
    from localdiff.setting_values import dtype_name

    return dtype_name(value, "--dtype")


def _threads(value: str) -> int:
    """``--threads N``: 1 … 4 × the CPU count (``setting_values.check_threads``; 100,000 crashed torch)."""
    from localdiff.setting_values import check_threads

    return check_threads(value, "--threads")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")


def _add_sampler(p: argparse.ArgumentParser) -> None:
    from localdiff.decoding.options import cli_flags, flag_envs

    g = p.add_argument_group(SAMPLER_HELP)
    g.add_argument("-n", "--max-new-tokens", type=int, metavar="N", help="generate at most N tokens")
    for flag, key, spec in cli_flags():     # every decoder option, from the one schema (localdiff.decoding.options)
        helptext = f"{spec.help} ({spec.rule()}; {', '.join(flag_envs(flag))})"
        if spec.kind is bool:
            g.add_argument(flag, dest="opt_" + key, action=argparse.BooleanOptionalAction, default=None, help=helptext)
        else:
            g.add_argument(flag, dest="opt_" + key, metavar=spec.metavar or key.upper(), help=helptext)
    g.add_argument("--seed", type=int, help="random seed (reproducible output)")
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: CUDA when available)")
    g.add_argument("--quant", choices=["int8", "int4", "none"], help="weight quantization at load (gen default: "
                                                                    "bf16, int8 or int4, the first that fits)")
    g.add_argument("--draft", metavar="MODEL", help="DFlash draft for a Qwen3 / Llama target: speculative decoding, "
                                                     "same output (alias, org/repo or folder; 'auto' = the catalog's)")
    g.add_argument("--gpu-mem", metavar="SIZE", help="CUDA memory budget for the memory plan, e.g. 24GiB "
                                                     "(default: free memory measured at load)")
    g.add_argument("--kv-budget", metavar="SIZE", help="device bytes for the KV cache, e.g. 2GiB; older blocks of "
                                                       "full-attention layers move to host memory beyond it")
    g.add_argument("--threads", type=_threads, metavar="N",
                   help="CPU threads, 1 to 4 × the CPU count (torch's intra-op threads, or llama.cpp's for a GGUF "
                        "model; default: 1 for a model under 10M parameters, else all cores; LOCALDIFF_THREADS)")
    g.add_argument("--gpu-layers", metavar="N|all", help="GGUF models: layers llama.cpp offloads to the GPU of a Metal "
                                                         "or CUDA build of llama-cpp-python (n_gpu_layers; default: "
                                                         "all when the build can offload, else 0)")


def _add_endpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", metavar="URL", help="use an OpenAI-compatible server (localdiff serve, vLLM, "
                                                     "SGLang) instead of a local model, e.g. http://127.0.0.1:11436/v1")
    p.add_argument("--api-key", help="API key for --endpoint (default: $LOCALDIFF_API_KEY)")
    p.add_argument("--timeout", metavar="SECONDS", help="--endpoint: give up when the server sends nothing for "
                                                        "SECONDS, before its first byte or mid-answer (default 600; "
                                                        "connecting: at most 10; $LOCALDIFF_TIMEOUT)")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (used by :func:`main` and by the docs)."""
    p = _Parser(prog="localdiff", description="Run diffusion language models on this machine.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser("gen", help="generate text once (for scripts and pipelines)",
                       description="Generate text. Piped stdin is placed before the prompt. Only generated text "
                                   "goes to stdout, canvas by canvas; diagnostics go to stderr.")
    g.add_argument("prompt_words", nargs="*", metavar="PROMPT", help="prompt text (or use -p)")
    g.add_argument("-m", "--model", help="model name, org/repo[@rev] or folder (default: config's default_model)")
    g.add_argument("-p", "--prompt", help="prompt text")
    g.add_argument("-f", "--file", help="read the prompt from FILE ('-' = stdin)")
    g.add_argument("--system", help="system message (chat mode)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=True,
                      help="wrap the prompt in the model's chat template (default)")
    mode.add_argument("--raw", dest="chat", action="store_false", help="feed the prompt text as is")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, settings, stats)")
    g.add_argument("--raw-bytes", action="store_true",
                   help="write the model's text exactly, control characters included, when stdout is not a "
                        "terminal (default: they are shown as visible symbols, e.g. ESC as ␛)")
    talk = g.add_mutually_exclusive_group()
    talk.add_argument("-q", "--quiet", action="store_true", help="no stats line on stderr (shown on a terminal)")
    talk.add_argument("-v", "--verbose", action="store_true",
                   help="stats and KV-cache accounting (device/host bytes, blocks moved, prefill computed vs "
                        "reused) on stderr, terminal or not")
    g.add_argument("--dtype", type=_dtype, metavar="{float32,bfloat16,float16}",
                   help="compute dtype (default on CPU: bfloat16 where the CPU has native bf16 GEMM and the model "
                        "is large or stored in 16 bits, else float32; float32 = the reference-exact path; "
                        "env LOCALDIFF_DTYPE)")
    _add_endpoint(g)
    _add_sampler(g)
    _add_common(g)

    c = sub.add_parser("chat", help="interactive chat that shows the canvas denoising (terminal UI)")
    c.add_argument("-m", "--model", help="model to start with (default: config's default_model)")
    which = c.add_mutually_exclusive_group()
    which.add_argument("--resume", nargs="?", const="last", metavar="ID",
                       help="resume a conversation (default: last)")
    which.add_argument("--list", dest="list_only", action="store_true", help="list saved conversations and exit")
    _add_endpoint(c)
    _add_sampler(c)
    _add_common(c)

    sv = sub.add_parser("serve", help="OpenAI- and Ollama-compatible HTTP API (127.0.0.1 by default)",
                        description="Serve models over HTTP: OpenAI /v1/chat/completions, /v1/completions, "
                                    "/v1/models; Ollama /api/chat, /api/generate, /api/tags, /api/ps; /health.")
    sv.add_argument("-m", "--model", action="append", metavar="MODEL",
                    help="serve this model besides the installed ones (a name or a path; repeatable; the first "
                         "loads at start and answers requests that name none). Requests name models only by the "
                         "names GET /v1/models lists, never by a path")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; another address "
                                                         "needs --api-key or --insecure)")
    sv.add_argument("--port", type=int, default=11436, help="port (default 11436)")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $LOCALDIFF_API_KEY)")
    sv.add_argument("--insecure", action="store_true", help="allow a non-local --host without an API key (a usage "
                                                             "error with --api-key or $LOCALDIFF_API_KEY)")
    sv.add_argument("--max-queue", type=int, default=32, metavar="N", help="requests waiting at most (then 503)")
    sv.add_argument("--max-batch", type=int, default=8, metavar="N", help="requests advanced together (default 8)")
    sv.add_argument("--keep-alive", type=float, default=300.0, metavar="SECONDS", help="unload after SECONDS idle")
    sv.add_argument("--max-body", metavar="SIZE", help="request size limit, e.g. 1MiB (default 1MiB)")
    _add_sampler(sv)
    _add_common(sv)

    pl = sub.add_parser("pull", help="download a model from the Hugging Face Hub (resumable)")
    pl.add_argument("name", help="catalog alias (see `localdiff list --all`) or org/repo[@revision]")
    pl.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    pl.add_argument("--verify", action="store_true", help="re-hash files already in the cache")
    pl.add_argument("--quant", metavar="LABEL", help="a GGUF repo: pull the one file of this quantization (e.g. "
                                                     "Q4_K_M; same as NAME:Q4_K_M)")
    pl.add_argument("--no-space-check", dest="check_space", action="store_false",
                    help="download even when free disk is below what is left to fetch + a 64 MiB margin")
    pl.add_argument("--force", action="store_true", help="download even when the model fits this machine's GPU "
                                                         "memory / RAM in no precision (bf16, int8, int4)")
    _add_common(pl)

    ls = sub.add_parser("list", aliases=["ls"], help="list models ready to run")
    ls.add_argument("--json", action="store_true", help="JSON output")
    ls.add_argument("--all", action="store_true", help="also show catalog models that are not pulled")
    _add_common(ls)

    rm = sub.add_parser("rm", help="remove a pulled model from the Hugging Face cache")
    rm.add_argument("name")
    _add_common(rm)

    sh = sub.add_parser("show", help="architecture summary and memory plan (works before a pull)")
    sh.add_argument("name", nargs="?", help="model (default: config's default_model)")
    sh.add_argument("--plan", action="store_true", help="print the memory plan for a device budget")
    sh.add_argument("--gpu-mem", metavar="SIZE", help="device memory budget, e.g. 24GiB (default: measured; "
                    "implies --plan)")
    sh.add_argument("--quant", choices=["int8", "int4", "none", "bf16"], default=None,
                    help="precision for the plan (default: int8; implies --plan)")
    sh.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="plan for a GPU or for the CPU alone (RAM: --ram); default: the GPU when one is found "
                         "or --gpu-mem is given, else the CPU")
    sh.add_argument("--kv-budget", metavar="SIZE", help="KV-cache bytes in the plan, e.g. 512MiB (default: "
                    "min(context, 32768) tokens)")
    sh.add_argument("--ram", metavar="SIZE", help="RAM for the plan, e.g. 32GiB (default: measured): the budget "
                    "with --device cpu; what host expert layers must fit on a GPU plan")
    sh.add_argument("--json", action="store_true", help="JSON output")
    _add_common(sh)

    cf = sub.add_parser("config", help="show where the config file is, or the effective settings")
    cf.add_argument("action", nargs="?", choices=["path", "show"], default="show")
    cf.add_argument("--json", action="store_true", help="JSON output (show)")
    _add_common(cf)

    b = sub.add_parser("bench", help="benchmarks (speed, memory, accuracy)", add_help=False)
    b.add_argument("bench_args", nargs=argparse.REMAINDER)

    q = sub.add_parser("quantize", help="write a pre-quantized int8 / int4 checkpoint")
    q.add_argument("name", help="model to quantize")
    q.add_argument("--recipe", help="quantization recipe name (default: the model's)")
    q.add_argument("--quant", choices=["int8", "int4"], default=None,
                   help="precision of the recipe's quantized tensors (default: as the recipe says, int8)")
    q.add_argument("-o", "--output", required=True, metavar="DIR", help="output folder")
    q.add_argument("--device", help="device used while quantizing")
    q.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    _add_common(q)

    from localdiff.cli.convert import add_parser as add_convert

    add_convert(sub)
    return p


def _check_environment() -> None:
    """Every subcommand refuses an unknown ``LOCALDIFF_*`` variable as ``gen`` does (``config.check_environment``)."""
    from localdiff.config import check_environment

    check_environment()


def _check_config(args) -> None:
    """Commands that do not otherwise read the config file (``list``, ``pull``, ``rm``, ``show NAME``,
    ``quantize``) still refuse an invalid one, as ``gen`` / ``chat`` / ``serve`` do — a broken file is reported by
    the first command run, not by whichever reads it. ``config path`` is exempt (it is how to find the file).

    Raises:
        UsageError: the file is not valid TOML, has an unknown key or a bad value (``config.load_user_config``).
    """
    if args.command == "config" and args.action == "path":
        return
    from localdiff.config import load_user_config

    load_user_config()


def _check_text_arguments(args) -> None:
    """A prompt or system text typed on the command line with bytes that are not UTF-8 (Python keeps them as lone
    surrogates) is a usage error naming the argument, as for stdin and ``-f`` files.

    Raises:
        UsageError: ``-p``, the prompt words or ``--system`` is not valid UTF-8.
    """
    for attr, name in (("prompt", "-p"), ("prompt_words", "the prompt"), ("system", "--system")):
        value = getattr(args, attr, None)
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    bad = text[e.start].encode("utf-8", "surrogateescape")[0]
                    raise UsageError(f"{name} is not valid UTF-8 (byte 0x{bad:02x})") from None


def _dispatch(args, argv) -> int:
    _check_environment()
    _check_config(args)
    _check_text_arguments(args)
    cmd = args.command
    if cmd in ("gen", "chat"):
        from localdiff.cli.remote import check_endpoint_flags

        check_endpoint_flags(args)
    if cmd == "gen":
        if getattr(args, "endpoint", None):
            from localdiff.cli.remote import run_gen_remote

            return run_gen_remote(args)
        from localdiff.cli.gen import run_gen

        return run_gen(args)
    if cmd == "serve":
        from localdiff.cli.remote import run_serve

        return run_serve(args)
    if cmd == "chat":
        from localdiff.cli.hub import run_chat_cmd

        return run_chat_cmd(args)
    if cmd in ("pull", "list", "ls", "rm", "show", "config", "quantize"):
        from localdiff.cli import hub as cli_hub

        return getattr(cli_hub, "run_" + {"ls": "list"}.get(cmd, cmd))(args)
    if cmd == "convert":
        from localdiff.cli.convert import run_convert

        return run_convert(args)
    if cmd == "bench":
        try:
            from localdiff.bench.run import main as bench_main
        except ImportError as e:
            raise LocaldiffError(f"`localdiff bench` is not available in this build ({e})") from None
        return int(bench_main(args.bench_args) or 0)
    raise UsageError(f"unknown command {cmd!r}")  # pragma: no cover (argparse rejects it first)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``localdiff`` console script. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("LOCALDIFF_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        if sys.stdout is None:  # started with stdout closed (`>&-`): Python sets sys.stdout to None
            raise LocaldiffError("stdout is closed; redirect it to a file or to /dev/null (e.g. `>/dev/null`) "
                                 "instead of closing it")
        parser = build_parser()
        argv = _join_negative_values(argv, build_parser)
        if argv and argv[0] == "bench":  # bench parses its own flags (argparse REMAINDER rejects leading flags)
            _check_environment()
            try:
                from localdiff.bench.run import main as bench_main
            except ImportError as e:
                raise LocaldiffError(f"`localdiff bench` is not available in this build ({e})") from None
            return int(bench_main(argv[1:]) or 0)
        try:
            args, extra = parser.parse_known_args(argv)
        except SystemExit as e:  # --help / --version from argparse
            return int(e.code or 0)
        if extra:   # argparse would name the top-level parser; name the subcommand whose flags these are not
            prog = f"localdiff {args.command}" if getattr(args, "command", None) else "localdiff"
            raise UsageError(f"{prog}: unrecognized arguments: {' '.join(extra)} (see `{prog} --help`)")
        if args.version:
            from localdiff import __version__

            print(f"localdiff {__version__}")
            return 0
        if not args.command:
            parser.print_help(sys.stderr)
            return 2
        return int(_dispatch(args, argv) or 0)
    except KeyboardInterrupt:   # the same line as gen's Ctrl-C mid-generation (cli/gen.py): not an error
        _note("interrupted")
        return 130
    except BrokenPipeError:
        _quiet_broken_pipe()
        return 141
    except OSError as e:
        if e.errno not in _ENVIRONMENT_ERRNOS and e.errno != errno.ENAMETOOLONG:
            return _internal(e, debug)
        if debug:
            traceback.print_exc()
        _flush_or_silence_stdout()
        if e.errno == errno.ENAMETOOLONG:   # a model name, -f or -o of thousands of characters
            _err(name_too_long(e.filename))
            return 2
        _err(f"{e.strerror}" + (f": {e.filename}" if e.filename else ""))   # e.g. `>/dev/full`, a full disk
        return 1
    except LocaldiffError as e:
        if debug:
            traceback.print_exc()
        _err(str(e))
        return int(getattr(e, "exit_code", 1))
    except Exception as e:  # noqa: BLE001 — last resort: one line unless --debug
        return _internal(e, debug)


#: errno values that say the machine, not localdiff, failed: disk full, quota, I/O error, read-only file system
_ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)


def _internal(e: BaseException, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    _err(f"internal error: {type(e).__name__}: {e} (run with --debug for the traceback)")
    return 1


def _err(msg: str) -> None:
    from localdiff.safetext import visible

    line = visible(" ".join(str(msg).split())) or "unknown error"
    try:
        sys.stderr.write(f"error: {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _note(line: str) -> None:
    """One line on stderr without the ``error:`` prefix (Ctrl-C is the user's choice, not a failure)."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _flush_or_silence_stdout() -> None:
    """After an OSError: write what stdout still holds, or, when that fails too, silence it so that the
    interpreter's last flush does not print a second error."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        _quiet_broken_pipe()


def _quiet_broken_pipe() -> None:
    """After the reader of stdout went away: silence the final flush at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
