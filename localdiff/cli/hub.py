"""Command handlers for ``pull``, ``list``, ``rm``, ``show``, ``config``, ``quantize`` and the ``chat`` hand-off.

Each ``run_*`` takes the parsed argparse namespace and returns an exit code; errors are raised as LocaldiffError
subclasses and printed by ``cli.main``. Tables and reports go to stdout; progress and warnings to stderr.
"""
from __future__ import annotations

import json
import sys

from localdiff.hub import catalog
from localdiff.hub import models as hub
from localdiff.config import config_path, load_user_config, sampler_overrides, with_flags
from localdiff.errors import LocaldiffError, UsageError
from localdiff.hub.progress import human_bytes
from localdiff.safetext import visible


def _print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def _table(rows: list[list[str]], header: list[str]) -> None:
    rows = [[visible(c) for c in r] for r in rows]  # names, quant labels, paths come from the cache / config.json
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        sys.stdout.write("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


def _gguf_name(name: str, quant: str | None) -> str:
    """``pull NAME --quant Q``: ``org/repo:Q`` for a repo, ``<alias>-q`` for a catalog alias. Raises UsageError."""
    from localdiff.hub.gguf_names import is_quant

    if quant is None:
        return name
    if not is_quant(quant):
        raise UsageError(f"--quant: {quant!r} is not a GGUF quantization label (e.g. Q4_K_M, Q8_0, F16)")
    return f"{name}-{quant.lower()}" if catalog.lookup(name) is not None else f"{name}:{quant.upper()}"


def run_pull(args) -> int:
    args.name = _gguf_name(args.name, getattr(args, "quant", None))
    try:
        res = hub.pull(args.name, quiet=args.quiet, verify=args.verify, check_space=getattr(args, "check_space", True),
                       force=getattr(args, "force", False))
    except KeyboardInterrupt:
        sys.stderr.write(f"interrupted; run `localdiff pull {args.name}` again to resume\n")
        return 130
    if res.get("embedded"):
        msg = f"{args.name} is embedded in localdiff; nothing to pull"
    elif res["up_to_date"]:
        msg = f"{args.name} is up to date ({res['repo']}@{res['commit'][:12]}, {human_bytes(res['total_bytes'])})"
        notes = [w for w in res.get("warnings", []) if w.startswith("offline")]
        msg += "".join(f"; {n}" for n in notes)
    else:
        msg = (f"pulled {args.name} ({res['repo']}@{res['commit'][:12]}): {res['files']} files, "
               f"{human_bytes(res['total_bytes'])}, {human_bytes(res['downloaded_bytes'])} downloaded "
               f"in {res['seconds']:.1f} s")
    if not args.quiet:
        sys.stderr.write(msg + "\n")
    return 0


def run_list(args) -> int:
    from localdiff.hub.hf_cache import check_cache_folders

    try:   # HF_HUB_CACHE naming a file listed the embedded models alone without a word (pull refuses it)
        check_cache_folders()
    except LocaldiffError as e:
        sys.stderr.write(visible(f"warning: {e}; only the embedded models are listed") + "\n")
    models = hub.list_models()
    if args.all:
        have = {m["name"] for m in models}
        for e in catalog.entries():
            if e.alias not in have:
                draft = catalog.is_draft({"model_type": e.model_type})
                models.append({"name": e.alias, "repo": e.repo, "revision": e.revision, "commit": None,
                               "size_bytes": e.approx_size_bytes, "quant": None, "path": None, "embedded": e.embedded,
                               "description": e.description, "pulled": False, "draft": draft,
                               **({"draft_for": catalog.draft_targets(e.alias)} if draft else {})})
    for m in models:
        m.setdefault("pulled", True)
        if m.get("changed"):
            sys.stderr.write(visible(f"warning: {m['name']}: {m['changed'][0]} changed on disk since it was verified; "
                                     f"run `localdiff pull {m['name']} --verify`") + "\n")
    if args.json:
        _print_json(models)
        return 0
    rows, drafts = [], []
    for m in models:
        where = "embedded" if m["embedded"] else (f"{m['repo']}@{(m['commit'] or m['revision'])[:12]}"
                                                  if m.get("commit") else f"{m['repo']}@{_short_rev(m['revision'])}")
        size = human_bytes(m["size_bytes"]) if m["size_bytes"] else "-"
        if not m["pulled"]:
            size = f"~{size} (not pulled)" if m["size_bytes"] else "(not pulled)"
        backend = m.get("backend") or "-"
        if m.get("engine"):                        # a GGUF file: the engine and its cache modes
            backend = f"{backend} ({m['engine']}; {m.get('cache', '')})"
        row = [m["name"], where, size, m.get("quant") or "-", backend, m.get("path") or "-"]
        if m.get("draft"):   # a DFlash draft runs only beside its target: listed apart, never as a model to run
            drafts.append([row[0], ", ".join(m.get("draft_for") or []) or "-", *row[1:]])
        else:
            rows.append(row)
    _table(rows, ["NAME", "SOURCE", "SIZE", "QUANT", "BACKEND", "PATH"])
    if drafts:
        sys.stdout.write("\nDFlash drafts (not run alone: gen -m TARGET --draft NAME):\n")
        _table(drafts, ["DRAFT", "FOR", "SOURCE", "SIZE", "QUANT", "BACKEND", "PATH"])
    return 0


def _short_rev(rev) -> str:
    """A pinned 40-hex commit as its first 12 digits, like a pulled one (``list --all``'s SOURCE column was 40
    characters wider for them); branch and tag names as they are. ``--json`` keeps the full revision."""
    rev = str(rev)
    return rev[:12] if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev) else rev


