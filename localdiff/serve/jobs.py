"""From a submitted job to text pieces for a response: waiting for the start, stop strings, cancellation.

Both API shapes (OpenAI, Ollama) submit a job and iterate :func:`pieces` (a list of parts per hand-off from the
worker, written out together; ``localdiff.serve.asgi``); whatever ends the iteration early (a stop string, the
client going away, the response being cancelled) sets the job's cancel flag, so the worker stops the generation
within one denoising step.
"""

from __future__ import annotations

from dataclasses import dataclass

from localdiff.serve.errors import ApiError
from localdiff.serve.worker import Job, ModelWorker


_EVENT_AT = {"start": 2, "step": 1, "delta": 2}  # event kind → the index of its canvas-event payload (or None)


class ClientGone(Exception):
    """The client disconnected (its job is cancelled); nothing more is sent."""


@dataclass
class Result:
    """The end of a generation as the APIs report it.

    Attributes:
        text: the full answer (cut before a stop string when one was hit).
        finish_reason: "stop" (EOS or a stop string) or "length".
        prompt_tokens / completion_tokens: usage counts (completion: generated ids incl. EOS, as ``gen --json``).
        stats: GenerationStats as a dict; seed: the seed used; sampler: the sampler settings used.
    """

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict
    seed: int | None
    sampler: dict

    def extension(self) -> dict:
        """localdiff's own numbers, sent under the ``localdiff`` key of OpenAI responses (and of Ollama's last line
        when a draft ran): with a DFlash draft also ``acceptance_length`` (τ, tokens per verification step),
        ``acceptance_lengths`` (per step) and ``draft_forwards``."""
        s = self.stats
        out = {
            "seed": self.seed,
            "forwards": s.get("forwards"),
            "steps": s.get("forwards"),
            "canvases": s.get("canvases"),
            "tokens_per_forward": s.get("tokens_per_forward"),
            "seconds": s.get("seconds"),
            "tokens_per_second": s.get("tokens_per_second"),
            "sampler": self.sampler,
            **({"batch": s["batch"]} if s.get("batch") else {}),
        }
        if s.get("acceptance_lengths"):
            out.update({k: s[k] for k in ("acceptance_length", "acceptance_lengths", "draft_forwards") if k in s})
        return out

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the conversation cache kept across requests (not prefilled again)."""
        return int(self.stats.get("prefill_tokens_reused") or 0)


class StopMatcher:
    """Cut streamed text before the first stop string, holding back a tail that could start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""
        self.sent = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """Add ``text``; returns what may be sent now ("" while a stop string may be forming)."""
        if self.hit or not text:
            return ""
        if not self.stops:
            self.sent += text
            return text
        self.buf += text
        cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.buf, self.hit = self.buf[:cut], "", True
        else:
            keep = min(self.hold, len(self.buf))
            out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        self.sent += out
        return out

    def flush(self) -> str:
        """At the end: the held-back tail (no stop string in it)."""
        out, self.buf = ("" if self.hit else self.buf), ""
        self.sent += out
        return out


async def pieces(job: Job):
    """Yield the response's parts in order, one list per hand-off from the worker (so each list can go out in one
    write): ("event", dict) canvas events (``localdiff.wire``; only when the request asked for them), ("text", str)
    answer text, and last ("end", Result). Cancels the job if closed early.

    Raises:
        ApiError: the generation failed after it started (an engine error mid-way), after the parts before it.
        ClientGone: the client disconnected (a ``("gone",)`` event from the disconnect watcher).
    """
    stop = StopMatcher(job.req.stop)
    try:
        while True:
            out, err, end = [], None, False
            for item in await job.batch():
                kind = item[0]
                if kind == "gone":
                    raise ClientGone()
                if stop.hit:  # the answer is cut: only the worker's end (at most one step later) for its numbers
                    if kind in ("done", "error"):
                        out.append(("end", _result(stop.sent, "stop", item[1:] if kind == "done" else None, job)))
                        end = True
                        break
                    continue
                event = _EVENT_AT.get(kind)  # where a canvas event rides, if any
                if event is not None and item[event] is not None:
                    out.append(("event", item[event]))
                if kind == "delta":
                    text = stop.feed(item[1])
                    if text:
                        out.append(("text", text))
                    if stop.hit:
                        job.cancel.set()
                elif kind == "done":
                    out += _finish(job, stop, item[1], item[2])
                    end = True
                    break
                elif kind == "error":
                    err = item[1]
                    break
            if out:
                yield out
            if err is not None:
                raise err
            if end:
                return
    finally:
        job.cancel.set()  # no-op after the end; stops the engine when the response is abandoned


