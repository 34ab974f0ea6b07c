"""Events emitted by ``Model.stream`` for the UI and the CLI (README "Python API").

All tensors are on the CPU, batch-first, and safe to keep after the event (they are copies or never mutated).
B = batch size, C = canvas length (tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the engine; `import localdiff` stays light for the CLI
    import torch


@dataclass
class StepEvent:
    """One denoising step of one canvas.

    Attributes:
        canvas_index: 0-based index of the canvas within this generation.
        step: 1-based denoising step within the canvas.
        max_steps: the step cap for this canvas.
        canvas_ids: LongTensor[B, C], the canvas fed to the next step (locked tokens + fresh noise).
        argmax_ids: LongTensor[B, C], argmax of this step's logits (what the canvas would become if it stopped now).
        accepted: BoolTensor[B, C], positions accepted / locked after this step.
        renoised: BoolTensor[B, C], positions that got fresh uniform noise this step (not accepted).
        reopened: BoolTensor[B, C], positions the Re-Noising correction pass reopened this step.
        confidence: FloatTensor[B, C], top-1 probability per position (after temperature), in [0, 1].
        entropy: FloatTensor[B, C], entropy per position in nats.
        locked: BoolTensor[B, C] positions locked by confidence-gated locking (None when locking is off); locked
            tokens keep their value until the Re-Noising correction reopens them.
        slots: slots family (ReFusion) only, else None: this round's ``{"slot_size": k, "picked": [...],
            "how": "verify" | "infill", "committed": [...]}`` — slot numbers within the canvas (the serial block),
            picked in index order, committed in commit order; a "step" is one plan-and-fill round.
        drafted: True for a DFlash verification step (causal family with a draft): canvas = the drafted block (the
            last token, then the drafts), accepted = the last token and the accepted drafts, renoised = the
            rejected drafts, confidence = the draft's top-1 probability.
    """

    canvas_index: int
    step: int
    max_steps: int
    canvas_ids: torch.Tensor
    argmax_ids: torch.Tensor
    accepted: torch.Tensor
    renoised: torch.Tensor
    reopened: torch.Tensor
    confidence: torch.Tensor
    entropy: torch.Tensor
    locked: torch.Tensor | None = None
    slots: dict | None = None
    drafted: bool = False


@dataclass
class CanvasDone:
    """A canvas is final and has been appended to the sequence.

    Attributes:
        canvas_index: 0-based canvas index.
        token_ids: LongTensor[B, C], final (argmax) canvas; positions after the first EOS are pad.
        text: decoded new text of this canvas for batch row 0 ("" without a tokenizer); EOS/pad stripped.
        steps: denoising steps (decoder forwards) this canvas used.
        finished: BoolTensor[B], rows that have produced EOS (or hit max_new_tokens) by now.
    """

    canvas_index: int
    token_ids: torch.Tensor
    text: str
    steps: int
    finished: torch.Tensor


@dataclass
class GenerationStats:
    """Counters and timings of one generation.

    Attributes:
        forwards: decoder (denoise) forwards.
        new_tokens: generated non-pad tokens up to and including the first EOS, summed over the batch.
        tokens_per_forward: new_tokens / forwards (TPF).
        seconds: wall time of the whole generation, seconds.
        prefill_seconds: wall time of the forwards that prefilled (prompt, finished canvases); each is fused with
            the next canvas's first denoising step, whose time it includes. Seconds.
        prompt_tokens: prompt tokens (row 0, without padding).
        prefill_tokens_computed: tokens the encoder actually ran over (cache misses).
        prefill_tokens_reused: prompt tokens served from a reused cache (multi-turn prefix reuse).
        canvases: number of canvases generated.
        tokens_per_second: new_tokens / seconds.
        cache: KV-cache accounting (bytes on device / host, current and peak; blocks moved), when available.
        commit_step: the decoding order of the masked family (``localdiff.decoding.masked_loop``): per returned token,
            the 1-based step of the generation at which it was committed (a list, or one list per row for a batch);
            empty for the canvas family. ARness (issue #21) is computed from it.
        arness: how left-to-right that order was (:mod:`localdiff.decoding.arness`): ``{"local@k": float,
            "global@k": float}`` for k = 1..4, in [0, 1] (1 = strictly left to right; a batch: the mean over rows);
            empty for the canvas family.
        acceptance_lengths: DFlash speculative decoding: tokens each verification step produced (accepted drafts + 1
            from the target; z-lab/dflash's ``acceptance_lengths``); empty otherwise.
        acceptance_length: their mean, the acceptance length τ (0.0 without drafts).
        draft_forwards: draft-model passes (DFlash).
    """

    forwards: int = 0
    new_tokens: int = 0
    tokens_per_forward: float = 0.0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefill_tokens_reused: int = 0
    canvases: int = 0
    tokens_per_second: float = 0.0
    cache: dict = field(default_factory=dict)
    commit_step: list = field(default_factory=list)
    arness: dict = field(default_factory=dict)
    acceptance_lengths: list = field(default_factory=list)
    acceptance_length: float = 0.0
    draft_forwards: int = 0

    def as_dict(self) -> dict:
        """Plain-dict view (JSON-serialisable)."""
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class Done:
    """Generation finished (EOS, max_new_tokens, or cancelled by the consumer).

    Attributes:
        text: generated text for row 0 (str) — or a list of str for batch > 1.
        token_ids: list of generated token ids per row (EOS included, pad removed).
        stats: GenerationStats.
        finish_reason: "eos", "length" or "cancelled".
        seed: the seed actually used (set by the engine).
        options: the decoder options actually used (dict, set by the engine).
    """

    text: "str | list[str]"
    token_ids: list
    stats: GenerationStats
    finish_reason: str = "eos"
    seed: int | None = None
    options: dict = field(default_factory=dict)
