"""The sections ``localdiff bench`` runs from its own driver — ``ref``, ``eval``, ``sweep``, ``history``, ``memory``,
``profile`` and ``serve`` (:data:`SECTION_FUNCTIONS`; each built on its helper module: ``ref.py``, ``eval_tasks.py``,
``history.py``, ``memory.py``, ``serve.py``) — their quick / full sizes, and the context every section shares
(:class:`Ctx`: the embedded model and its eval items, loaded once; the random models, built once).
:mod:`localdiff.bench.run` runs them and the sections in their own files."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from localdiff.errors import LocaldiffError

# (quick, full) sizes
SIZES = {
    "ref_seeds": (3, 5),
    "ref_reps": (3, 5),
    "ref_canvases": (2, 4),
    "eval_per_family": (3, None),
    "sweep_per_family": (3, 20),
    "history": ([256, 1024], [256, 1024, 4096, 8192]),
    "history_steps": (5, 7),
    "history_recompute": (1, 3),
    "memory": (
        [("float32", "none"), ("bfloat16", "none"), ("float32", "int8")],
        [("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("bfloat16", "int8")],
    ),
}


def _size(args, key):
    """The quick or full value of ``SIZES[key]`` (``--quick``)."""
    return SIZES[key][0 if args.quick else 1]


class Ctx:
    """Lazily loaded embedded model and its eval items, shared by the sections."""

    def __init__(self, args, log):
        self.args, self.log, self._m = args, log, None

    def model(self):
        if self._m is None:
            import localdiff

            self._m = localdiff.load(self.args.model, device="cpu", dtype="float32")
        return self._m

    def wide_path(self):
        """Folder of the wider tiny-random DiffusionGemma (``--random-model`` or built once, removed at exit)."""
        if self.args.random_model is not None:
            return Path(self.args.random_model)
        if getattr(self, "_wide", None) is None:
            from localdiff.bench import ref as bench_ref

            self.log("building the wider tiny-random DiffusionGemma")
            self._wide = bench_ref.build_random()
        return self._wide

    def wide_label(self) -> str:
        return f"random ({self.args.random_model.name})" if self.args.random_model else "tiny-random (wider)"

    def proportioned_path(self):
        """Folder of the random model with the 26B-A4B's attention proportions (built once, removed at exit)."""
        if getattr(self, "_prop", None) is None:
            from localdiff.bench import ref as bench_ref

            self.log("building the flagship-proportioned random DiffusionGemma (~65M parameters)")
            self._prop = bench_ref.build_random(text=bench_ref.PROPORTIONED_TEXT)
        return self._prop

    def cleanup(self):
        for d in (getattr(self, "_wide", None), getattr(self, "_prop", None)):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)

    def items(self, per_family):
        from localdiff.bench.eval_tasks import load_items

        return load_items(self.args.eval_file or (self.model().path / "eval.jsonl"), per_family)


def _ref(ctx: Ctx) -> dict:
    from localdiff.bench import ref as bench_ref

    why = bench_ref.transformers_available()
    if why:
        return {"skipped": why}
    a, out = (
        ctx.args,
        {
            "runs": [],
            "notes": [
                "ratio = localdiff tokens/s ÷ reference tokens/s per repetition (interleaved, alternating order); "
                "ms/step = wall time ÷ decoder forwards (includes prefill and the sampler)"
            ],
        },
    )
    seeds = list(range(a.seeds or _size(a, "ref_seeds")))
    reps = a.reps or _size(a, "ref_reps")
    m = None
    if a.ref_on in ("both", "embedded"):
        try:
            m = ctx.model()
        except LocaldiffError as e:
            out["notes"].append(f"embedded model skipped: {e}")
    if m is not None:
        items = ctx.items(None)
        by_fam = {}
        for it in items:  # one prompt per family first, so the seeds cover different tasks
            by_fam.setdefault(it["family"], it)
        prompts = [m.encode_prompt(it["prompt"], chat=True)[0] for it in list(by_fam.values()) + items][: len(seeds)]
        n_new = m.config.canvas_length * _size(a, "ref_canvases")
        ctx.log(f"ref: embedded model {m.path} ({len(seeds)} seeds × {reps} repetitions)")
        out["runs"].append(
            bench_ref.compare(
                m.path, "embedded (" + str(a.model) + ")", prompts, seeds, reps, n_new, None, ctx.log, a.ld_dtype
            )
        )
    if a.ref_on == "embedded":
        return out
    path, label = ctx.wide_path(), ctx.wide_label()
    cfg = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    vocab = int((cfg.get("text_config") or cfg)["vocab_size"])
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(24)] for _ in seeds]
    ctx.log(f"ref: random model {path} ({len(seeds)} seeds × {reps} repetitions, {a.random_steps} steps)")
    out["runs"].append(
        bench_ref.compare(
            path,
            label,
            prompts,
            seeds,
            reps,
            int(cfg.get("canvas_length") or 256) * _size(a, "ref_canvases"),
            a.random_steps,
            ctx.log,
            a.ld_dtype,
        )
    )
    return out


