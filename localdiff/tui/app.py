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
from localdiff.tui.settings import ChatSettings
from localdiff.tui.actions import ActionsMixin
from localdiff.tui.slash import SlashMixin, format_stats
from localdiff.tui.store import ChatStore, HistoryError
from localdiff.tui.widgets import CanvasView, PromptArea, StatusLine, Transcript


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


def _default_loader(name: str, device: str | None = None, quant: str | None = None, **load_kw):
    """``localdiff.load``; ``load_kw``: its other arguments (the CLI's draft, gpu_mem, threads)."""
    import localdiff

    return localdiff.load(name, device=device, quant=quant, **load_kw)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, LocaldiffError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _model_card(model) -> dict:
    try:
        from localdiff.engine import model_card

        return model_card(model)
    except Exception:  # a model object from elsewhere (tests) or a broken catalog: nothing to say
        return {}


class ChatApp(ActionsMixin, SlashMixin, App):
    """The chat TUI.

    Args:
        model_name: model to load (catalog alias, "org/repo" or a checkpoint path); "tiny" by default.
        store: the conversation history.
        conversation_id: resume this saved conversation (its turns are shown and become the context).
        device / quant: passed to the loader.
        settings: initial generation settings (``/set`` changes them).
        loader: ``loader(name, device=, quant=) -> Model`` (default ``localdiff.load``; tests pass a preloaded one).
        config_file: the user config file that ``/set`` values and the theme are written to (None: not saved).
        theme: the theme to start with (from the config file), or None for Textual's default.

    After ``run()``, ``return_code`` is 1 when the last model load failed (the error is shown in the UI), else 0.
    """

    CSS_PATH = "app.tcss"
    TITLE = "localdiff chat"
    COMMANDS = App.COMMANDS | {ChatCommands}
    BINDINGS = [
        Binding("escape", "cancel", "Stop", show=False),
        Binding("ctrl+c", "interrupt", "Stop/Quit", priority=True),
        Binding("f2", "copy_last", "Copy answer"),
        Binding("ctrl+t", "toggle_theme", "Theme"),
        Binding("ctrl+n", "new_chat", "New chat", show=False),
        Binding("ctrl+o", "toggle_canvas", "Canvas", show=False),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    #: Screen classes by terminal height: the canvas panel and the footer give way first, the prompt stays visible.
    VERTICAL_BREAKPOINTS = [(0, "-tiny"), (16, "-short"), (24, "-tall")]

    def __init__(
        self,
        model_name: str = "tiny",
        *,
        store: ChatStore,
        conversation_id: int | None = None,
        device: str | None = None,
        quant: str | None = None,
        settings: ChatSettings | None = None,
        loader: Callable | None = None,
        frame_interval: float = 0.05,
        config_file=None,
        theme: str | None = None,
    ) -> None:
        super().__init__()
        self.config_file = config_file
        self._start_theme = theme
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
        self.card: dict = {}  # the loaded model's catalog card (engine.model_card)
        self.verbose = False  # /verbose: figures after every answer
        self._clear_pending = False  # /clear asked for confirmation
        self._stop_requested_at = 0.0  # ctrl+c stopped an answer at this time (a second ctrl+c quits)
        self._gen_started = 0.0
        self._user_bubble = None  # the user's message of the answer in flight (removed if nothing was final)

    # ---------------------------------------------------------------- layout and start-up
    def compose(self) -> ComposeResult:
        yield StatusLine(id="status")
        yield Transcript(id="transcript")
        yield CanvasView(id="canvas", classes="-hidden -idle")
        yield PromptArea(id="prompt")
        yield Footer()

    async def on_mount(self) -> None:
        self.status = self.query_one(StatusLine)
        self.transcript = self.query_one(Transcript)
        self.canvas = self.query_one(CanvasView)
        self.prompt = self.query_one(PromptArea)
        self.prompt.focus()
        self.prompt.completer = self.complete_prompt
        try:
            self.prompt.prompt_history = self.store.recent_prompts()
        except HistoryError:
            pass
        if self._start_theme and self._start_theme in self.available_themes:
            self.theme = self._start_theme
        self.theme_changed_signal.subscribe(self, self._on_theme_changed)
        self.set_interval(0.25, self._tick_live)
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
        self.card = _model_card(m)
        await self.transcript.add_note(self.welcome_text())

    async def on_model_failed(self, event: ModelFailed) -> None:
        await self.transcript.add_note(f"could not load {event.name}: {event.error}", error=True)
        if self.model is not None:  # a /model switch failed: the loaded model still answers (and quitting is 0)
            self.status.set_state("ready")
            await self.transcript.add_note(f"still on {self.model_name}; ctrl+p → Switch model to try another")
            return
        self.load_error = event.error
        self.status.set_state(f"{event.name} failed to load", error=True)
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
        self._clear_pending = False
        if self.generating:
            await self.transcript.add_note("still answering — press Esc or ctrl+c to stop it first")
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
        self._user_bubble = await self.transcript.add_message("user", text)
        await self._start_generation()

    async def _start_generation(self) -> None:
        self.generating = True
        self.cancel_event.clear()
        self.slot.take()
        self._final_canvas = -1
        self.canvas.reset()
        self.canvas.remove_class("-hidden", "-idle")
        self.status.set_state("generating")
        self._gen_started = time.monotonic()
        self.status.show_live(0.0, 0, 0)
        self._answer = await self.transcript.add_message("assistant", "")
        # A single-turn model (catalog) gets each message on its own: earlier turns would make it answer nothing.
        context = self.messages[-1:] if self.card.get("single_turn") else list(self.messages)
        job = GenerationJob(context, self.settings.stream_kwargs())
        work = partial(
            run_generation, self.model, self.cache, job, self.slot, self.post_message, self.cancel_event, self.step_hook
        )
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
            self._show_live(frame)

    def _show_live(self, frame) -> None:
        if self.generating:
            self.status.show_live(time.monotonic() - self._gen_started, frame.answer_tokens, frame.forwards)

    def _tick_live(self) -> None:
        """Every 0.25 s while answering: the elapsed time moves on even between frames."""
        if self.generating and self.status.live is not None:
            _, tokens, forwards = self.status.live
            self.status.show_live(time.monotonic() - self._gen_started, tokens, forwards)

    async def on_canvas_text(self, event: CanvasText) -> None:
        self._final_canvas = max(self._final_canvas, event.canvas_index)
        if event.frame is not None:  # (a remote model sends text only)
            self.canvas.show(event.frame)
            self._show_live(event.frame)
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
                self.turn_ids.append(
                    self.store.add_turn(
                        self.conversation_id,
                        "assistant",
                        event.text,
                        model=str(self.model_name),
                        finish_reason=event.finish_reason,
                        stats=stats,
                    )
                )
            except HistoryError as exc:  # the chat goes on; this answer is just not in the history
                self.turn_ids.append(None)
                await self.transcript.add_note(f"answer not saved: {exc}", error=True)
        else:  # nothing final: the question leaves the context (roles must alternate) and the screen
            await answer.remove()
            dropped = self.messages.pop()["content"]
            self.store.delete_turn(self.turn_ids.pop())
            bubble = self._user_bubble or next(reversed(self.transcript.messages), None)
            if bubble is not None and bubble.role == "user":
                await bubble.remove()
            if not self.prompt.text:  # give the text back to edit or resend (↑ recalls it too)
                self.prompt.load_text(dropped)
                self.prompt.move_cursor(self.prompt.document.end)
        self._user_bubble = None
        self.status.clear_live()
        if event.error:
            await self.transcript.add_note(f"generation failed: {event.error}", error=True)
        elif event.finish_reason == "cancelled":
            self.canvas.mark_stopped()
            kept = (
                "kept the finished canvases"
                if event.text
                else "nothing was final; the message is back in the prompt box"
            )
            await self.transcript.add_note(f"stopped — {kept}")
        if event.stats is not None:
            self.last_stats = event.stats
            self.status.show_stats(event.stats)
            if self.verbose:
                await self.transcript.add_note(format_stats(event.stats))
        self.status.set_state("ready" if not event.error else "error", error=bool(event.error))
        self.canvas.set_class(not self.pin_canvas, "-hidden")
        self.canvas.add_class("-idle")  # on a very short screen an idle canvas gives its rows to the transcript

    # ---------------------------------------------------------------- actions
    def action_cancel(self) -> None:
        """Esc: stop the answer in flight within one denoising step; finished canvases are kept."""
        if self.generating and not self.cancel_event.is_set():
            self.cancel_event.set()
            self.status.set_state("stopping…")

    async def switch_model(self, name: str) -> None:
        """Load ``name`` in a worker; on success the conversation continues on it with a fresh cache."""
        if not await self._idle_or_note():
            return
        await self.transcript.add_note(f"loading {name}…")
        self._load(name)

    async def action_quit(self) -> None:
        """Quit (ctrl+q, ctrl+c when idle, ctrl+d on an empty prompt, /bye /exit /quit); the exit code is 1 when the
        last model load failed."""
        self.cancel_event.set()
        self.exit(return_code=1 if self.load_error else 0)

    def on_unmount(self) -> None:
        self.cancel_event.set()
