"""``localdiff gen``: one-shot generation for scripts and pipelines.

stdout carries only generated text, written canvas by canvas as each canvas becomes final (``CanvasDone``), or one
JSON object with ``--json``. Control characters in the model's text are shown visibly (``localdiff.safetext``) unless
``--raw-bytes`` asks for the exact text on a stdout that is not a terminal; ``--json`` escapes them. Everything else
goes to stderr. The prompt comes from piped stdin, ``-f FILE`` and ``-p`` / words (:mod:`localdiff.cli.prompt_input`).
"""

from __future__ import annotations

import random
import sys

from localdiff.cli.prompt_input import assemble_prompt
from localdiff.config import load_user_config, sampler_overrides, with_flags
from localdiff.errors import LocaldiffError, UsageError
from localdiff.safetext import json_dumps, visible


def _stderr_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _flags(args) -> dict:
    """Decoder options given as flags: {flag key: raw value} (see ``localdiff.decoding.options.cli_flags``)."""
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}


def flag_names(flags: dict) -> dict:
    """{flag key: the flag as typed} for error messages."""
    return {k: "--" + k.replace("_", "-") for k in flags}


def this_run(model, overrides: dict, typed: dict, cfg) -> dict:
    """What the user gave for this run — the flags (``typed``: key → flag) and a ``LOCALDIFF_DECODER`` — as key →
    its name for messages: :meth:`Model.applicable` keeps these, so a decoder the model cannot run is an error
    naming its source, as ``--decoder`` is (``LOCALDIFF_DECODER=llada gen`` silently ran tiny's canvas_eb). A
    decoder saved in the config file is for the models that can run it: skipped for the others, with one note on
    stderr (``note: config decoder 'llada' does not apply to tiny (it runs canvas_eb); ignored``)."""
    from localdiff.decoding.options import DECODER

    typed = dict(typed)
    name = overrides.get(DECODER)
    if name is None or DECODER in typed:
        return typed
    origin = cfg.origins.get(DECODER, "")
    if origin.startswith("env:"):
        typed[DECODER] = origin[len("env:") :]
    elif name not in model.decoders:
        sys.stderr.write(
            f"note: config decoder {name!r} does not apply to {model.name} (it runs {model.options_cls.POLICY}); "
            "ignored\n"
        )
    return typed


def _size(text, flag, minimum: int = 0):
    """A size flag's value in bytes (``2GiB``, ``512MB``, ``0``), None when not given; every command parses sizes here.

    ``minimum`` is 1 for a memory that must exist (``--gpu-mem``, ``--ram``), 0 where zero means "none on the device"
    (``--kv-budget``) or "no limit" (``--max-body``). Raises UsageError naming the flag and the text.
    """
    if text is None:
        return None
    from localdiff.quantize.recipe import parse_bytes

    try:
        n = parse_bytes(text)
    except Exception as e:  # noqa: BLE001 — any parse failure is the user's flag value
        if str(e).startswith("size too large"):
            raise UsageError(f"{flag}: {e}") from None
        n = -1
    if n < 0 and not str(text).strip().startswith("-"):
        raise UsageError(f"{flag}: expected a size like 2GiB or 512MB, got {text!r}")
    if n < minimum:
        raise UsageError(f"{flag}: a size must be {'> 0' if minimum else '≥ 0'}, got {text!r}")
    return n


def _load(name: str, device, quant, gpu_mem=None, dtype=None, threads=None, draft=None, gpu_layers=None):
    try:
        from localdiff import load
    except ImportError as e:  # pragma: no cover — engine missing from a broken install
        raise LocaldiffError(f"the generation engine is not available: {e}") from None
    return load(
        name,
        device=device,
        quant=quant,
        gpu_mem=gpu_mem,
        dtype=dtype,
        threads=threads,
        draft=draft,
        gpu_layers=gpu_layers,
    )


