"""Step-level batching of concurrent generations on one model (docs/ARCHITECTURE.md, "Step-level batching").

Each admitted generation (a *lane*) runs its own, unchanged decode loop — ``Model.stream`` with its own options,
seed, random stream and cache — in a thread of its own, on a view of the model whose ``net`` is a *gate*
(:class:`GateNet`): a forward call (``denoise``, ``prefill``, ``forward_window``, ``logits_full``, ...) posts its
arguments and waits. The scheduler (:meth:`Batcher.step`, in the caller's thread: the server's model thread) hands
a baton to every lane in turn — exactly one thread runs at a time, so the lanes never compete for the cores and a
step's order is fixed — until each has posted its next forward call or ended; then it runs ONE packed forward per
kind (:mod:`localdiff.arch.packed`: block ``denoise`` calls together, masked ``forward_window`` / ``logits_full``
calls together, DiffusionGemma canvas ``denoise`` calls together: :mod:`localdiff.arch.packed_canvas`) and hands
each lane its own result. A lane that ends (done, cancelled, failed) leaves at once; a new
one joins at the next step. Other calls (prefill-only passes, Fast-dLLM v2's sub-block passes, other families' and
batched prompts' forwards) run alone, in the scheduler's thread (every forward runs in the model thread, as without
batching, under inference mode), within the same step.

Exactness: :class:`RowPolicy` lets rows share a matmul only where the kernel computes them bit-identically alone
and packed — the native int8 kernel (:mod:`localdiff.quantize.native`, row-exact for ≤ 16 rows) where the model's
own forward would run it too, and float ``F.linear`` at the row counts that a probe on this machine finds stable
(MKL rounds 1–3, and at 2 threads 5–7 and 9–11, rows differently from the same rows in a larger matmul); MoE
feed-forwards of the block family never (their expert matmuls' row counts change with the batch; the canvas
family's experts are probed per width: :mod:`localdiff.engine.batch_canvas`). So every lane's tokens equal the
same request run alone (tests/serve/test_batch.py, tests/serve/test_batch_canvas.py).
"""

from __future__ import annotations

import copy
import inspect
import logging
import threading

import torch

from localdiff.arch import packed, packed_canvas
from localdiff.arch.block import BlockLM
from localdiff.arch.diffusion_gemma import DiffusionGemma
from localdiff.arch.masked import MaskedLM
from localdiff.arch.soft_embedding import RawLogits
from localdiff.engine.batch_canvas import CanvasRowPolicy, canvas_call
from localdiff.engine.row_policy import RowPolicy

log = logging.getLogger("localdiff.batch")
#: the net methods that are forwards: a lane's call of one goes through the scheduler
GATED = frozenset({"denoise", "prefill", "denoise_capture", "denoise_sub", "logits_full", "forward_window"})


def batchable(model) -> bool:
    """Whether ``model``'s forwards pack (:mod:`localdiff.arch.packed`, :mod:`localdiff.arch.packed_canvas`): a
    torch block-diffusion net (``denoise`` over the exact block cache), a masked-diffusion one (``forward_window``)
    or a DiffusionGemma (canvas ``denoise``). Other nets (the causal and slots families, GGUF backends) gain
    nothing from lanes: their requests run one at a time."""
    return isinstance(getattr(model, "net", None), (BlockLM, MaskedLM, DiffusionGemma))


class GateNet:
    """The net as a lane sees it: forwards (:data:`GATED`) go through the lane's scheduler, everything else is the
    real net's attribute."""

    def __init__(self, net, lane: "Lane"):
        self.__dict__["_net"], self.__dict__["_lane"] = net, lane

    def __getattr__(self, name):
        attr = getattr(self._net, name)
        if name in GATED and callable(attr):
            lane = self._lane
            return lambda *a, **kw: lane.forward(name, a, kw)
        return attr


class Lane:
    """One generation in the batch: ``fn(model_view)`` runs in its own thread, one baton hand-off at a time."""

    def __init__(self, batcher: "Batcher", fn, tag=None):
        self.batcher, self.fn, self.tag = batcher, fn, tag
        self.go = threading.Semaphore(0)
        self.call: tuple | None = None  # (name, args, kw) posted and not answered yet
        self.packed = None  # the call's arguments as the packed forward takes them (this step)
        self.result = self.error = None
        self.done = False
        self.rows = 0  # rows of its last forward (stats)
        self.steps = self.rows_sum = self.peers_max = 0  # steps it shared, their rows (all lanes), most lanes
        view = copy.copy(batcher.model)
        view.net, view._lock, view._owner = GateNet(batcher.model.net, self), threading.Lock(), None
        self.model = view
        self.thread = threading.Thread(target=self._main, name="localdiff-lane", daemon=True)

    def stats(self) -> dict:
        """The batch this lane ran in: ``requests_max`` (most lanes in one of its steps), ``rows_per_step`` (mean
        rows of all lanes' forwards in its steps), ``steps``."""
        return {
            "requests_max": self.peers_max,
            "rows_per_step": round(self.rows_sum / max(self.steps, 1), 2),
            "steps": self.steps,
        }

    def _main(self) -> None:
        self.go.acquire()
        torch.set_num_threads(self.batcher.threads)
        try:
            self.fn(self.model)
        except BaseException:  # noqa: BLE001 — fn reports its own errors; this only keeps the scheduler alive
            log.exception("batched generation failed")
        finally:
            self.done = True
            self.batcher._back.release()

    def forward(self, name: str, args: tuple, kw: dict):
        """A gated forward call: wait for the scheduler's answer (its result, or its error raised here)."""
        self.call, self.result, self.error = (name, args, kw), None, None
        self.batcher._back.release()
        self.go.acquire()
        result, error, self.result, self.error = self.result, self.error, None, None
        if error is not None:
            raise error
        return result


