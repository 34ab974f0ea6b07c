"""localdiff's canvas events on the wire: the opt-in ``localdiff`` extension of ``localdiff serve``'s streams.

A client that asks for them (``{"localdiff": {"events": "steps"}}`` in an OpenAI request, the same top-level key in
an Ollama one) gets, besides the text, JSON objects under the ``localdiff`` key of stream chunks whose answer part
is empty (OpenAI: ``delta: {}`` / ``text: ""``; Ollama: ``content: ""``), so clients that do not know the key
ignore them:

- ``{"event": "begin", "family", "canvas_length", "eos_token_ids", "mask_token_id"}`` once, first;
- ``{"event": "step", "canvas", "step", "max_steps", "canvas_ids", "argmax_ids", "accepted", "renoised",
  "reopened", "locked", "confidence", "entropy", "pieces"}`` per denoising step (``events: "steps"`` only): the
  fields of :class:`localdiff.events.StepEvent`;
- ``{"event": "canvas", "canvas", "steps", "token_ids", "finished", "pieces"}`` per finished canvas (the fields of
  :class:`localdiff.events.CanvasDone`; its text comes as ordinary answer text).

Batch row 0 only (the server runs one prompt per request). Ids are lists of ints; boolean masks are strings of
"0"/"1", one character per canvas position (``locked`` is null when locking is off); confidence and entropy are
the float32 values written exactly (the JSON number of each value), so :func:`step_event` rebuilds the server's
``StepEvent`` bit for bit. ``pieces`` maps the ids of ``canvas_ids`` / ``token_ids`` seen for the first time in
this stream (as strings) to their text on its own (``localdiff.tokenizer.PieceDecoder``). Pieces are model text:
a client makes control characters visible before showing them (the chat does, ``localdiff.tui.runner.TokenText``).
"""

from __future__ import annotations

from localdiff.events import CanvasDone, StepEvent
from localdiff.tokenizer import PieceDecoder

EVENT_LEVELS = ("none", "canvases", "steps")  # what a request may ask for under localdiff.events
_MASKS = ("accepted", "renoised", "reopened", "locked")


def _bits(mask) -> str | None:
    """BoolTensor[B, C] (row 0) → "0101…"; None stays None."""
    if mask is None:
        return None
    return "".join("1" if b else "0" for b in mask[0].tolist())


class EventEncoder:
    """Turns one generation's events into wire dicts (server side, in the model thread).

    Args:
        model: the :class:`localdiff.engine.Model` running the generation (tokenizer, family, special ids).
    """

    def __init__(self, model) -> None:
        self.model = model
        tok = model.tokenizer
        self._piece = PieceDecoder(tok) if tok is not None else None
        self._seen: set[int] = set()

    def begin(self) -> dict:
        """The first event: what a client needs to draw the canvas."""
        m = self.model
        return {
            "event": "begin",
            "family": m.family,
            "canvas_length": getattr(m.config, "canvas_length", None),  # (the canvas family's config)
            "eos_token_ids": list(m.eos_token_ids),
            "mask_token_id": m.mask_token_id,
        }

    def _pieces(self, ids: list[int]) -> dict:
        out = {}
        for i in ids:
            if i not in self._seen:
                self._seen.add(i)
                out[str(i)] = self._piece(i) if self._piece is not None else ""
        return out

    def step(self, ev: StepEvent) -> dict:
        """A ``step`` event from a StepEvent (row 0)."""
        ids = ev.canvas_ids[0].tolist()
        out = {
            "event": "step",
            "canvas": ev.canvas_index,
            "step": ev.step,
            "max_steps": ev.max_steps,
            "canvas_ids": ids,
            "argmax_ids": ev.argmax_ids[0].tolist(),
        }
        for name in _MASKS:
            out[name] = _bits(getattr(ev, name))
        out["confidence"] = ev.confidence[0].float().tolist()
        out["entropy"] = ev.entropy[0].float().tolist()
        out["pieces"] = self._pieces(ids)
        return out

    def canvas(self, ev: CanvasDone) -> dict:
        """A ``canvas`` event from a CanvasDone (row 0; the text goes separately)."""
        ids = ev.token_ids[0].tolist()
        return {
            "event": "canvas",
            "canvas": ev.canvas_index,
            "steps": ev.steps,
            "token_ids": ids,
            "finished": bool(ev.finished[0]),
            "pieces": self._pieces(ids),
        }


class PieceTable:
    """A client's stand-in tokenizer for a remote model: the pieces the server sent, by id.

    ``decode(ids)`` joins known pieces ("" for unknown ids); ``encode`` gives [] (no anchor is needed: the server
    already decoded each piece on its own). ``eos_token_ids`` is filled from the ``begin`` event.
    """

    def __init__(self) -> None:
        self.pieces: dict[int, str] = {}
        self.eos_token_ids: list[int] = []

    def update(self, pieces) -> None:
        """Add ``{"id": "text"}`` from an event. Raises ValueError for a malformed table."""
        if not isinstance(pieces, dict):
            raise ValueError("pieces must be an object")
        for k, v in pieces.items():
            if not isinstance(v, str):
                raise ValueError("piece texts must be strings")
            self.pieces[int(k)] = v

    def encode(self, text: str) -> list[int]:
        """No local vocabulary: []."""
        return []

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The pieces of ``ids`` joined."""
        return "".join(self.pieces.get(int(i), "") for i in ids)


def _ids(value, name: str, n: int | None = None):
    import torch

    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name} must be a list of ints")
    if n is not None and len(value) != n:
        raise ValueError(f"{name} has {len(value)} positions, canvas_ids {n}")
    return torch.tensor([value], dtype=torch.long)


def _mask(value, name: str, n: int):
    import torch

    if value is None and name == "locked":
        return None
    if not isinstance(value, str) or len(value) != n or set(value) - {"0", "1"}:
        raise ValueError(f"{name} must be a string of {n} '0'/'1'")
    return torch.tensor([[c == "1" for c in value]], dtype=torch.bool)


def _floats(value, name: str, n: int):
    import torch

    if (
        not isinstance(value, list)
        or len(value) != n
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        raise ValueError(f"{name} must be a list of {n} numbers")
    return torch.tensor([value], dtype=torch.float32)


def _int(d: dict, key: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{key} must be an int")
    return v


def step_event(d: dict) -> StepEvent:
    """A ``step`` wire dict → StepEvent (tensors [1, C] on the CPU). Raises ValueError for a malformed event."""
    ids = _ids(d.get("canvas_ids"), "canvas_ids")
    n = ids.shape[1]
    masks = {name: _mask(d.get(name), name, n) for name in _MASKS}
    return StepEvent(
        _int(d, "canvas"),
        _int(d, "step"),
        _int(d, "max_steps"),
        canvas_ids=ids,
        argmax_ids=_ids(d.get("argmax_ids"), "argmax_ids", n),
        accepted=masks["accepted"],
        renoised=masks["renoised"],
        reopened=masks["reopened"],
        confidence=_floats(d.get("confidence"), "confidence", n),
        entropy=_floats(d.get("entropy"), "entropy", n),
        locked=masks["locked"],
    )


def canvas_done(d: dict, text: str = "") -> CanvasDone:
    """A ``canvas`` wire dict → CanvasDone (with ``text``). Raises ValueError for a malformed event."""
    import torch

    return CanvasDone(
        _int(d, "canvas"),
        _ids(d.get("token_ids"), "token_ids"),
        text,
        _int(d, "steps"),
        torch.tensor([bool(d.get("finished"))]),
    )
