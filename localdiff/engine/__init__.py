"""``Model``: a loaded checkpoint with prefill / denoise / generate / stream (docs/ARCHITECTURE.md; README "Python API").

What differs per model family (caches, the loop, the decoder policy) lives in one runner module per family
(:data:`RUNNERS`: ``localdiff/engine/canvas.py``, ``masked.py``, ...); this module holds what every family shares:
options, prompt encoding, validation, seeds, the generation lock, events (``localdiff/events.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import random
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from localdiff import inputs
from localdiff.arch import entry_for
from localdiff.decoding.defaults import read_generation_config  # noqa: F401
from localdiff.decoding.options import DECODER, POLICIES, choose, policy_for_family, runnable
from localdiff.engine.model_info import installed_models, model_card  # noqa: F401  (front ends import them here)
from localdiff.engine.request import Request
from localdiff.errors import TokenizerMissingError, UsageError
from localdiff.events import Done, GenerationStats

#: model family (``localdiff.arch`` registry) → its runner module: ``prepare(model)`` (checks at load; returns the
#: mask token id the family decodes with, or None),
#: ``new_cache(model, device_budget_bytes)`` and ``stream(model, request)`` (yields events). A family is one line here
#: plus its runner file.
RUNNERS: dict[str, str] = {
    "canvas": "localdiff.engine.canvas",
    "masked": "localdiff.engine.masked",
    "block": "localdiff.engine.block",
    "slots": "localdiff.engine.slots",
    "causal": "localdiff.engine.causal",
}


def runner_for(family: str):
    """The runner module of a model family. Raises KeyError for a family without one."""
    return importlib.import_module(RUNNERS[family])


@dataclass
class Generation:
    """Result of ``Model.generate``: ``text`` (str, or list[str] for a batch), ``token_ids`` (list[int] or one list
    per row; EOS kept, pad removed), ``stats`` (GenerationStats), ``finish_reason`` ("eos" | "length"),
    ``seed`` (the seed actually used), ``sampler`` (the settings actually used)."""

    text: object
    token_ids: list
    stats: GenerationStats
    finish_reason: str
    seed: int
    sampler: dict


class Model:
    """A loaded diffusion LM. Build with :func:`localdiff.load`.

    Attributes (all set here, at construction):
        config: the architecture config. tokenizer: or None. name, path: as loaded. device, dtype, quant.
        net: the torch module (or a GGUF backend's). family: the model family (``localdiff.arch`` registry).
        eos_token_ids (list[int]), pad_token_id (int or None), mask_token_id (int or None: the mask token the
            masked / block / slots families decode with, from the runner's ``prepare``; None for canvas and causal
            models), default_max_new_tokens, generation_config (dict).
        backend: "torch" or "gguf" (llama.cpp); backend_version: the gguf backend's version line, else None.
        threads: the gguf backend's thread count (None on torch: torch's process-wide count applies).
        gpu_layers: layers llama.cpp offloads to a GPU (gguf; -1 = all), 0 on torch.
        precision: :class:`localdiff.capability.Precision` of a CPU torch load (dtype, why, the detected
            capability), else None. threads_why: why ``threads="auto"`` chose torch's thread count, else None.
        draft: the attached DFlash draft net (causal family; :func:`localdiff.engine.causal.attach_draft`) or None;
            draft_name: its name as given, or None.
    """

    def __init__(
        self,
        net,
        config,
        tokenizer,
        path: Path,
        name: str,
        device,
        dtype,
        quant,
        gen_config: dict,
        *,
        backend: str = "torch",
        backend_version: str | None = None,
        threads: int | None = None,
        gpu_layers: int = 0,
        precision=None,
        threads_why: str | None = None,
    ):
        self.net, self.config, self.tokenizer = net, config, tokenizer
        self.path, self.name, self.device, self.dtype, self.quant = path, name, torch.device(device), dtype, quant
        self.backend, self.backend_version = backend, backend_version
        self.threads, self.gpu_layers, self.threads_why = threads, gpu_layers, threads_why
        self.precision = precision
        self.draft = self.draft_name = None
        self.generation_config = gen_config
        self.family = entry_for(config.model_type).family
        own = policy_for_family(self.family, getattr(config, "model_type", None))
        #: the decoders this model can run (its own first; the ``decoder`` option picks one)
        self.decoders = runnable(self.family, own)
        #: the options class of the decoder it runs by default: its own, or the one its generation_config names
        self.options_cls = POLICIES[gen_config.get(DECODER) if gen_config.get(DECODER) in self.decoders else own]
        self._lock = threading.Lock()
        self._owner: int | None = None
        eos = gen_config.get("eos_token_id", list(config.eos_token_id))
        self.eos_token_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
        pad = gen_config.get("pad_token_id", config.pad_token_id)
        self.pad_token_id = None if pad is None else int(pad)
        self.default_max_new_tokens = int(gen_config.get("max_new_tokens", 256))
        if tokenizer is not None:
            tokenizer.eos_token_ids = self.eos_token_ids
        self.runner = runner_for(self.family)
        self.mask_token_id = self.runner.prepare(self)

    # -- building blocks ----------------------------------------------------------------------------------------
    def kernels(self) -> dict[str, str]:
        """Which dtype and kernels this model runs (:func:`localdiff.engine.kernels.describe`)."""
        from localdiff.engine.kernels import describe

        return describe(self.net, self.precision.sampler_path() if self.precision is not None else None)

    def new_cache(self, device_budget_bytes: int | None = None):
        """A fresh cache for this model's family, to reuse across chat turns: the block KV cache of the canvas family
        (``device_budget_bytes``: K/V bytes allowed on the device, None = unlimited, 0 = all on the host; see
        ``localdiff.cache.kv``), the causal family's conversation cache (target K/V, and a DFlash draft's context
        K/V and pending features: ``localdiff.cache.causal``); None for the masked family (its approximate caches
        live inside one generation).
        Raises UsageError for a negative budget."""
        return self.runner.new_cache(self, device_budget_bytes)

    def prefill(self, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None) -> None:
        """Causal encoder pass: LongTensor[B, T] → K/V appended to ``cache`` (see ``DiffusionGemma.prefill``)."""
        self.net.prefill(input_ids.to(self.device), cache, attention_mask)

    def denoise(
        self, canvas_ids: torch.Tensor, cache, self_conditioning_logits=None, prefill_ids=None, prefill_mask=None
    ) -> torch.Tensor:
        """Decoder pass: LongTensor[B, C] → FloatTensor[B, C, V] logits; reads ``cache`` only — unless
        ``prefill_ids`` (LongTensor[B, T], padding mask ``prefill_mask``) are given: they are prefilled in the same
        forward (a fused pass, bit-identical to ``prefill`` then ``denoise``; see ``DiffusionGemma.denoise``)."""
        pre = None if prefill_ids is None else prefill_ids.to(self.device)
        return self.net.denoise(
            canvas_ids.to(self.device), cache, self_conditioning_logits, prefill_ids=pre, prefill_mask=prefill_mask
        )

    # -- options ------------------------------------------------------------------------------------------------
    def sampler_options(self, _typed: dict | None = None, **overrides) -> dict:
        """Effective decoder options: ``decoder`` (the decoder that runs: ``overrides``' ``decoder``, else the
        model's, :attr:`options_cls`) and its options (:mod:`localdiff.decoding.options`): built-in < checkpoint
        generation_config < ``overrides`` (None = unset).

        Raises:
            UsageError: an unknown option, a decoder this model cannot run, an option of another decoder (naming
                the ``decoder`` value that has it), or a bad value / combination (the message names the keyword).
        """
        options = self._options(overrides, _typed)
        return {DECODER: options.POLICY, **options.as_dict()}

    def applicable(self, settings: dict, keep=()) -> dict:
        """``settings`` without the options that belong only to decoders this model cannot run — settings saved for
        every model (config file ``[sampler]``, ``LOCALDIFF_*`` variables, the chat's ``/set``) apply to the models
        whose decoders have them (a saved ``decoder`` to the models that can run it). Keys in ``keep`` (typed as
        flags for this run) and unknown keys stay, so they are still checked (one-line errors) by
        :meth:`sampler_options`."""
        mine = [POLICIES[p] for p in self.decoders]
        own = {n for c in mine for n in (*c.names(), *c.aliases())}
        foreign = {n for c in POLICIES.values() if c not in mine for n in (*c.names(), *c.aliases())}
        return {
            k: v
            for k, v in settings.items()
            if k in keep or (v in self.decoders if k == DECODER else (k in own or k not in foreign))
        }

    def _options(self, overrides: dict, typed: dict | None = None):
        typed = typed or {}
        given = {k: v for k, v in overrides.items() if v is not None}
        cls = POLICIES[
            choose(self.options_cls.POLICY, self.decoders, given.pop(DECODER, None), typed.get(DECODER, DECODER))
        ]
        for k in given:  # an option of another decoder this model can run: name the decoder to choose
            owner = next((p for p in self.decoders if k in POLICIES[p].names() and p != cls.POLICY), None)
            if owner is not None and k not in cls.names() and k not in cls.aliases():
                raise UsageError(
                    f"{typed.get(k, k)}: an option of the {owner} decoder, not of {cls.POLICY} (the "
                    f"decoder this runs); give decoder {owner} to use it (--decoder {owner})"
                )
        names = set(cls.names())
        if cls.POLICY != self.decoders[0]:  # the checkpoint's values of the model's own decoder do not carry over
            names -= set(POLICIES[self.decoders[0]].names())
        values = {k: v for k, v in self.generation_config.items() if k in names}
        values.update(given)
        return cls.build(values, {k: typed.get(k, k) for k in given})

    # -- prompts ------------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt, chat: bool = True, system: str | None = None) -> list[list[int]]:
        """Prompt(s) → token id rows. str / messages / list[int] / LongTensor, or a list of those for a batch.

        Raises:
            UsageError: empty prompt or unsupported type. TokenizerMissingError: text without a tokenizer.
        """
        prompt = inputs.normalize_prompt(prompt)
        if isinstance(prompt, torch.Tensor):
            rows = prompt.tolist() if prompt.dim() == 2 else [prompt.tolist()]
        elif isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            rows = [self._encode_one(prompt, chat, system)]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            rows = [list(prompt)]
        elif isinstance(prompt, list) and prompt:
            rows = [self.encode_prompt(p, chat, system)[0] for p in prompt]
        else:
            raise UsageError("empty prompt")
        for r in rows:
            if not r:
                raise UsageError("empty prompt")
            if min(r) < 0 or max(r) >= self.config.vocab_size:
                raise UsageError(f"token id out of range [0, {self.config.vocab_size})")
        return rows

    def _encode_one(self, prompt, chat, system):
        if self.tokenizer is None:
            raise TokenizerMissingError(
                f"{self.path}: checkpoint has no tokenizer.json; pass token ids instead of text"
            )
        if isinstance(prompt, str) and not prompt.strip():
            raise UsageError("empty prompt")
        if chat:
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if system:
                msgs = [{"role": "system", "content": system}] + msgs
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
        if not isinstance(prompt, str):
            raise UsageError("raw mode takes a string or token ids, not chat messages")
        text = (system + "\n\n" + prompt) if system else prompt
        return self.tokenizer.encode(text)

    # -- generation ---------------------------------------------------------------------------------------------
    def stream(
        self,
        prompt,
        max_new_tokens: int | None = None,
        seed: int | None = None,
        chat: bool = True,
        system: str | None = None,
        cache=None,
        attention_mask=None,
        start_canvas=None,
        emit_steps=True,
        cancel=None,
        **sampler_options,
    ):
        """Generate, yielding StepEvent per denoising step, CanvasDone per canvas, and a final Done.

        Args:
            prompt: str | messages | list[int] | LongTensor[B, T] | list of prompts (batch, left-padded).
            max_new_tokens: tokens to generate at most (spans ceil(n / C) canvases); default from generation_config.
            seed: makes the run reproducible (same draws as ``torch.manual_seed(seed)`` + the reference on CPU).
            chat: render the chat template (text prompts); system: optional system message.
            cache: a cache from :meth:`new_cache` to reuse across chat turns (batch 1): only tokens after the longest
                common prefix with what it holds are prefilled.
            attention_mask: with a LongTensor prompt, its [B, T] mask (0 = left padding).
            cancel: optional ``cancel() -> bool``, called before every denoising step (the first call comes once the
                prompt and options passed their checks); when it returns True the generation stops before that step
                and the generator ends without a Done. Lets a caller stop within one step without step events.
            **sampler_options: see :meth:`sampler_options`.
        Raises:
            UsageError, TokenizerMissingError (before any work is done).
        """
        max_new_tokens, seed = inputs.check_max_new_tokens(max_new_tokens), inputs.check_seed(seed)
        options = self._options(sampler_options)
        opts = {DECODER: options.POLICY, **options.as_dict()}
        n_new = self.default_max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if n_new <= 0:
            raise UsageError("max_new_tokens must be > 0")
        rows = self.encode_prompt(prompt, chat, system)
        longest = max(len(r) for r in rows)
        if longest + n_new > self.config.max_position_embeddings:
            raise UsageError(
                f"prompt ({longest} tokens) + max_new_tokens ({n_new}) exceeds the model's context "
                f"({self.config.max_position_embeddings} tokens)"
            )
        seed = random.randrange(2**63) if seed is None else int(seed)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        ids, mask = _left_pad(rows, self.pad_token_id or 0, self.device)
        if attention_mask is not None and isinstance(prompt, torch.Tensor):
            mask = attention_mask.to(self.device).bool()
        stats = GenerationStats(prompt_tokens=len(rows[0]) if mask is None else int(mask[0].sum()))
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        req = Request(
            options=options,
            ids=ids,
            max_new_tokens=n_new,
            mask=mask,
            rows=rows,
            eos_ids=self.eos_token_ids,
            pad_id=self.pad_token_id,
            mask_id=self.mask_token_id,
            generator=gen,
            stats=stats,
            emit_steps=emit_steps,
            cache=cache,
            start_canvas=start_canvas,
            decode=decode,
            cancel=cancel,
        )
        with self._generation():
            for ev in self.runner.stream(self, req):
                if isinstance(ev, Done):
                    ev.seed, ev.options = seed, opts
                yield ev

    @contextlib.contextmanager
    def _generation(self):
        """The generation lock: one generation at a time on this model. Another thread waits for it; the thread
        that holds it gets a UsageError (a second stream started before the first one was finished or closed)."""
        me = threading.get_ident()
        if self._owner == me:
            raise UsageError(
                "a generation is already running on this model in this thread; "
                "finish or close it before starting another"
            )
        with self._lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None

    def generate(
        self,
        prompt,
        max_new_tokens: int | None = None,
        seed: int | None = None,
        chat: bool = True,
        system: str | None = None,
        cache=None,
        **kw,
    ) -> Generation:
        """Run :meth:`stream` to the end without step events; returns a :class:`Generation`."""
        done = None
        for ev in self.stream(prompt, max_new_tokens, seed, chat, system, cache, emit_steps=False, **kw):
            if isinstance(ev, Done):
                done = ev
        return Generation(done.text, done.token_ids, done.stats, done.finish_reason, done.seed, done.options)


def _left_pad(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of ids → (LongTensor[B, T] left-padded, BoolTensor[B, T] mask or None when no row is padded)."""
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, t - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, t - len(r) :] = True
    return ids.to(device), (None if bool(mask.all()) else mask.to(device))
