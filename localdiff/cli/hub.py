"""Command handlers for ``pull``, ``list``, ``rm``, ``config``, ``quantize`` and the ``chat`` hand-off (``show``:
:mod:`localdiff.cli.show`).

Each ``run_*`` takes the parsed argparse namespace and returns an exit code; errors are raised as LocaldiffError
subclasses and printed by ``cli.main``. Tables and reports go to stdout; progress and warnings to stderr.
"""

from __future__ import annotations

import sys

from localdiff.cli.output import print_json, print_tree, table
from localdiff.config import config_path, load_user_config, sampler_overrides, with_flags
from localdiff.hub import catalog
from localdiff.hub import models as hub
from localdiff.errors import LocaldiffError, UsageError
from localdiff.hub.progress import human_bytes
from localdiff.safetext import visible


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
        res = hub.pull(
            args.name,
            quiet=args.quiet,
            verify=args.verify,
            check_space=getattr(args, "check_space", True),
            force=getattr(args, "force", False),
        )
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
        msg = (
            f"pulled {args.name} ({res['repo']}@{res['commit'][:12]}): {res['files']} files, "
            f"{human_bytes(res['total_bytes'])}, {human_bytes(res['downloaded_bytes'])} downloaded "
            f"in {res['seconds']:.1f} s"
        )
    if not args.quiet:
        sys.stderr.write(msg + "\n")
    return 0


def run_list(args) -> int:
    from localdiff.hub.hf_cache import check_cache_folders

    try:  # HF_HUB_CACHE naming a file listed the embedded models alone without a word (pull refuses it)
        check_cache_folders()
    except LocaldiffError as e:
        sys.stderr.write(visible(f"warning: {e}; only the embedded models are listed") + "\n")
    models = hub.list_models()
    if args.all:
        have = {m["name"] for m in models}
        for e in catalog.entries():
            if e.alias not in have:
                draft = catalog.is_draft({"model_type": e.model_type})
                models.append(
                    {
                        "name": e.alias,
                        "repo": e.repo,
                        "revision": e.revision,
                        "commit": None,
                        "size_bytes": e.approx_size_bytes,
                        "quant": None,
                        "path": None,
                        "embedded": e.embedded,
                        "description": e.description,
                        "pulled": False,
                        "draft": draft,
                        **({"draft_for": catalog.draft_targets(e.alias)} if draft else {}),
                    }
                )
    for m in models:
        m.setdefault("pulled", True)
        if m.get("changed"):
            sys.stderr.write(
                visible(
                    f"warning: {m['name']}: {m['changed'][0]} changed on disk since it was verified; "
                    f"run `localdiff pull {m['name']} --verify`"
                )
                + "\n"
            )
    if args.json:
        print_json(models)
        return 0
    rows, drafts = [], []
    for m in models:
        where = (
            "embedded"
            if m["embedded"]
            else (
                f"{m['repo']}@{(m['commit'] or m['revision'])[:12]}"
                if m.get("commit")
                else f"{m['repo']}@{_short_rev(m['revision'])}"
            )
        )
        size = human_bytes(m["size_bytes"]) if m["size_bytes"] else "-"
        if not m["pulled"]:
            size = f"~{size} (not pulled)" if m["size_bytes"] else "(not pulled)"
        backend = m.get("backend") or "-"
        if m.get("engine"):  # a GGUF file: the engine and its cache modes
            backend = f"{backend} ({m['engine']}; {m.get('cache', '')})"
        row = [m["name"], where, size, m.get("quant") or "-", backend, m.get("path") or "-"]
        if m.get("draft"):  # a DFlash draft runs only beside its target: listed apart, never as a model to run
            drafts.append([row[0], ", ".join(m.get("draft_for") or []) or "-", *row[1:]])
        else:
            rows.append(row)
    table(rows, ["NAME", "SOURCE", "SIZE", "QUANT", "BACKEND", "PATH"])
    if drafts:
        sys.stdout.write("\nDFlash drafts (not run alone: gen -m TARGET --draft NAME):\n")
        table(drafts, ["DRAFT", "FOR", "SOURCE", "SIZE", "QUANT", "BACKEND", "PATH"])
    return 0


def _short_rev(rev) -> str:
    """A pinned 40-hex commit as its first 12 digits, like a pulled one (``list --all``'s SOURCE column was 40
    characters wider for them); branch and tag names as they are. ``--json`` keeps the full revision."""
    rev = str(rev)
    return rev[:12] if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev) else rev


def run_rm(args) -> int:
    res = hub.remove(args.name)
    sys.stderr.write(
        f"removed {args.name} ({res['repo']}@{res['commit'][:12]}), freed {human_bytes(res['freed_bytes'])}\n"
    )
    return 0


def run_config(args) -> int:
    if args.action == "path":
        sys.stdout.write(str(config_path()) + "\n")
        return 0
    cfg = load_user_config()
    d = cfg.as_dict()
    d["exists"] = bool(cfg.path and cfg.path.is_file())
    if args.json:
        print_json(d)
    else:
        print_tree(d, "", unset="(unset)")  # (unset): the engine's default applies
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
    cfg = with_flags(
        load_user_config(),
        model=args.model,
        device=args.device,
        quant=args.quant,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        threads=args.threads,
    )
    from localdiff.cli.gen import _flags, _size

    if args.kv_budget is not None:  # was accepted and ignored
        raise UsageError("--kv-budget: localdiff chat does not apply a KV-cache budget yet (gen does)")
    gpu_mem = _size(args.gpu_mem, "--gpu-mem", 1)

    options = sampler_overrides(_flags(args), cfg)
    from localdiff.cli.gen import flag_names
    from localdiff.decoding.options import check_overrides

    check_overrides(options, flag_names(_flags(args)))  # bad values were accepted and failed inside the chat
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

        refuse_local_flags(args)  # as gen --endpoint (they were ignored)

        base_url(args.endpoint)  # a bad URL is a usage error before the UI starts
        loader = remote_loader(args.endpoint, _api_key(args), endpoint_timeout(args))
        model = args.model or ""  # "" = the server's first model
    elif args.model is not None and not args.model.strip():
        raise UsageError("empty model name")  # as gen -m '' ("" stands for the server's first model above)
    else:  # --draft / --gpu-mem / --threads reach the load; no thread count set anywhere: by model size ("auto")
        from localdiff.tui import app as tui_app

        loader = lambda name, device=None, quant=None: tui_app._default_loader(  # noqa: E731
            name,
            device=device,
            quant=quant,
            draft=args.draft,
            gpu_mem=gpu_mem,
            threads=cfg.threads or "auto",
            gpu_layers=getattr(args, "gpu_layers", None),
        )
    # -m wins; without it a resumed conversation keeps its own model, else the configured default model
    return int(
        run_chat(
            model=model,
            default_model=default_model,
            resume=args.resume,
            list_only=args.list_only,
            device=cfg.device,
            quant=cfg.quant,
            sampler_options=options,
            loader=loader,
            config_file=str(cfg.path or config_path()),
            theme=cfg.theme,
        )
        or 0
    )
