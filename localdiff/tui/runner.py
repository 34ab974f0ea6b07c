"""The generation worker: runs ``Model.stream`` in a worker thread and hands the UI throttled updates.

Threading model: the worker thread owns the model and the KV cache while a generation runs; the UI thread only
receives Textual messages. Denoising steps go through a one-element ``FrameSlot`` (the newest frame wins, older ones
are dropped if the UI has not drawn them yet), so the UI is never more than one step behind and never flooded.
Canvas texts and the final result are posted as ordinary messages, so none is ever dropped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Callable

from textual.message import Message

from localdiff.events import CanvasDone, Done, StepEvent
from localdiff.tokenizer import PieceDecoder

#: Cell states of the canvas view.
LOCKED, NEW, NOISY, REOPENED, MASK = "locked", "new", "noisy", "reopened", "mask"
MASK_TEXT = "░"  # how a still-masked cell of a masked-diffusion model reads


@dataclass
class CanvasFrame:
    """What the canvas panel draws for one denoising step (batch row 0).

    Attributes:
        canvas_index: 0-based canvas within the answer.
        step / max_steps: 1-based denoising step and the cap for this canvas.
        tokens: display text per canvas position (length C); control characters made visible.
        states: per position, one of LOCKED (accepted at this and the previous step), NEW (accepted this step),
            NOISY (not accepted: holds fresh uniform noise), REOPENED (was accepted, renoised or reopened now),
            MASK (a masked-diffusion model's still-masked position).
        confidence: per position top-1 probability in [0, 1].
        final: True for a finished canvas (all positions final).
        forwards: decoder forwards of the whole answer so far (live status figure).
        answer_tokens: answer tokens so far: finished canvases (up to EOS) plus the positions accepted in this canvas.
        slots: slots family (ReFusion): this round in words, e.g. "slots 2,5 → infill" (see :func:`slots_note`);
            "" otherwise.
        drafted: a DFlash drafted block (the last token + the drafts; NEW = accepted, NOISY = rejected).
    """

    canvas_index: int
    step: int
    max_steps: int
    tokens: list[str]
    states: list[str]
    confidence: list[float]
    final: bool = False
    forwards: int = 0
    answer_tokens: int = 0
    slots: str = ""
    drafted: bool = False

    def count(self, state: str) -> int:
        """Number of positions in ``state``."""
        return sum(1 for s in self.states if s == state)


class TokenText:
    """Cached per-token display text: ``decode([id])`` (``localdiff.tokenizer.PieceDecoder``: leading spaces kept)
    with newlines/tabs/control characters made visible. EOS ids: ``eos_ids``, else the tokenizer's
    ``eos_token_ids`` (read at each new id, so a remote model's table can learn them mid-stream)."""

    def __init__(self, tokenizer, eos_ids: list[int] | None = None, max_chars: int = 8) -> None:
        self.tokenizer = tokenizer
        self.eos = set(eos_ids) if eos_ids else None
        self.max_chars = max_chars
        self._cache: dict[int, str] = {}
        self._piece = PieceDecoder(tokenizer)

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            eos = self.eos if self.eos is not None else (getattr(self.tokenizer, "eos_token_ids", None) or ())
            if token_id in eos:
                text = "∎"
            elif self.tokenizer is None:
                text = f"<{token_id}>"
            else:
                raw = self._piece(token_id)
                raw = raw.replace("\n", "↵").replace("\t", "→")
                text = "".join(ch if ch.isprintable() else "·" for ch in raw)[: self.max_chars] or "·"
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text


def slots_note(slots: dict | None) -> str:
    """A ReFusion round (``StepEvent.slots``) in words: the picked slots (1-based, index order) and how they were
    filled, then the committed ones when fewer: "slots 2,5 → verify: 2 committed"; "" for None."""
    if not slots:
        return ""
    picked = ",".join(str(s + 1) for s in slots["picked"])
    note = f"slots {picked} → {slots['how']}"
    if list(slots["committed"]) != list(slots["picked"]):
        note += ": " + (",".join(str(s + 1) for s in slots["committed"]) or "none") + " committed"
    return note


def frame_from_step(
    ev: StepEvent, token_text: TokenText, prev_accepted: list[bool] | None, mask_id: int | None = None
) -> CanvasFrame:
    """Build a CanvasFrame from a StepEvent (row 0); ``prev_accepted`` is the previous step's mask of this canvas;
    ``mask_id``: the model's mask token (masked family), whose not-accepted cells are MASK."""
    ids = ev.canvas_ids[0].tolist()
    acc = [bool(a) for a in ev.accepted[0].tolist()]
    reo = [bool(r) for r in ev.reopened[0].tolist()]
    prev = prev_accepted or [False] * len(ids)
    states = []
    for i, a, p, r in zip(ids, acc, prev, reo):
        if mask_id is not None and not a and i == mask_id:
            states.append(MASK)
        elif r or (p and not a):
            states.append(REOPENED)
        elif a:
            states.append(LOCKED if p else NEW)
        else:
            states.append(NOISY)
    conf = [float(c) for c in ev.confidence[0].tolist()]
    tokens = [MASK_TEXT if st == MASK else token_text(i) for i, st in zip(ids, states)]
    return CanvasFrame(
        ev.canvas_index,
        ev.step,
        ev.max_steps,
        tokens,
        states,
        conf,
        slots=slots_note(ev.slots),
        drafted=bool(ev.drafted),
    )


def frame_from_done(ev: CanvasDone, token_text: TokenText, last: CanvasFrame | None) -> CanvasFrame:
    """The finished canvas: every position final (LOCKED); confidence and step count from the last step seen."""
    ids = ev.token_ids[0].tolist()
    conf = last.confidence if last is not None and last.canvas_index == ev.canvas_index else [1.0] * len(ids)
    conf = list(conf[len(conf) - len(ids) :]) if len(conf) > len(ids) else conf  # a block shared with the prompt's
    # tail (block family): its steps cover the tail's positions too, the finished canvas only the answer's
    return CanvasFrame(
        ev.canvas_index,
        ev.steps,
        max(ev.steps, last.max_steps if last else ev.steps),
        [token_text(i) for i in ids],
        [LOCKED] * len(ids),
        list(conf),
        final=True,
    )


class FrameSlot:
    """Newest-wins mailbox between the worker (``put``) and the UI (``take``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._frame: CanvasFrame | None = None
        self._outstanding = False
        self.dropped = 0

    def put(self, frame: CanvasFrame) -> bool:
        """Store ``frame``; True when the UI must be notified (no notification is pending)."""
        with self._lock:
            if self._frame is not None:
                self.dropped += 1
            self._frame = frame
            notify = not self._outstanding
            self._outstanding = True
            return notify

    def take(self) -> CanvasFrame | None:
        """The newest frame (or None); clears the pending notification."""
        with self._lock:
            frame, self._frame, self._outstanding = self._frame, None, False
            return frame


class FrameReady(Message):
    """A new canvas frame waits in the app's FrameSlot."""


class CanvasText(Message):
    """A canvas is final: its text (appended to the answer) and its final frame (None for a remote model)."""

    def __init__(self, canvas_index: int, text: str, frame: CanvasFrame | None) -> None:
        super().__init__()
        self.canvas_index, self.text, self.frame = canvas_index, text, frame


class GenerationFinished(Message):
    """The generation ended: finished, cancelled (Esc) or failed (``error`` is a one-line message)."""

    def __init__(
        self, text: str, finish_reason: str, stats=None, error: str | None = None, steps_after_cancel: int = 0
    ) -> None:
        super().__init__()
        self.text, self.finish_reason, self.stats, self.error = text, finish_reason, stats, error
        self.steps_after_cancel = steps_after_cancel


def _tokens_to_eos(ids: list[int], eos: set[int]) -> int:
    """Tokens of a finished canvas that belong to the answer: up to and including the first EOS."""
    for i, t in enumerate(ids):
        if t in eos:
            return i + 1
    return len(ids)


@dataclass
class GenerationJob:
    """One answer to produce: chat messages (ending with the user's turn; only that turn for a single-turn model)
    and ``Model.stream`` kwargs."""

    messages: list[dict]
    kwargs: dict = field(default_factory=dict)


def run_generation(
    model,
    cache,
    job: GenerationJob,
    slot: FrameSlot,
    post: Callable[[Message], object],
    cancel: threading.Event,
    step_hook: Callable[[StepEvent], None] | None = None,
) -> None:
    """Consume ``model.stream`` in the calling thread, posting FrameReady / CanvasText / GenerationFinished.

    Cancellation: ``cancel`` is checked after every event; when set the loop stops pulling from the engine
    (at most one more denoising step runs) and closes the generator, and the answer keeps the canvases already
    final. ``step_hook`` (tests only) is called with each StepEvent in this thread after it is handed to the UI.
    """
    token_text = TokenText(getattr(model, "tokenizer", None))
    forwards = done_tokens = 0
    texts: list[str] = []
    prev_acc: list[bool] | None = None
    last: CanvasFrame | None = None
    after_cancel = 0
    result: GenerationFinished | None = None
    stream = None
    try:
        kwargs = model.applicable(job.kwargs) if hasattr(model, "applicable") else job.kwargs
        stream = model.stream(job.messages, chat=True, cache=cache, **kwargs)
        for ev in stream:
            if isinstance(ev, StepEvent):
                if cancel.is_set():  # the engine ran one more step after Esc: stop pulling
                    after_cancel += 1
                    break
                if last is None or last.canvas_index != ev.canvas_index:
                    prev_acc = None
                last = frame_from_step(ev, token_text, prev_acc, model.mask_token_id)
                prev_acc = [bool(a) for a in ev.accepted[0].tolist()]
                forwards += 1
                last.forwards, last.answer_tokens = forwards, done_tokens + sum(prev_acc)
                if slot.put(last):
                    post(FrameReady())
                if step_hook is not None:
                    step_hook(ev)
            elif isinstance(ev, CanvasDone):
                texts.append(ev.text)
                if ev.token_ids is None:  # a remote model: text only, no canvas
                    post(CanvasText(ev.canvas_index, ev.text, None))
                else:
                    eos = set(getattr(model, "eos_token_ids", None) or [])  # (a remote model learns them late)
                    done_tokens += _tokens_to_eos(ev.token_ids[0].tolist(), eos)
                    if last is not None and last.drafted and last.canvas_index == ev.canvas_index:
                        final = replace(last, final=True)  # keep the drafted block and what was accepted
                    else:
                        final = frame_from_done(ev, token_text, last)
                    final.forwards, final.answer_tokens = forwards, done_tokens
                    post(CanvasText(ev.canvas_index, ev.text, final))
            elif isinstance(ev, Done):
                text = ev.text if isinstance(ev.text, str) else ev.text[0]
                result = GenerationFinished(text, ev.finish_reason, ev.stats)
                break
            if cancel.is_set():
                break
        if result is None:
            reason = "cancelled" if cancel.is_set() else "eos"
            result = GenerationFinished("".join(texts), reason, None, steps_after_cancel=after_cancel)
    except Exception as exc:  # the UI shows it; never a traceback on screen
        from localdiff.errors import LocaldiffError

        msg = str(exc) if isinstance(exc, LocaldiffError) else f"{type(exc).__name__}: {exc}".rstrip(": ")
        result = GenerationFinished("".join(texts), "error", None, error=msg)
    finally:
        if stream is not None and hasattr(stream, "close"):
            stream.close()  # before the UI hears of the end, so the next turn never overlaps this one
    post(result)
