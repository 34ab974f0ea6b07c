"""What a job's generation has used, as the model worker sees it (:class:`Spent`), for answers whose engine run ends
without a Done (a stop string, a client gone)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Spent:
    """What a job's generation has used, as the worker sees it: for an answer cut by a stop string, whose engine
    run ends without a Done (and so without its stats). ``steps``: denoising steps run (the forwards of a batch of
    one); ``canvases`` finished; ``seconds`` from the first step to the end; ``prefill_seconds``: the steps that
    opened a canvas (each fused with the prefill of the prompt or of the canvas before it, as the engine counts
    them); ``sampler``: the decoder options used. Worker thread only, until the job's end is posted."""

    t0: float
    last: float = 0.0
    steps: int = 0
    canvases: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    sampler: dict = field(default_factory=dict)
    _ran_opening: bool = False  # the step that ran last opened a canvas
    _opens: bool = True  # the next step opens one

    def poll(self, now: float, stops: bool) -> None:
        """At each cancel poll (``time.perf_counter()``, before a step; ``stops``: no step follows)."""
        if self._ran_opening:
            self.prefill_seconds += now - self.last
            self._ran_opening = False
        if not stops:
            self.steps += 1
            self._ran_opening, self._opens, self.last = self._opens, False, now

    def canvas_done(self, fused: bool = True) -> None:
        """A canvas ended; ``fused``: the next step also prefills it (canvas, masked and block families; not the
        causal family, whose every token is a "canvas", nor ReFusion's slots: only their first step prefills)."""
        self.canvases += 1
        self._opens = fused

    def end(self, now: float) -> None:
        self.poll(now, stops=True)
        self.seconds = now - self.t0

    def stats(self, prompt_tokens: int, new_tokens: int) -> dict:
        """GenerationStats-shaped numbers for ``new_tokens`` kept (TPF and tokens/s over the steps run)."""
        return {
            "forwards": self.steps,
            "new_tokens": new_tokens,
            "prompt_tokens": prompt_tokens,
            "canvases": self.canvases,
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "tokens_per_forward": new_tokens / max(self.steps, 1),
            "tokens_per_second": new_tokens / self.seconds if self.seconds > 0 else 0.0,
        }
