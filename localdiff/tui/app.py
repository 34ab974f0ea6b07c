"""``localdiff chat``: the Textual app. The model and its KV cache live in worker threads; the UI gets messages.

Layout (top to bottom): status line, transcript, live canvas panel (while generating), prompt box, footer.
One conversation = one chat message list + one engine cache (``Model.new_cache()`` once per conversation, passed to
every turn, so turn N's prefill reuses the prefix of turn N-1). Each finished turn is written to the ChatStore.
"""
from __future__ import annotations

import os
import threading
import time
from functools import partial
from typing import Callable

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.widgets import Footer

from localdiff.errors import LocaldiffError
from localdiff.tui.commands import ChatCommands, available_models
from localdiff.tui.runner import CanvasText, FrameReady, FrameSlot, GenerationFinished, GenerationJob, run_generation
from localdiff.tui.settings import ChatSettings, apply_set_checked
from localdiff.tui.store import ChatStore, HistoryError
from localdiff.tui.widgets import CanvasView, PromptArea, StatusLine, Transcript

HELP = (
    "Enter sends · ctrl+j / alt+enter newline · Esc stops the answer · ctrl+p commands · ctrl+t theme ·"
    " ctrl+o canvas panel · ctrl+n new chat · ctrl+q quit\n"
    "/set steps 8 · /set threshold 0.9 · /set entropy_bound 0.3 · /set seed 1 · /set max_tokens 128 · /set (list)\n"
    "/new (new chat) · /clear · /regen (regenerate last answer) · /help"
)