def run_gen(args) -> int:
    """Run ``localdiff gen``; returns the exit code (0, or 130 when interrupted after flushing final canvases)."""
    from localdiff.events import CanvasDone, Done

    prompt = assemble_prompt(args)
    cfg = with_flags(
        load_user_config(),
        model=args.model,
        device=args.device,
        quant=args.quant,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        threads=getattr(args, "threads", None),
    )
    overrides = sampler_overrides(_flags(args), cfg)
    seed = cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(2**31)
    gpu_mem = _size(getattr(args, "gpu_mem", None), "--gpu-mem", 1)
    kv_budget = _size(getattr(args, "kv_budget", None), "--kv-budget")
    quant = cfg.quant
    if quant is None:  # no --quant / LOCALDIFF_QUANT / config: the plan picks bf16, int8 or int4
        from localdiff.cli.fit import auto_quant

        quant = auto_quant(cfg.default_model, cfg.device, gpu_mem, getattr(args, "dtype", None))
    model = _load(
        cfg.default_model,
        cfg.device,
        quant,
        gpu_mem,
        getattr(args, "dtype", None),
        cfg.threads or "auto",
        getattr(args, "draft", None),
        getattr(args, "gpu_layers", None),
    )
    cache = model.new_cache(device_budget_bytes=kv_budget) if kv_budget is not None else None
    typed = this_run(model, overrides, flag_names(_flags(args)), cfg)
    overrides = model.applicable(overrides, keep=typed)  # saved settings: this decoder's only
    used = model.sampler_options(_typed=typed, **overrides)
    out = sys.stdout
    show = _text_filter(args, out)
    written: list[str] = []
    done = None
    interrupted = False
    stream = model.stream(
        prompt,
        max_new_tokens=cfg.max_new_tokens,
        seed=seed,
        chat=args.chat,
        system=args.system,
        emit_steps=False,
        cache=cache,
        **overrides,
    )
    try:
        for ev in stream:
            if isinstance(ev, CanvasDone):  # its text: what the canvas adds, within max_new_tokens (the loops cut
                text_i = ev.text  # a last canvas that runs past it; decoding.detok keeps the joins)
                written.append(text_i)
                if not args.json:
                    out.write(show(text_i))
                    out.flush()
            elif isinstance(ev, Done):
                done = ev
    except KeyboardInterrupt:
        interrupted = True
    finally:
        stream.close()
    text = "".join(written)
    if done is not None and isinstance(done.text, str) and done.text.startswith(text) and not args.json:
        rest = done.text[len(text) :]  # canvas-wise decoding can differ at joins; the full decode is authoritative
        if rest:
            out.write(show(rest))
        text = done.text
    elif done is not None and isinstance(done.text, str):
        text = done.text
    if args.json:
        out.write(json_dumps(_json_result(model, text, done, seed, used, interrupted)) + "\n")
    elif text and not text.endswith("\n"):
        out.write("\n")
    out.flush()
    if interrupted:
        sys.stderr.write("interrupted\n")
        return 130
    if done is not None and getattr(args, "verbose", False):
        s = done.stats
        sys.stderr.write(
            f"stats: {s.new_tokens} new tokens, {s.canvases} canvas(es), {s.forwards} forwards, "
            f"TPF {s.tokens_per_forward:.2f}, {s.seconds:.2f} s, prefill {s.prefill_tokens_computed} "
            f"computed / {s.prefill_tokens_reused} reused, seed {seed}{_tau(s)}\n"
        )
        if s.cache:  # the canvas family's block cache, a masked model's prefix / dual K/V tiers
            sys.stderr.write(kv_cache_line(s.cache) + "\n")
        if model.precision is not None:
            sys.stderr.write(f"precision: {model.precision.line()}\n")
        sys.stderr.write("kernels: " + ", ".join(f"{k}={v}" for k, v in model.kernels().items()) + "\n")
        sys.stderr.write(backend_line(model, used) + "\n")
        sys.stderr.write(config_line() + "\n")
        if s.arness:  # how left to right the decoding order was (masked family, issue #21)
            sys.stderr.write("arness: " + ", ".join(f"{k} {v:.3f}" for k, v in s.arness.items()) + "\n")
    elif done is not None and not args.quiet and _stderr_tty():
        s = done.stats
        canv = f"{s.canvases} canvas" + ("" if s.canvases == 1 else "es")
        sys.stderr.write(
            f"[{s.new_tokens} tokens, {canv}, {s.forwards} forwards, "
            f"{s.tokens_per_forward:.2f} tokens/forward, {s.tokens_per_second:.1f} tokens/s, "
            f"seed {seed}{_tau(s)}]\n"
        )
    return 0


def kv_cache_line(cache: dict) -> str:
    """``gen -v``'s KV-cache line from ``GenerationStats.cache`` (the block cache's ``KVCache.stats()`` or a masked
    model's ``WindowStore.accounting()``), sizes in binary units (:func:`localdiff.units.format_size`), e.g.
    ``kv cache: 11 tokens, device 0 B (peak 0 B), host 33.00 KiB (peak 33.00 KiB), device budget 1.00 KiB, blocks 0
    on device / 4 on host, moved 4 blocks to host (33.00 KiB), 12 to device (99.00 KiB), 0 freed, host reads 0
    prefetched / 12 synchronous``. A counter this does not know is named with its value (a size when it counts
    bytes)."""
    from localdiff.units import format_size

    c, parts = dict(cache), []

    def size(v):
        return format_size(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)

    if "tokens" in c:
        parts.append(f"{c.pop('tokens')} tokens")
    for tier in ("device", "host", "staging"):
        cur = c.pop(f"{tier}_bytes", None)
        peak = c.pop(f"{tier}_bytes_peak", c.pop(f"{tier}_peak_bytes", None))
        if cur is not None or peak is not None:
            parts.append(
                tier
                + (f" {size(cur)}" if cur is not None else "")
                + (f" (peak {size(peak)})" if cur is not None and peak is not None else "")
                + (f" peak {size(peak)}" if cur is None else "")
            )
    if "budget_bytes" in c:
        budget = c.pop("budget_bytes")
        parts.append("device budget " + ("unlimited" if budget is None else size(budget)))
    if "blocks_device" in c or "blocks_host" in c:
        parts.append(f"blocks {c.pop('blocks_device', 0)} on device / {c.pop('blocks_host', 0)} on host")
    moved = [
        f"{c.pop(f'blocks_to_{t}')} to {t} ({size(c.pop(f'bytes_to_{t}', 0))})"
        for t in ("host", "device")
        if f"blocks_to_{t}" in c
    ]
    moved += [f"{c.pop('blocks_freed')} freed"] if "blocks_freed" in c else []
    if moved:
        parts.append("moved " + moved[0].replace(" to ", " blocks to ", 1) + "".join(", " + m for m in moved[1:]))
    if "prefetched_reads" in c or "sync_reads" in c:
        parts.append(f"host reads {c.pop('prefetched_reads', 0)} prefetched / {c.pop('sync_reads', 0)} synchronous")
    if "layers_on_host" in c:
        parts.append(f"{c.pop('layers_on_host')} layers on host")
    parts += [f"{k.replace('_', ' ')} {size(v) if 'bytes' in k else v}" for k, v in sorted(c.items())]
    return "kv cache: " + ", ".join(parts)


