"""``localdiff show``: a model's architecture summary (torch-free: from config.json, or a GGUF file's header), its
decoder and options, the CPU precision a load picks, and with ``--plan`` (or a budget flag) its memory plan for a GPU
or the CPU with the precision ``pull`` / ``gen`` would pick. Works before a pull (the catalog's stand-in config)."""

from __future__ import annotations

import sys

from localdiff.cli.output import plain, print_json, print_tree
from localdiff.config import load_user_config
from localdiff.errors import UsageError
from localdiff.hub import models as hub
from localdiff.safetext import visible


def _summarize(cfg: dict, folder):
    for mod in ("quantize.plan", "summary"):
        try:
            m = __import__(f"localdiff.{mod}", fromlist=["summarize"])
        except ImportError:
            continue
        if hasattr(m, "summarize"):
            return m.summarize(cfg, checkpoint_dir=folder)
    return _basic_summary(cfg)


def _basic_summary(cfg: dict) -> dict:
    t = cfg.get("text_config") or cfg
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "num_experts",
        "top_k_experts",
        "vocab_size",
        "max_position_embeddings",
    )
    return {
        "model_type": cfg.get("model_type"),
        "canvas_length": cfg.get("canvas_length"),
        **{k: t.get(k) for k in keys if k in t},
    }


def _size_flag(text: str, flag: str, minimum: int = 1) -> int:
    """A memory size flag's value in bytes, parsed as every command parses it (``localdiff.cli.gen._size``)."""
    from localdiff.cli.gen import _size

    return _size(text, flag, minimum)


def _gpu_budget(text: str | None) -> int:
    if text is not None:  # "" is a size the user typed wrong, not "measure this GPU"
        return _size_flag(text, "--gpu-mem")
    from localdiff.hub.fit import gpu_mem_bytes

    n = gpu_mem_bytes()
    if not n:
        raise UsageError("no NVIDIA GPU found to measure; give the budget with --gpu-mem SIZE (e.g. 24GiB)")
    return n


def _gguf_file(name: str):
    """The .gguf file a name points at (a file, or a pulled ``org/repo:QUANT``), or None."""
    from pathlib import Path

    from localdiff.errors import ModelNotFoundError

    if Path(name).expanduser().is_file():
        return Path(name).expanduser()
    try:
        target = hub.parse_name(name)
    except (ModelNotFoundError, UsageError):
        return None
    return hub.resolve_model(name) if target.quant else None


def gguf_summary(path) -> dict:
    """``show``'s summary of a GGUF file (its header; torch-free, no llama-cpp-python needed)."""
    from localdiff.backends.gguf_config import cache_modes, describe as read_gguf

    h, c = read_gguf(path)
    out = {
        "backend": "gguf (llama.cpp through llama-cpp-python)",
        "engine": "llama.cpp",
        "quant": c.quant,
        "family": c.family,
        "cache": cache_modes(c.family, c.architecture),
        "model_type": c.model_type,
        "gguf_architecture": c.architecture,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "mask_token_id": c.mask_token_id,
        "eos_token_id": list(c.eos_token_id),
        "shift_logits": c.shift_logits,
        "file_bytes": h.file_size,
        "tensors": len(h.tensors),
    }
    if c.num_experts:
        out["experts"] = {"total": c.num_experts, "top_k": c.num_experts_per_tok}
    if c.family == "block":
        out.update(block_size=c.block_size, token_shift=c.token_shift)
    return out


