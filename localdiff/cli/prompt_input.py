"""The prompt of ``localdiff gen`` (and ``gen --endpoint``): piped stdin, ``-f FILE`` and ``-p`` / words, joined in that
order. Piped stdin (never a terminal) is read and placed before the prompt; with a terminal and no prompt it is a usage
error — never an interactive read. A reader that waits (a pipe nobody writes, a named pipe) is noted once on stderr;
input is bounded (:data:`MAX_PROMPT_BYTES`) and must be UTF-8."""

from __future__ import annotations

import sys

from localdiff.errors import UsageError
from localdiff.safetext import visible


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8").lstrip("\ufeff")
    except UnicodeDecodeError as e:
        raise UsageError(f"{where} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None


#: most bytes of prompt read from -f FILE or stdin (64 MiB: ~16M tokens, past every model's context; bounds a
#: device such as /dev/zero or an endless pipe, which read forever)
MAX_PROMPT_BYTES = 64 << 20


def read_stdin() -> str | None:
    """Piped stdin as text, or None when stdin is a terminal / closed (never blocks on a terminal).

    Raises:
        UsageError: the bytes are not UTF-8.
    """
    stream = sys.stdin
    if stream is None:
        return None
    try:
        if stream.isatty():
            return None
    except (AttributeError, ValueError, OSError):
        return None
    buf = getattr(stream, "buffer", None)
    try:
        data = _read_fd_noting_waits(stream)
        if data is None:
            data = buf.read() if buf is not None else stream.read().encode("utf-8", "surrogateescape")
    except (OSError, ValueError):
        return None
    return _decode(data, "stdin")


STDIN_NOTE_AFTER_S = 1.0


def _read_fd_noting_waits(stream) -> bytes | None:
    """Read a pipe / file stdin to EOF through its file descriptor; when no data has come for
    ``STDIN_NOTE_AFTER_S`` seconds, say once on stderr that the prompt is being read from stdin and how to skip it.
    Returns None when stdin has no usable descriptor (the caller then reads it plainly)."""
    import os
    import select

    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    if os.name == "nt":  # pragma: no cover — select() works on sockets only there
        return None
    chunks, noted, total = [], False, 0
    while True:
        ready, _, _ = select.select([fd], [], [], STDIN_NOTE_AFTER_S)
        if not ready:
            if not noted:
                sys.stderr.write(
                    "waiting for stdin to close: piped text goes before the prompt; to skip stdin, "
                    "run with </dev/null\n"
                )
                sys.stderr.flush()
                noted = True
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > MAX_PROMPT_BYTES:
            raise UsageError(_too_long("stdin"))


def _read_file(path: str) -> str:
    if path == "-":
        text = read_stdin()
        if text is None:
            raise UsageError("-f - given but stdin is a terminal")
        return text
    import os
    import stat
    import threading

    try:  # a named pipe (`mkfifo`, `-f <(cmd)`) waits for its writer: say so once, as for stdin
        waits = stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        waits = False
    note = threading.Timer(
        STDIN_NOTE_AFTER_S,
        lambda: sys.stderr.write(
            f"waiting for prompt file {visible(path)}: it is a pipe and nothing has written to it yet (Ctrl-C to stop)\n"
        ),
    )
    note.daemon = True
    if waits:
        note.start()
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PROMPT_BYTES + 1)
    except OSError as e:
        raise UsageError(f"cannot read prompt file {path}: {e.strerror or e}") from None
    finally:
        note.cancel()
    if len(data) > MAX_PROMPT_BYTES:
        raise UsageError(_too_long(f"prompt file {path}"))
    return _decode(data, f"prompt file {path}")


def _too_long(what: str) -> str:
    return f"{what} is over {MAX_PROMPT_BYTES >> 20} MiB, far past any model's context"


def assemble_prompt(args) -> str:
    """Join piped stdin, ``-f FILE`` and the prompt (``-p`` or words), in that order, with blank lines.

    Raises:
        UsageError: no prompt anywhere, both -p and words, an empty prompt, unreadable / non-UTF-8 input,
            ``--system`` with ``--raw`` (a raw prompt has no chat template to put it in; Ollama's ``raw`` requests
            drop the system text with the template silently — here it is refused, as ``gen --endpoint`` did);
            ``--raw-bytes`` with ``--json`` (it would change nothing).
    """
    if not getattr(args, "chat", True) and getattr(args, "system", None) is not None:
        raise UsageError("--system needs chat mode: drop --raw, or write the system text into the prompt")
    if getattr(args, "raw_bytes", False) and getattr(args, "json", False):
        raise UsageError(
            '--raw-bytes does nothing with --json: its "text" is the model\'s exact text, control '
            "characters escaped as JSON requires; drop one of them"
        )
    if args.prompt is not None and args.prompt_words:
        raise UsageError("give the prompt either with -p or as words, not both")
    cli_prompt = args.prompt if args.prompt is not None else (" ".join(args.prompt_words) or None)
    stdin = None if args.file == "-" else read_stdin()
    file_text = _read_file(args.file) if args.file else None
    if cli_prompt is None and args.file is None and not (stdin or "").strip():
        why = " (stdin was empty)" if stdin is not None else ""
        raise UsageError(f"no prompt{why}: give -p TEXT, PROMPT words or -f FILE, or pipe text on stdin")
    parts = [p.strip("\n") for p in (stdin, file_text, cli_prompt) if p is not None and p.strip()]
    text = "\n\n".join(parts)
    if not any(ch.isprintable() and not ch.isspace() for ch in text):
        raise UsageError("empty prompt" if not text.strip() else "prompt has no printable characters")
    return text