def _finish(job: Job, stop: StopMatcher, done, used) -> list:
    """The parts after the engine's Done: text the canvases' pieces missed, the held-back tail, the Result."""
    out = []
    full = done.text if isinstance(done.text, str) else done.text[0]
    pending = stop.sent + stop.buf
    if full.startswith(pending) and len(full) > len(pending):
        text = stop.feed(full[len(pending) :])  # canvas-wise decoding can differ at joins
        if text:
            out.append(("text", text))
    text = stop.flush()
    if text:
        out.append(("text", text))
    reason = "stop" if stop.hit or done.finish_reason == "eos" else "length"
    out.append(("end", _result(stop.sent, reason, (done, used), job, cut=stop.hit)))
    return out


def _result(text: str, reason: str, done_used, job: Job, cut: bool = True) -> Result:
    """The Result of ``job``: from the engine's Done and the settings used (``done_used``), or, for an answer cut by
    a stop string whose run the worker cancelled (``done_used`` None), from the worker's accounting
    (:class:`~localdiff.serve.worker.Spent`). A cut answer (``cut``) counts the tokens of the text kept."""
    if done_used is None:
        spent = job.spent
        n = _kept_tokens(job, text)
        stats = spent.stats(job.prompt_tokens, n) if spent is not None else {"prompt_tokens": job.prompt_tokens}
        stats["load_seconds"] = job.load_seconds
        return Result(text, reason, job.prompt_tokens, n, stats, job.seed, spent.sampler if spent else {})
    done, used = done_used
    ids = done.token_ids[0] if done.token_ids and isinstance(done.token_ids[0], list) else done.token_ids
    stats = done.stats.as_dict()
    stats.pop("cache", None)
    stats["load_seconds"] = job.load_seconds
    if job.lane is not None:  # it ran in a batch (serve --max-batch): the batch it shared steps with
        stats["batch"] = job.lane.stats()
    n = len(ids)
    if cut:  # the engine ended before it saw the cancel: its numbers, the kept text's tokens
        n = _kept_tokens(job, text)
        secs = float(stats.get("seconds") or 0.0)
        stats.update(
            new_tokens=n,
            tokens_per_forward=n / max(int(stats.get("forwards") or 0), 1),
            tokens_per_second=n / secs if secs > 0 else 0.0,
        )
    return Result(text, reason, int(stats.get("prompt_tokens", 0)), n, stats, used.get("seed"), used.get("sampler", {}))


def _kept_tokens(job: Job, text: str) -> int:
    tok = getattr(job.model, "tokenizer", None)
    return len(tok.encode(text)) if tok is not None and text else 0


async def collect(job: Job) -> Result:
    """Run a job to the end and return its Result (non-streaming responses)."""
    result = None
    async for batch in pieces(job):
        for kind, value in batch:
            if kind == "end":
                result = value
    return result


def raise_unavailable(worker: ModelWorker) -> None:
    """503 while a model is loading (used by /health)."""
    if worker.loading:
        raise ApiError(
            503, f"loading {worker.loading}", type="server_busy", code="loading", headers={"Retry-After": "2"}
        )