def run_show(args) -> int:
    name = args.name if args.name is not None else load_user_config().default_model  # "" is refused, as for gen -m
    gg = _gguf_file(name)
    if gg is not None:
        summary = gguf_summary(gg)
        cfg, folder, source = None, gg, str(gg)
    else:
        cfg, folder, source = hub.model_config(name)
        summary = _summarize(cfg, folder)
    out = {"name": name, "source": source, "path": str(folder) if folder else None, "summary": summary}
    from localdiff.decoding.defaults import describe
    from localdiff.decoding.options import has_decoder

    if has_decoder(summary.get("family")):  # a family whose decoders are not wired yet shows its model only
        out["decoder"] = describe(
            summary["family"],
            folder if cfg is not None else None,
            cfg.get("model_type") if cfg is not None else summary.get("model_type"),
        )
    if (
        any(getattr(args, k, None) is not None for k in ("gpu_mem", "ram", "device", "kv_budget", "quant"))
        and not args.plan
    ):
        args.plan = True  # a budget asks for the plan against it (was silently ignored)
    if args.plan and cfg is None:
        raise UsageError("--plan: a GGUF model runs on the CPU through llama.cpp; there is no device plan")
    if cfg is not None:
        out["cpu_precision"] = _cpu_precision(cfg, summary)
    if args.plan:
        from localdiff.quantize.recipe import recipe_for_model

        plan, choice = _plan(args, cfg, recipe_for_model(name))
        out["plan"] = plan.to_dict()
        out["plan_text"] = plan.to_text()
        out["precision_choice"] = choice
    if args.json:
        print_json(out)
        return 0
    sys.stdout.write(visible(f"{name}  ({source})") + "\n")
    print_tree(summary, "  ")
    if "decoder" in out:
        others = [d for d in out["decoder"]["decoders"] if d != out["decoder"]["policy"]]
        also = f"  (--decoder {' | '.join(others)} also runs)" if others else ""
        sys.stdout.write(f"\ndecoder: {out['decoder']['policy']}{also}\n")
        for key, o in out["decoder"]["options"].items():
            sys.stdout.write(
                visible(f"  {key} = {plain(o['value'])}  ({o['flag']}, {o['env']}; {o['allowed']})") + "\n"
            )
    if out.get("cpu_precision"):
        sys.stdout.write(f"\ncpu precision: {out['cpu_precision']['line']}\n")
    if args.plan:
        sys.stdout.write("\nmemory plan:\n" + out["plan_text"].rstrip("\n") + "\n")
        if out["precision_choice"]:
            sys.stdout.write(f"\nprecision (what pull and gen pick): {out['precision_choice']['line']}\n")
    return 0


def _plan(args, cfg: dict, recipe):
    """``show --plan``: the plan for ``--device`` (GPU: ``--gpu-mem``, else measured; CPU: ``--ram``, else
    measured; neither given and no GPU found: the CPU) in ``--quant`` (default int8), and the precision chooser's
    pick for the same machine (:func:`localdiff.quantize.fit.choose_precision`) as {precision, device, line}.
    Raises UsageError."""
    from localdiff.quantize.fit import choose_precision
    from localdiff.quantize.plan import plan_memory

    cpu = getattr(args, "device", None) == "cpu"
    if getattr(args, "device", None) is None and args.gpu_mem is None:
        from localdiff.hub.fit import gpu_mem_bytes

        cpu = not gpu_mem_bytes()  # no GPU here and no --gpu-mem: plan this machine's RAM
    if cpu and args.gpu_mem is not None:
        raise UsageError("--gpu-mem plans a GPU; with --device cpu give the RAM with --ram SIZE")
    ram = _size_flag(args.ram, "--ram") if getattr(args, "ram", None) is not None else None
    kv = _size_flag(args.kv_budget, "--kv-budget", 0) if getattr(args, "kv_budget", None) is not None else None
    if cpu:
        if ram is None:
            from localdiff.hub.fit import ram_bytes

            ram = ram_bytes()
            if not ram:
                raise UsageError("cannot measure this machine's RAM; give it with --ram SIZE (e.g. 32GiB)")
        plan = plan_memory(cfg, ram, args.quant or "int8", kv, recipe=recipe, device="cpu")
        gpu = 0
    else:
        gpu = _gpu_budget(args.gpu_mem)
        plan = plan_memory(cfg, gpu, args.quant or "int8", kv, recipe=recipe, ram_bytes=ram)
    if ram is None:
        from localdiff.hub.fit import ram_bytes

        ram = ram_bytes()
    c = choose_precision(cfg, gpu, ram, recipe=recipe, kv_budget_bytes=kv, cpu_fallback=cpu)
    line = f"{c.precision}: {c.reason}" if c.fits else f"none: needs {c.need_line()} ({c.reason})"
    return plan, {"precision": c.precision, "device": c.device, "line": line}


def _cpu_precision(cfg: dict, summary: dict) -> dict | None:
    """The CPU default dtype a load would pick and why (:func:`localdiff.capability.choose_cpu_dtype` without the
    GEMM probe: show stays torch-free; a load measures the speed-up and may still fall back to fp32)."""
    from localdiff.capability import choose_cpu_dtype, stored_dtype

    total = (summary.get("parameters") or {}).get("total") if isinstance(summary.get("parameters"), dict) else None
    p = choose_cpu_dtype(stored_dtype(cfg), total, measure=False)
    return {**p.to_dict(), "line": p.line()}