def run_rm(args) -> int:
    res = hub.remove(args.name)
    sys.stderr.write(f"removed {args.name} ({res['repo']}@{res['commit'][:12]}), freed "
                     f"{human_bytes(res['freed_bytes'])}\n")
    return 0


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
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_experts",
            "top_k_experts", "vocab_size", "max_position_embeddings")
    return {"model_type": cfg.get("model_type"), "canvas_length": cfg.get("canvas_length"),
            **{k: t.get(k) for k in keys if k in t}}


def _size_flag(text: str, flag: str) -> int:
    """A memory size flag's value in bytes (> 0). Raises UsageError naming the flag."""
    from localdiff.quantize.recipe import parse_bytes

    try:
        n = parse_bytes(text)
    except LocaldiffError as e:
        raise UsageError(f"{flag}: {e}") from None
    if n <= 0:
        raise UsageError(f"{flag} must be > 0")
    return n


def _gpu_budget(text: str | None) -> int:
    if text:
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
    from localdiff.backends.gguf_file import cache_modes, describe as read_gguf

    h, c = read_gguf(path)
    out = {"backend": "gguf (llama.cpp through llama-cpp-python)", "engine": "llama.cpp", "quant": c.quant,
           "family": c.family, "cache": cache_modes(c.family, c.architecture),
           "model_type": c.model_type, "gguf_architecture": c.architecture, "hidden_size": c.hidden_size,
           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "vocab_size": c.vocab_size,
           "max_position_embeddings": c.max_position_embeddings, "mask_token_id": c.mask_token_id,
           "eos_token_id": list(c.eos_token_id), "shift_logits": c.shift_logits, "file_bytes": h.file_size,
           "tensors": len(h.tensors)}
    if c.num_experts:
        out["experts"] = {"total": c.num_experts, "top_k": c.num_experts_per_tok}
    if c.family == "block":
        out.update(block_size=c.block_size, token_shift=c.token_shift)
    return out


def run_show(args) -> int:
    name = args.name if args.name is not None else load_user_config().default_model   # "" is refused, as for gen -m
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

    if has_decoder(summary.get("family")):   # a family whose decoders are not wired yet shows its model only
        out["decoder"] = describe(summary["family"], folder if cfg is not None else None,
                                  cfg.get("model_type") if cfg is not None else summary.get("model_type"))
    if any(getattr(args, k, None) is not None for k in ("gpu_mem", "ram", "device", "kv_budget", "quant")) \
            and not args.plan:
        args.plan = True                          # a budget asks for the plan against it (was silently ignored)
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
        _print_json(out)
        return 0
    sys.stdout.write(visible(f"{name}  ({source})") + "\n")
    _print_tree(summary, "  ")
    if "decoder" in out:
        others = [d for d in out["decoder"]["decoders"] if d != out["decoder"]["policy"]]
        also = f"  (--decoder {' | '.join(others)} also runs)" if others else ""
        sys.stdout.write(f"\ndecoder: {out['decoder']['policy']}{also}\n")
        for key, o in out["decoder"]["options"].items():
            sys.stdout.write(visible(f"  {key} = {_plain(o['value'])}  ({o['flag']}, {o['env']}; {o['allowed']})")
                             + "\n")
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

        cpu = not gpu_mem_bytes()              # no GPU here and no --gpu-mem: plan this machine's RAM
    if cpu and args.gpu_mem is not None:
        raise UsageError("--gpu-mem plans a GPU; with --device cpu give the RAM with --ram SIZE")
    ram = _size_flag(args.ram, "--ram") if getattr(args, "ram", None) is not None else None
    kv = _size_flag(args.kv_budget, "--kv-budget") if getattr(args, "kv_budget", None) is not None else None
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


