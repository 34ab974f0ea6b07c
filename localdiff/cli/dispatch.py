"""``localdiff`` command line: dispatch of the parsed arguments (the parser: :mod:`localdiff.cli.parser`) and the
errors' one-line reports.

Subcommands: gen, chat, serve, pull, list, rm, show, config, bench, quantize, convert. Heavy imports (torch, textual,
the engine) happen inside the command that needs them, so ``localdiff list`` / ``pull`` start fast and ``textual`` is
imported only for ``chat``.

Exit codes: 0 ok; 1 runtime error; 2 usage error; 130 interrupted (Ctrl-C: the line ``interrupted``, at load
as during a generation; ``serve`` stopped by Ctrl-C or SIGTERM after draining exits 0). Errors are one line on stderr
(``error: ...``); ``--debug`` (or ``LOCALDIFF_DEBUG=1``) prints the traceback too.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback

from localdiff.errors import LocaldiffError, UsageError
from localdiff.cli.argv import join_negative_values as _join_negative_values, name_too_long
from localdiff.cli.parser import build_parser


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
    if cmd == "show":
        from localdiff.cli.show import run_show

        return run_show(args)
    if cmd in ("pull", "list", "ls", "rm", "config", "quantize"):
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
            raise LocaldiffError(
                "stdout is closed; redirect it to a file or to /dev/null (e.g. `>/dev/null`) instead of closing it"
            )
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
        if extra:  # argparse would name the top-level parser; name the subcommand whose flags these are not
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
    except KeyboardInterrupt:  # the same line as gen's Ctrl-C mid-generation (cli/gen.py): not an error
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
        if e.errno == errno.ENAMETOOLONG:  # a model name, -f or -o of thousands of characters
            _err(name_too_long(e.filename))
            return 2
        _err(f"{e.strerror}" + (f": {e.filename}" if e.filename else ""))  # e.g. `>/dev/full`, a full disk
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