class Batcher:
    """The scheduler of the lanes on one model (module docstring). ``threads``: torch threads of each lane.

    Attributes (for ``/api/ps`` and stats): ``lanes`` (active), ``steps`` (packed steps run), ``last_rows`` (rows
    of the last step's forwards, all lanes), ``rows_total``."""

    def __init__(self, model, threads: int | None = None, max_rows: int | None = None):
        self.model = model
        self.threads = threads or torch.get_num_threads()
        canvas = isinstance(model.net, DiffusionGemma)
        self.policy = (CanvasRowPolicy if canvas else RowPolicy)(model.net, max_rows)
        self.lanes: list[Lane] = []
        self._back = threading.Semaphore(0)
        self.steps = self.last_rows = self.rows_total = 0

    def add(self, fn, tag=None) -> Lane:
        """A new lane running ``fn(model_view)``; it starts at the next :meth:`step`."""
        lane = Lane(self, fn, tag)
        lane.thread.start()
        self.lanes.append(lane)
        return lane

    def _turn(self, lane: Lane) -> None:
        lane.go.release()
        self._back.acquire()

    def step(self) -> None:
        """One step: every lane runs to its next forward call (or its end), then the posted calls run (packed)."""
        for lane in list(self.lanes):
            self._turn(lane)
            if lane.done:
                self.lanes.remove(lane)
        posted = [ln for ln in self.lanes if ln.call is not None]
        if not posted:
            return
        rows = 0
        for kind, group in self._kinds(posted):
            rows += sum(ln.rows for ln in group)
            if kind is None or len(group) == 1:
                for ln in group:
                    self._alone(ln)
                continue
            self._packed(kind, group)
        self.steps += 1
        self.last_rows = rows
        self.rows_total += rows
        for ln in posted:
            ln.steps += 1
            ln.rows_sum += rows
            ln.peers_max = max(ln.peers_max, len(posted))

    def _alone(self, ln: Lane) -> None:
        """Run a lane's posted call by itself, here (the model thread), as the lane's own forward."""
        name, args, kw = ln.call
        ln.call, ln.packed = None, None
        try:
            with torch.inference_mode():
                ln.result = getattr(self.model.net, name)(*args, **kw)
            if isinstance(ln.result, RawLogits):  # (a buffer the next raw call of this step would reuse)
                ln.result = RawLogits(ln.result.values.clone(), ln.result.softcap)
        except Exception as exc:  # noqa: BLE001 — raised in the lane, in the loop that called
            ln.error = exc

    def _kinds(self, posted: list[Lane]) -> list:
        """[(kind or None, lanes)]: the calls that pack together ("block" / "masked" / "canvas"), then the others
        one by one."""
        net = self.model.net
        out: dict = {}
        alone = []
        for ln in posted:
            name, args, kw = ln.call
            kind, bound = None, None
            try:
                bound = inspect.signature(getattr(net, name)).bind(*args, **kw).arguments
            except TypeError:
                pass
            if bound is not None and name == "denoise" and isinstance(net, BlockLM):
                ids = bound["canvas_ids"]
                pre = bound.get("prefill_ids")
                if (
                    bound.get("self_conditioning_logits") is None
                    and ids.shape[0] == 1
                    and (pre is None or pre.shape[0] == 1)
                    and set(bound) <= {"canvas_ids", "cache", "prefill_ids", "prefill_mask", "self_conditioning_logits"}
                ):
                    kind = "block"
                    ln.packed = (ids, bound["cache"], pre, bound.get("prefill_mask"))
                    ln.rows = ids.shape[1] + (0 if pre is None else pre.shape[1])
            elif bound is not None and name in ("forward_window", "logits_full") and isinstance(net, MaskedLM):
                if bound["input_ids"].shape[0] == 1:
                    kind = "masked"
                    ln.packed = dict(bound)
                    ln.rows = bound["input_ids"].shape[1]
            elif bound is not None and (hit := canvas_call(net, name, bound)) is not None:
                kind = "canvas"
                ln.packed, ln.rows = hit
            if kind is None:
                ln.rows = 0
                alone.append(ln)
            else:
                out.setdefault(kind, []).append(ln)
        return list(out.items()) + [(None, [ln]) for ln in alone]

    def _packed(self, kind: str, group: list[Lane]) -> None:
        net = self.model.net
        fn = {"block": packed.block_denoise, "masked": packed.masked_window}.get(kind)
        try:
            calls = [ln.packed for ln in group]
            results = (
                packed_canvas.canvas_denoise(net, calls, self.policy)
                if fn is None
                else fn(net, calls, self.policy.pack)
            )
        except Exception as exc:  # noqa: BLE001 — each lane's own call then raises its own error, alone
            for ln in group:
                if _wrote(kind, ln.packed):  # its fused prefill had begun: the failed pass reset its cache
                    ln.call, ln.packed, ln.error = None, None, exc
                else:
                    self._alone(ln)
            return
        for ln, res in zip(group, results):
            ln.call, ln.result, ln.packed = None, res, None


def _wrote(kind: str, call) -> bool:
    """Whether a packed call appends to its cache (fused prefill rows: ``cache.writing`` resets the cache when the
    pass raises, so the call cannot be rerun alone)."""
    if kind == "block":
        return call[2] is not None and call[2].shape[1] > 0
    pre = call.get("prefill_ids") if kind == "canvas" else None
    return pre is not None and pre.shape[1] > 0