def _plain(v, unset: str = "none") -> str:
    """A value as a user reads (and TOML writes) it: ``true`` / ``false``, ``unset`` for None, "(none)" for an empty
    table or list — never Python's ``None`` / ``True`` / ``{}``."""
    if v is None:
        return unset
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (dict, list, tuple)) and not v:
        return "(none)"
    return str(v)


def _print_tree(d: dict, indent: str, unset: str = "none") -> None:
    for k, v in d.items():
        if isinstance(v, dict) and v:
            sys.stdout.write(f"{indent}{visible(k)}:\n")
            _print_tree(v, indent + "  ", unset)
        else:
            sys.stdout.write(f"{indent}{visible(k)}: {visible(_plain(v, unset))}\n")


def run_config(args) -> int:
    if args.action == "path":
        sys.stdout.write(str(config_path()) + "\n")
        return 0
    cfg = load_user_config()
    d = cfg.as_dict()
    d["exists"] = bool(cfg.path and cfg.path.is_file())
    if args.json:
        _print_json(d)
    else:
        _print_tree(d, "", unset="(unset)")   # (unset): the engine's default applies
    return 0


def run_quantize(args) -> int:
    """``localdiff quantize`` (:mod:`localdiff.cli.quantize_cmd`)."""
    from localdiff.cli.quantize_cmd import run_quantize as run

    return run(args)


def run_chat_cmd(args) -> int:
    """Hand over to the Textual app (imported only here)."""
    if not args.list_only:
        try:
            tty = sys.stdout.isatty() and sys.stdin.isatty()
        except (AttributeError, ValueError):
            tty = False
        if not tty:
            raise UsageError("`localdiff chat` needs a terminal; for scripts and pipelines use `localdiff gen`")
    cfg = with_flags(load_user_config(), model=args.model, device=args.device, quant=args.quant,
                     max_new_tokens=args.max_new_tokens, seed=args.seed, threads=args.threads)
    from localdiff.cli.gen import _flags, _size

    if args.kv_budget is not None:   # was accepted and ignored
        raise UsageError("--kv-budget: localdiff chat does not apply a KV-cache budget yet (gen does)")
    gpu_mem = _size(args.gpu_mem, "--gpu-mem")

    options = sampler_overrides(_flags(args), cfg)
    from localdiff.cli.gen import flag_names
    from localdiff.decoding.options import check_overrides

    check_overrides(options, flag_names(_flags(args)))   # bad values were accepted and failed inside the chat
    for key in ("max_new_tokens", "seed"):  # flag > env > config file; chat-session settings (/set changes them)
        if getattr(cfg, key) is not None:
            options[key] = getattr(cfg, key)
    try:
        from localdiff.tui import run_chat
    except ImportError as e:
        raise LocaldiffError(f"`localdiff chat` is not available in this build ({e})") from None
    loader, model, default_model = None, args.model, cfg.default_model
    if getattr(args, "endpoint", None):
        from localdiff.backends.remote import base_url
        from localdiff.cli.remote import _api_key, endpoint_timeout, refuse_local_flags, remote_loader

        refuse_local_flags(args)   # as gen --endpoint (they were ignored)

        base_url(args.endpoint)  # a bad URL is a usage error before the UI starts
        loader = remote_loader(args.endpoint, _api_key(args), endpoint_timeout(args))
        model = args.model or ""  # "" = the server's first model
    elif args.model is not None and not args.model.strip():
        raise UsageError("empty model name")     # as gen -m '' ("" stands for the server's first model above)
    else:   # --draft / --gpu-mem / --threads reach the load; no thread count set anywhere: by model size ("auto")
        from localdiff.tui import app as tui_app

        loader = lambda name, device=None, quant=None: tui_app._default_loader(  # noqa: E731
            name, device=device, quant=quant, draft=args.draft, gpu_mem=gpu_mem, threads=cfg.threads or "auto",
            gpu_layers=getattr(args, "gpu_layers", None))
    # -m wins; without it a resumed conversation keeps its own model, else the configured default model
    return int(run_chat(model=model, default_model=default_model, resume=args.resume, list_only=args.list_only,
                        device=cfg.device, quant=cfg.quant, sampler_options=options, loader=loader,
                        config_file=str(cfg.path or config_path()), theme=cfg.theme) or 0)
