"""``localdiff chat``: a Textual chat that shows the canvas denoising live.

``run_chat`` is the entry point the CLI calls. Textual is imported only when the TUI actually starts, so
``--list`` and the not-a-terminal refusal stay cheap.
"""

from __future__ import annotations

import sys

from localdiff.errors import LocaldiffError

DEFAULT_MODEL = "tiny"


def run_chat(
    model: str | None = None,
    *,
    resume: str | bool | None = None,
    list_only: bool = False,
    device: str | None = None,
    quant: str | None = None,
    sampler_options: dict | None = None,
    db_path: str | None = None,
    loader=None,
    default_model: str | None = None,
    config_file: str | None = None,
    theme: str | None = None,
) -> int:
    """Run ``localdiff chat`` and return its exit code.

    Args:
        model: model to load (an explicit choice, e.g. ``-m``); None: the resumed conversation's model, else
            ``default_model``.
        default_model: the model when neither ``model`` nor a resumed conversation names one (the config file's /
            ``LOCALDIFF_MODEL``; default the embedded "tiny").
        resume: True or "" → the latest saved conversation; "7" → conversation 7; None/False → a new one.
        list_only: print the saved conversations (id, updated, turns, model, title) to stdout and return 0.
        device / quant: passed to ``localdiff.load``.
        sampler_options: initial sampler overrides; ``max_new_tokens`` and ``seed`` keys are taken out of it.
        db_path: history database file (default ``$LOCALDIFF_DATA_DIR/chat.sqlite3`` or the platformdirs data dir).
        loader: ``loader(name, device=, quant=)`` returning the model (default ``localdiff.load``; ``chat
            --endpoint`` passes one that connects to a server).
        config_file: where ``/set`` values and the theme are saved (the CLI passes the config file it read); None
            saves nothing.
        theme: the theme to start with (the config file's ``theme``).

    The first model is loaded before the terminal UI starts (as ``ollama run`` and ``llama-cli`` do): a model that
    cannot be resolved or loaded is one line on stderr naming it, and the UI never opens. Models switched to later
    load inside the UI, which reports a failure there and keeps the loaded model.

    Returns:
        0 on a normal quit; 1 when the model cannot be loaded, the history cannot be opened, or the last model
        switched to in the UI failed to load; 2 when stdout is not a terminal or ``resume`` names no saved
        conversation. Errors are one line on stderr.
    """
    from localdiff.tui.settings import ChatSettings
    from localdiff.tui.store import ChatStore, format_listing

    try:
        store = ChatStore(db_path)
        if list_only:
            print(format_listing(store.list_conversations()))
            return 0
        if not (sys.stdout.isatty() and sys.stdin.isatty()):
            print(
                "localdiff chat needs an interactive terminal; for pipelines use `localdiff gen -p PROMPT`",
                file=sys.stderr,
            )
            return 2
        try:
            conversation_id = store.resolve(resume)
        except LocaldiffError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    except LocaldiffError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    whose = ""  # the model came from the resumed conversation: the error says how to resume on another
    if model is None:
        saved = store.load(conversation_id).model if conversation_id is not None else ""
        whose = f" (conversation #{conversation_id}'s model; -m MODEL resumes it on another)" if saved else ""
        model = saved or default_model or DEFAULT_MODEL
    opts = dict(sampler_options or {})
    settings = ChatSettings(sampler={k: v for k, v in opts.items() if k not in ("max_new_tokens", "seed")})
    if "max_new_tokens" in opts:
        settings.max_new_tokens = int(opts["max_new_tokens"])
    if "seed" in opts:
        settings.seed = opts["seed"]

    from localdiff.tui.app import ChatApp, _default_loader, _describe
    from localdiff.tui.decode import install_lenient_decoder
    from localdiff.tui.paste import install_paste_guard

    load = loader or _default_loader
    try:
        first = _load_first(load, model, device, quant)
    except Exception as exc:  # noqa: BLE001 — any load failure is one line before the UI, never a traceback
        from localdiff.safetext import visible

        what = (f"'{model}'" if model else "the server's first model") + whose
        print(visible(" ".join(f"error: cannot load {what}: {_describe(exc)}".split())), file=sys.stderr)
        return exc.exit_code if isinstance(exc, LocaldiffError) else 1
    preloaded = [first]

    def first_then_load(name, device=None, quant=None):  # the UI's first load gets the preloaded model
        if preloaded and name == model:
            return preloaded.pop()
        return load(name, device=device, quant=quant)

    install_paste_guard()  # escape sequences inside a bracketed paste become text, never keys
    install_lenient_decoder()  # a keyboard byte that is not UTF-8 becomes "�", never a crash
    app = ChatApp(
        model,
        store=store,
        conversation_id=conversation_id,
        device=device,
        quant=quant,
        settings=settings,
        loader=first_then_load,
        config_file=config_file,
        theme=theme,
    )
    app.run()
    return int(app.return_code or 0)


def _load_first(load, name: str, device, quant):
    """Load the chat's first model before the UI takes the terminal, saying so on stderr (a big model takes a
    while; Ctrl-C interrupts). Raises whatever the loader raises."""
    try:
        note = sys.stderr.isatty()
    except (AttributeError, ValueError):
        note = False
    if note:  # on a terminal only: a log file gets the error line alone
        from localdiff.safetext import visible

        note = visible(f"loading {name or 'the server’s first model'}…")
        sys.stderr.write(note + "\r")
        sys.stderr.flush()
    try:
        return load(name, device=device, quant=quant)
    finally:
        if note:  # blanked with spaces (no escape sequence: TERM=dumb too); the UI or the error line follows
            sys.stderr.write(" " * len(note) + "\r")
            sys.stderr.flush()


__all__ = ["run_chat", "DEFAULT_MODEL"]