class ModelLoaded(Message):
    """The load worker finished: ``model`` is ready."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model


class ModelFailed(Message):
    """The load worker failed with a one-line ``error``."""

    def __init__(self, name: str, error: str) -> None:
        super().__init__()
        self.name, self.error = name, error


_SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _default_loader(name: str, device: str | None = None, quant: str | None = None):
    import localdiff

    return localdiff.load(name, device=device, quant=quant)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, LocaldiffError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class ChatApp(App):
    """The chat TUI.

    Args:
        model_name: model to load (catalog alias, "org/repo" or a checkpoint path); "tiny" by default.
        store: the conversation history.
        conversation_id: resume this saved conversation (its turns are shown and become the context).
        device / quant: passed to the loader.
        settings: initial generation settings (``/set`` changes them).
        loader: ``loader(name, device=, quant=) -> Model`` (default ``localdiff.load``; tests pass a preloaded one).

    After ``run()``, ``return_code`` is 1 when the last model load failed (the error is shown in the UI), else 0.
    """

    CSS_PATH = "app.tcss"
    TITLE = "localdiff chat"
    COMMANDS = App.COMMANDS | {ChatCommands}
    BINDINGS = [
        Binding("escape", "cancel", "Stop"),
        Binding("ctrl+t", "toggle_theme", "Theme"),
        Binding("ctrl+n", "new_chat", "New chat", show=False),
        Binding("ctrl+o", "toggle_canvas", "Canvas", show=False),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, model_name: str = "tiny", *, store: ChatStore, conversation_id: int | None = None,
                 device: str | None = None, quant: str | None = None, settings: ChatSettings | None = None,
                 loader: Callable | None = None, frame_interval: float = 0.05) -> None:
        super().__init__()
        self.model_name = model_name
        self.store = store
        self.conversation_id = conversation_id
        self.device, self.quant = device, quant
        self.settings = settings or ChatSettings()
        self.loader = loader or _default_loader
        self.frame_interval = frame_interval  # at most 1/frame_interval canvas redraws per second
        self.model = None
        self.cache = None
        self.load_error: str | None = None
        self.messages: list[dict] = []
        self.turn_ids: list[int] = []
        self.generating = False
        self.cancel_event = threading.Event()
        self.slot = FrameSlot()
        self.step_hook = None  # tests: called with each StepEvent in the worker thread
        self.last_stats = None
        self.last_finish: GenerationFinished | None = None
        self.finished_count = 0  # generations ended so far (finished, cancelled or failed)
        self.pin_canvas = True  # keep the last canvas on screen after the answer (ctrl+o / palette hides it)
        self._answer = None
        self._final_canvas = -1
        self._last_draw = 0.0
        self._draw_pending = False

    # ---------------------------------------------------------------- layout and start-up
    def compose(self) -> ComposeResult:
        yield StatusLine(id="status")
        yield Transcript(id="transcript")
        yield CanvasView(id="canvas", classes="-hidden")
        yield PromptArea(id="prompt")
        yield Footer()

    async def on_mount(self) -> None:
        self.status = self.query_one(StatusLine)
        self.transcript = self.query_one(Transcript)
        self.canvas = self.query_one(CanvasView)
        self.prompt = self.query_one(PromptArea)
        self.prompt.focus()
        if self.conversation_id is not None:
            conv = self.store.load(self.conversation_id)
            for turn in conv.turns:
                await self.transcript.add_message(turn.role, turn.content)
                self.messages.append({"role": turn.role, "content": turn.content})
                self.turn_ids.append(turn.id)
            await self.transcript.add_note(f"resumed conversation #{conv.id} ({len(conv.turns)} turns)")
            if self.messages and self.messages[-1]["role"] == "user":
                await self.transcript.add_note("the last message has no saved answer — /regen generates one")
        self._load(self.model_name)

    def _load(self, name: str) -> None:
        self._loading_name = name
        self.status.set_state(f"loading {name}…")
        self.run_worker(partial(self._load_in_thread, name), thread=True, group="load", exit_on_error=False)

    def _load_in_thread(self, name: str) -> None:
        try:
            model = self.loader(name, device=self.device, quant=self.quant)
        except Exception as exc:  # shown in the UI; never an endless spinner
            self.post_message(ModelFailed(name, _describe(exc)))
            return
        self.post_message(ModelLoaded(model))

    async def on_model_loaded(self, event: ModelLoaded) -> None:
        m = event.model
        self.model, self.load_error = m, None
        self.model_name = getattr(m, "name", None) or self._loading_name
        self.cache = m.new_cache()
        dtype = str(getattr(m, "dtype", "")).replace("torch.", "")
        quant = getattr(m, "quant", None) or _SHORT_DTYPES.get(dtype, dtype) or "—"
        label = str(self.model_name)
        if os.path.isdir(label):  # a checkpoint folder: its name is enough on an 80-column line
            label = os.path.basename(os.path.normpath(label))
        self.status.set_model(label, str(getattr(m, "device", "cpu")), str(quant))
        self.status.set_state("ready")

    async def on_model_failed(self, event: ModelFailed) -> None:
        self.load_error = event.error
        self.status.set_state(f"{event.name} failed to load", error=True)
        await self.transcript.add_note(f"could not load {event.name}: {event.error}", error=True)
        await self.transcript.add_note("ctrl+p → Switch model, or ctrl+q to quit (exit code 1)")

    def model_choices(self) -> list[str]:
        """Models offered by "Switch model" (the embedded tiny plus pulled ones)."""
        return available_models()

    # ---------------------------------------------------------------- sending
    async def on_prompt_area_submitted(self, event: PromptArea.Submitted) -> None:
        text = event.text
        if text.startswith("/"):
            await self._slash(text)
            return
        if self.generating:
            await self.transcript.add_note("still answering — press Esc to stop it first")
            event.prompt.text = text
            return
        if self.model is None:
            why = self.load_error or f"{self.model_name} is still loading"
            await self.transcript.add_note(f"no model: {why}", error=self.load_error is not None)
            event.prompt.text = text
            return
        try:
            if self.conversation_id is None:
                self.conversation_id = self.store.new_conversation(str(self.model_name))
            if self.messages and self.messages[-1]["role"] == "user":  # its answer was lost (crash): leave it out
                self.messages.pop()
                self.store.delete_turn(self.turn_ids.pop())
            self.turn_ids.append(self.store.add_turn(self.conversation_id, "user", text, model=str(self.model_name)))
        except HistoryError as exc:
            await self.transcript.add_note(f"not sent: {exc}", error=True)
            event.prompt.text = text
            return
        self.messages.append({"role": "user", "content": text})
        await self.transcript.add_message("user", text)
        await self._start_generation()

    async def _start_generation(self) -> None:
        self.generating = True
        self.cancel_event.clear()
        self.slot.take()
        self._final_canvas = -1
        self.canvas.reset()
        self.canvas.remove_class("-hidden")
        self.status.set_state("generating")
        self._answer = await self.transcript.add_message("assistant", "")
        job = GenerationJob(list(self.messages), self.settings.stream_kwargs())
        work = partial(run_generation, self.model, self.cache, job, self.slot, self.post_message,
                       self.cancel_event, self.step_hook)
        self.run_worker(work, thread=True, group="generate", exit_on_error=False)

    # ---------------------------------------------------------------- worker messages
    def on_frame_ready(self, _: FrameReady) -> None:
        if self._draw_pending:
            return
        wait = self.frame_interval - (time.monotonic() - self._last_draw)
        if wait > 0:
            self._draw_pending = True
            self.set_timer(wait, self._draw_latest)
        else:
            self._draw_latest()

    def _draw_latest(self) -> None:
        self._draw_pending = False
        frame = self.slot.take()
        if frame is not None and frame.canvas_index > self._final_canvas:
            self.canvas.show(frame)
            self._last_draw = time.monotonic()

    async def on_canvas_text(self, event: CanvasText) -> None:
        self._final_canvas = max(self._final_canvas, event.canvas_index)
        if event.frame is not None:
            self.canvas.show(event.frame)
        if self._answer is not None:
            await self._answer.append_text(event.text)

    async def on_generation_finished(self, event: GenerationFinished) -> None:
        self.last_finish = event
        try:
            await self._finish_turn(event)
        finally:
            self.generating = False  # last: the turn is on screen and on disk
            self.finished_count += 1

    async def _finish_turn(self, event: GenerationFinished) -> None:
        answer, self._answer = self._answer, None
        self._draw_latest()  # a frame still waiting for its redraw slot is shown now, never after the end
        if event.text or event.finish_reason in ("eos", "length"):  # a finished answer is kept even if empty
            await answer.set_text(event.text)
            self.messages.append({"role": "assistant", "content": event.text})
            stats = event.stats.as_dict() if event.stats is not None else {}
            try:
                self.turn_ids.append(self.store.add_turn(self.conversation_id, "assistant", event.text,
                                                         model=str(self.model_name),
                                                         finish_reason=event.finish_reason, stats=stats))
            except HistoryError as exc:  # the chat goes on; this answer is just not in the history
                self.turn_ids.append(None)
                await self.transcript.add_note(f"answer not saved: {exc}", error=True)
        else:  # nothing final: the question stays on screen but leaves the context (roles must alternate)
            await answer.remove()
            self.messages.pop()
            self.store.delete_turn(self.turn_ids.pop())
        if event.error:
            await self.transcript.add_note(f"generation failed: {event.error}", error=True)
        elif event.finish_reason == "cancelled":
            self.canvas.mark_stopped()
            kept = "kept the finished canvases" if event.text else "nothing was final; the message was not kept"
            await self.transcript.add_note(f"stopped — {kept}")
        if event.stats is not None:
            self.last_stats = event.stats
            self.status.show_stats(event.stats)
        self.status.set_state("ready" if not event.error else "error", error=bool(event.error))
        self.canvas.set_class(not self.pin_canvas, "-hidden")

    # ---------------------------------------------------------------- slash commands
    async def _slash(self, text: str) -> None:
        cmd, _, args = text[1:].partition(" ")
        cmd = cmd.lower()
        if cmd == "set":
            try:
                await self.transcript.add_note(apply_set_checked(self.settings, args, self.model))
            except LocaldiffError as exc:
                await self.transcript.add_note(str(exc), error=True)
        elif cmd == "help":
            await self.transcript.add_note(HELP)
        elif cmd == "new":
            await self.action_new_chat()
        elif cmd == "clear":
            await self.action_clear_chat()
        elif cmd in ("regen", "regenerate"):
            await self.action_regenerate()
        else:
            await self.transcript.add_note(f"unknown command /{cmd} — /help lists them", error=True)

    # ---------------------------------------------------------------- actions
    def action_cancel(self) -> None:
        """Esc: stop the answer in flight within one denoising step; finished canvases are kept."""
        if self.generating and not self.cancel_event.is_set():
            self.cancel_event.set()
            self.status.set_state("stopping…")

    async def _idle_or_note(self) -> bool:
        if self.generating:
            await self.transcript.add_note("still answering — press Esc to stop it first")
            return False
        return True

    async def action_new_chat(self) -> None:
        """Start a new conversation with a fresh engine cache; the current one stays saved."""
        if not await self._idle_or_note():
            return
        await self._reset_conversation()
        await self.transcript.add_note("new chat")

    async def action_clear_chat(self) -> None:
        """Delete the current conversation's turns (screen, context, history) and start it over."""
        if not await self._idle_or_note():
            return
        if self.conversation_id is not None:
            self.store.clear_turns(self.conversation_id)
        keep = self.conversation_id
        await self._reset_conversation()
        self.conversation_id = keep
        await self.transcript.add_note("conversation cleared")

    async def _reset_conversation(self) -> None:
        await self.transcript.clear_all()
        self.messages, self.turn_ids, self.conversation_id = [], [], None
        self.cache = self.model.new_cache() if self.model is not None else None
        self.canvas.reset()
        self.status.show_stats(None)

    async def action_regenerate(self) -> None:
        """Drop the last answer (screen, context, history) and generate it again from the same messages; after a
        resume whose last answer was lost, just generate it."""
        if not await self._idle_or_note():
            return
        if self.model is None or not self.messages:
            await self.transcript.add_note("no answer to regenerate")
            return
        if self.messages[-1]["role"] == "assistant":
            self.messages.pop()
            self.store.delete_turn(self.turn_ids.pop())
            await self.transcript.messages[-1].remove()
        await self._start_generation()

    def action_toggle_theme(self) -> None:
        """ctrl+t: switch between the dark and the light theme."""
        self.theme = "textual-light" if self.current_theme.dark else "textual-dark"

    def action_toggle_canvas(self) -> None:
        """ctrl+o: keep the canvas panel visible when idle, or hide it when idle (it always shows while answering)."""
        self.pin_canvas = not self.pin_canvas
        self.canvas.set_class(not (self.pin_canvas or self.generating), "-hidden")

    async def switch_model(self, name: str) -> None:
        """Load ``name`` in a worker; on success the conversation continues on it with a fresh cache."""
        if not await self._idle_or_note():
            return
        await self.transcript.add_note(f"loading {name}…")
        self._load(name)

    async def action_quit(self) -> None:
        """Quit; the exit code is 1 when the last model load failed."""
        self.cancel_event.set()
        self.exit(return_code=1 if self.load_error else 0)

    def on_unmount(self) -> None:
        self.cancel_event.set()