def _eval(ctx: Ctx) -> dict:
    from localdiff.bench.eval_tasks import evaluate

    a = ctx.args
    items = ctx.items(a.per_family if a.per_family is not None else _size(a, "eval_per_family"))
    ctx.log(f"eval: {len(items)} items, default sampler")
    r = evaluate(ctx.model(), items, seed=0, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens)
    for fam, v in r["per_family"].items():
        ctx.log(f"  {fam:14s} {v['accuracy']:6.1%}  ({v['correct']}/{v['n']})  TPF {v['tpf']:.2f}")
    ctx.log(f"  {'overall':14s} {r['accuracy']:6.1%}  ({r['correct']}/{r['n']})  TPF {r['tpf']:.2f}")
    return {"default": r}


def _sweep(ctx: Ctx, out_dir: Path, stem: str, default: dict | None) -> dict:
    from localdiff.bench import eval_tasks as be

    a, m = ctx.args, ctx.model()
    per = _size(a, "sweep_per_family")
    items = ctx.items(per)
    defaults = m.sampler_options()
    settings = [
        s for s in be.sweep_settings(a.quick, defaults["max_denoising_steps"]) if m.sampler_options(**s) != defaults
    ]  # the default point runs once, as "default"
    ctx.log(f"sweep: {len(settings)} settings × {len(items)} items")
    same = default is not None and default.get("items_digest") == be.items_digest(items)
    base = default if same else be.evaluate(m, items, seed=0, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens)
    rows = [
        {
            "setting": {},
            "label": "default",
            "accuracy": base["accuracy"],
            "tpf": base["tpf"],
            "seconds": base["seconds"],
            "per_family": {k: v["accuracy"] for k, v in base["per_family"].items()},
        }
    ]
    rows += be.run_sweep(m, items, settings, 0, a.batch_size, ctx.log, a.max_new_tokens)
    best = be.best_point(rows, len(items))
    ctx.log(f"  best accuracy-per-TPF point: {best['label']} (accuracy {best['accuracy']:.1%}, TPF {best['tpf']:.2f})")
    sec = {"items": len(items), "per_family": per, "rows": rows, "best": best, "default_sampler": base["sampler"]}
    if not a.no_plot:
        png = out_dir / f"{stem}-sweep.png"
        why = be.plot(rows, rows[0], png, set(best["pareto"]) | {best["label"]})
        if why:
            ctx.log(f"  {why}")
            sec["plot_skipped"] = why
        else:
            sec["plot"] = str(png)
    return sec


def _history(ctx: Ctx) -> dict:
    from localdiff.bench import ref as bench_ref
    from localdiff.bench.history import history_scaling

    a = ctx.args
    lengths = [int(x) for x in a.history.split(",")] if a.history else _size(a, "history")
    ctx.log(f"history: {lengths} tokens")
    sec = history_scaling(ctx.model(), lengths, _size(a, "history_steps"), _size(a, "history_recompute"), log=ctx.log)
    sec["model"] = f"embedded ({a.model})"
    sec["others"] = []
    others = []
    have_ref = bench_ref.transformers_available() is None  # the random models are built with transformers
    if have_ref or a.random_model is not None:
        others.append((ctx.wide_label(), ctx.wide_path))
    if have_ref and not a.quick:
        others.append(
            (
                "random, DiffusionGemma-26B-A4B's proportions (~65M parameters; 8k attention ≈ 0.19 of a "
                "token's other FLOPs)",
                ctx.proportioned_path,
            )
        )
    import localdiff

    for label, where in others:
        ctx.log(f"history: {label}")
        r = history_scaling(
            localdiff.load(where(), device="cpu", dtype="float32"), lengths, _size(a, "history_steps"), 1, log=ctx.log
        )
        r["model"] = label
        sec["others"].append(r)
    return sec


def _memory(ctx: Ctx) -> dict:
    import torch

    from localdiff.bench.memory import measure

    path = ctx.model().path
    plans = [(d, q, "cpu") for d, q in _size(ctx.args, "memory")]
    if torch.cuda.is_available():
        plans += [(d, q, "cuda") for d, q in _size(ctx.args, "memory")]
    rows = []
    for d, q, dev in plans:
        r = measure(path, d, q, dev)
        ctx.log(
            f"memory: {d} {q} {dev}: "
            + (
                f"skipped ({r['skipped']})"
                if "skipped" in r
                else f"weights {r['weight_bytes'] / 2**20:.1f} MiB, "
                f"peak RSS {r['peak_rss_after_generate'] / 2**20:.0f} MiB"
            )
        )
        rows.append(r)
    return {"rows": rows}


def _profile(ctx: Ctx) -> dict:
    from localdiff.bench.history import profile_generate

    m = ctx.model()
    item = ctx.items(1)[0]
    ids = m.encode_prompt(item["prompt"], chat=True)[0]
    ctx.log("profile: one generation of the embedded model")
    return profile_generate(m, ids, seed=0, max_new_tokens=2 * m.config.canvas_length)


def _serve(ctx: Ctx) -> dict:
    from localdiff.bench.serve import measure

    m = ctx.model()
    seeds, reps, secs = ((0, 1), 3, 0.0) if ctx.args.quick else ((0, 1, 2), 10, 12.0)
    return measure(m, "What is 27 + 58?", seeds=seeds, reps=reps, log=ctx.log, min_seconds=secs)


#: section name → its function here (``sweep`` takes the results file's folder and stem and the eval section too)
SECTION_FUNCTIONS = {
    "ref": _ref,
    "eval": _eval,
    "sweep": _sweep,
    "history": _history,
    "memory": _memory,
    "profile": _profile,
    "serve": _serve,
}