def config_line() -> str:
    """ "config: PATH" or, for the default place, "config: PATH (not found: defaults; the chat's /set creates it)"
    (a file named by ``LOCALDIFF_CONFIG`` that is missing stops the command before: ``config.load_user_config``)."""
    from localdiff.config import config_path

    path = config_path()
    return f"config: {path}" + ("" if path.exists() else " (not found: defaults; the chat's /set creates it)")


def backend_line(model, options: dict | None = None) -> str:
    """ "backend: gguf (llama-cpp-python X (ggml V, commit C)), engine llama.cpp, Q8_0, cache kv_cache dual (llama.cpp
    K/V memory), 0 GPU layers, 2 threads" (the cache: the block family's exact block cache, or the masked family's
    ``kv_cache`` of ``options``) or "backend: torch X, cpu, float32, 2 threads"."""
    if model.backend == "gguf":
        n = model.threads
        if model.family == "block":
            cache = "exact block cache (llama.cpp K/V memory)"
        else:
            mode = (options or {}).get("kv_cache", "none")
            cache = f"kv_cache {mode}" + (" (llama.cpp K/V memory)" if mode != "none" else " (full pass per step)")
        gpu = model.gpu_layers
        return (
            f"backend: gguf ({model.backend_version}), engine llama.cpp, {model.quant}, cache {cache}, "
            f"{'all' if gpu < 0 else gpu} GPU layers, {n} thread{'s' if n != 1 else ''}"
        )
    import torch

    line = f"backend: torch {torch.__version__}, {model.device}, {str(model.dtype).replace('torch.', '')}"
    n, why = torch.get_num_threads(), model.threads_why
    return line + (
        f", {n} thread{'s' if n != 1 else ''}" + (f" ({why})" if why else "") if str(model.device) == "cpu" else ""
    )


def _tau(s) -> str:
    """The DFlash part of a stats line: acceptance length τ over the drafted blocks ("" without a draft)."""
    n = len(s.acceptance_lengths)
    return f", DFlash τ {s.acceptance_length:.2f} over {n} drafted block{'s' if n != 1 else ''}" if n else ""


def _text_filter(args, out):
    """How generated text is written: control characters made visible (:func:`localdiff.safetext.visible`), unless
    ``--raw-bytes`` asks for the model's exact text on a stdout that is not a terminal."""
    if not getattr(args, "raw_bytes", False):
        return visible
    try:
        tty = out.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty:
        sys.stderr.write("note: --raw-bytes ignored: stdout is a terminal (control characters are shown visibly)\n")
        return visible
    return lambda text: text


def _json_result(model, text: str, done, seed: int, sampler: dict, interrupted: bool) -> dict:
    from localdiff.hub.models import describe_path

    stats = done.stats.as_dict() if done is not None else {}
    ids = (
        done.token_ids[0]
        if done is not None and done.token_ids and isinstance(done.token_ids[0], list)
        else (done.token_ids if done is not None else [])
    )
    return {
        "text": text,
        "token_ids": list(ids),
        "model": describe_path(model.path) if model.path else str(model.name),
        "model_name": str(model.name),
        "seed": seed,
        "sampler": sampler,
        "usage": {
            "prompt_tokens": stats.get("prompt_tokens", 0),
            "completion_tokens": len(ids),
            "total_tokens": stats.get("prompt_tokens", 0) + len(ids),
        },
        "timings": {
            "seconds": stats.get("seconds"),
            "prefill_seconds": stats.get("prefill_seconds"),
            "tokens_per_second": stats.get("tokens_per_second"),
        },
        "tokens_per_forward": stats.get("tokens_per_forward"),
        "forwards": stats.get("forwards"),
        "canvases": stats.get("canvases"),
        "finish_reason": "cancelled" if interrupted else (done.finish_reason if done is not None else None),
        "device": str(model.device),
        "quant": model.quant,
        "draft": model.draft_name,
        "stats": stats,
    }
