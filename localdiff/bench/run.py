"""localdiff bench: speed and quality side by side with the reference (transformers), in one run.

Sections (``--only`` picks some; ``--eval`` alone = the eval section only):

* ``ref``     localdiff vs transformers' ``DiffusionGemmaForBlockDiffusion.generate`` on the embedded model and on a
              wider tiny-random DiffusionGemma: tokens/s, decoder forwards, TPF, ms per denoising step, speed ratio
              (counted only for seeds whose tokens are identical), median and range over repetitions
              (``localdiff/bench/ref.py``). Needs transformers (test / bench dependency); skipped otherwise.
* ``eval``    the embedded model's exact match per task family on its held-out ``eval.jsonl``, default sampler, + TPF.
* ``sweep``   accuracy and TPF across entropy bound × threshold τ × correction × step caps; best accuracy-per-TPF
              point; PNG plot when matplotlib is installed (``localdiff/bench/eval_tasks.py``).
* ``history`` ms per denoising step at 256 … 8k tokens of history: block cache vs recomputing the prefix every step;
              offload budget zero vs unlimited (``localdiff/bench/history.py``).
* ``memory``  peak RSS of fp32 / bf16 / int8 loads, each in a fresh process; weight bytes; CUDA peak on a GPU.
* ``profile`` torch.profiler over one generation of the embedded model: top ops, time split denoise/prefill/loop.
* ``serve``   time to first byte and tokens/s through ``localdiff serve`` vs in-process on the same prompt and seeds
              (``localdiff/bench/serve.py``).
* sections in their own files ``localdiff/bench/<name>.py`` (``run(ctx)`` or ``measure(quick, log)``, and
  ``render_md``): ``masked`` (cache modes, threshold decoding, tiny-mdm accuracy), ``block`` (SDAR-shaped block step
  vs AR step), ``scale`` / ``approx`` (flagship-proportioned sizes, self-conditioning approximations), ``gguf``
  (llama.cpp backend vs llama.cpp's own diffusion loop), ``slots`` (ReFusion), ``nap`` (ARness and NAP decoding),
  ``dflash`` (speculative decoding), ``experts`` (the bf16 MoE experts alone, native vs torch), ``v2cache``
  (Fast-dLLM v2's step time without / with its sub-block cache); the list is
  :data:`localdiff.bench.args.SECTIONS`.

Output: JSON (``--out``, default ``bench-results/bench-<time>.json``), a Markdown report printed and written next to
it (and to ``--md``), and ``--readme FILE`` replaces the text between ``<!-- bench:start -->`` and
``<!-- bench:end -->``. ``--quick`` runs a smaller version of every section (≈ 2 minutes on 2 CPU cores).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path

from localdiff.bench.args import SECTIONS, _sections, build_parser, check_inputs  # noqa: F401  (re-exported)
from localdiff.errors import LocaldiffError, UsageError

# (quick, full) sizes
SIZES = {
    "ref_seeds": (3, 5), "ref_reps": (3, 5), "ref_canvases": (2, 4),
    "eval_per_family": (3, None), "sweep_per_family": (3, 20),
    "history": ([256, 1024], [256, 1024, 4096, 8192]), "history_steps": (5, 7), "history_recompute": (1, 3),
    "memory": ([("float32", "none"), ("bfloat16", "none"), ("float32", "int8")],
               [("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("bfloat16", "int8")]),
}


def _size(args, key):
    return SIZES[key][0 if args.quick else 1]


def _environment(threads: int) -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        load = None
    cores = os.cpu_count() or 1
    env = {"load_average_1min": load, "cpu_count": cores,
           "date": _dt.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
           "torch": torch.__version__, "threads": threads, "cpu": cpu, "device": "cpu",
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    from localdiff import __version__

    env["localdiff"] = __version__
    return env


class _Ctx:
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


def _ref(ctx: _Ctx) -> dict:
    from localdiff.bench import ref as bench_ref

    why = bench_ref.transformers_available()
    if why:
        return {"skipped": why}
    a, out = ctx.args, {"runs": [], "notes": [
        "ratio = localdiff tokens/s ÷ reference tokens/s per repetition (interleaved, alternating order); "
        "ms/step = wall time ÷ decoder forwards (includes prefill and the sampler)"]}
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
        prompts = [m.encode_prompt(it["prompt"], chat=True)[0] for it in list(by_fam.values()) + items][:len(seeds)]
        n_new = m.config.canvas_length * _size(a, "ref_canvases")
        ctx.log(f"ref: embedded model {m.path} ({len(seeds)} seeds × {reps} repetitions)")
        out["runs"].append(bench_ref.compare(m.path, "embedded (" + str(a.model) + ")", prompts, seeds, reps, n_new,
                                             None, ctx.log, a.ld_dtype))
    if a.ref_on == "embedded":
        return out
    path, label = ctx.wide_path(), ctx.wide_label()
    cfg = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    vocab = int((cfg.get("text_config") or cfg)["vocab_size"])
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(24)] for _ in seeds]
    ctx.log(f"ref: random model {path} ({len(seeds)} seeds × {reps} repetitions, {a.random_steps} steps)")
    out["runs"].append(bench_ref.compare(path, label, prompts, seeds, reps,
                                         int(cfg.get("canvas_length") or 256) * _size(a, "ref_canvases"),
                                         a.random_steps, ctx.log, a.ld_dtype))
    return out


def _eval(ctx: _Ctx) -> dict:
    from localdiff.bench.eval_tasks import evaluate

    a = ctx.args
    items = ctx.items(a.per_family if a.per_family is not None else _size(a, "eval_per_family"))
    ctx.log(f"eval: {len(items)} items, default sampler")
    r = evaluate(ctx.model(), items, seed=0, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens)
    for fam, v in r["per_family"].items():
        ctx.log(f"  {fam:14s} {v['accuracy']:6.1%}  ({v['correct']}/{v['n']})  TPF {v['tpf']:.2f}")
    ctx.log(f"  {'overall':14s} {r['accuracy']:6.1%}  ({r['correct']}/{r['n']})  TPF {r['tpf']:.2f}")
    return {"default": r}


def _sweep(ctx: _Ctx, out_dir: Path, stem: str, default: dict | None) -> dict:
    from localdiff.bench import eval_tasks as be

    a, m = ctx.args, ctx.model()
    per = _size(a, "sweep_per_family")
    items = ctx.items(per)
    defaults = m.sampler_options()
    settings = [s for s in be.sweep_settings(a.quick, defaults["max_denoising_steps"])
                if m.sampler_options(**s) != defaults]  # the default point runs once, as "default"
    ctx.log(f"sweep: {len(settings)} settings × {len(items)} items")
    same = default is not None and default.get("items_digest") == be.items_digest(items)
    base = default if same else be.evaluate(m, items, seed=0, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens)
    rows = [{"setting": {}, "label": "default", "accuracy": base["accuracy"], "tpf": base["tpf"],
             "seconds": base["seconds"], "per_family": {k: v["accuracy"] for k, v in base["per_family"].items()}}]
    rows += be.run_sweep(m, items, settings, 0, a.batch_size, ctx.log, a.max_new_tokens)
    best = be.best_point(rows, len(items))
    ctx.log(f"  best accuracy-per-TPF point: {best['label']} (accuracy {best['accuracy']:.1%}, TPF {best['tpf']:.2f})")
    sec = {"items": len(items), "per_family": per, "rows": rows, "best": best,
           "default_sampler": base["sampler"]}
    if not a.no_plot:
        png = out_dir / f"{stem}-sweep.png"
        why = be.plot(rows, rows[0], png, set(best["pareto"]) | {best["label"]})
        if why:
            ctx.log(f"  {why}")
            sec["plot_skipped"] = why
        else:
            sec["plot"] = str(png)
    return sec


def _history(ctx: _Ctx) -> dict:
    from localdiff.bench import ref as bench_ref
    from localdiff.bench.history import history_scaling

    a = ctx.args
    lengths = [int(x) for x in a.history.split(",")] if a.history else _size(a, "history")
    ctx.log(f"history: {lengths} tokens")
    sec = history_scaling(ctx.model(), lengths, _size(a, "history_steps"), _size(a, "history_recompute"),
                          log=ctx.log)
    sec["model"] = f"embedded ({a.model})"
    sec["others"] = []
    others = []
    have_ref = bench_ref.transformers_available() is None   # the random models are built with transformers
    if have_ref or a.random_model is not None:
        others.append((ctx.wide_label(), ctx.wide_path))
    if have_ref and not a.quick:
        others.append(("random, DiffusionGemma-26B-A4B's proportions (~65M parameters; 8k attention ≈ 0.19 of a "
                       "token's other FLOPs)", ctx.proportioned_path))
    import localdiff

    for label, where in others:
        ctx.log(f"history: {label}")
        r = history_scaling(localdiff.load(where(), device="cpu", dtype="float32"), lengths,
                            _size(a, "history_steps"), 1, log=ctx.log)
        r["model"] = label
        sec["others"].append(r)
    return sec


def _memory(ctx: _Ctx) -> dict:
    import torch

    from localdiff.bench.memory import measure

    path = ctx.model().path
    plans = [(d, q, "cpu") for d, q in _size(ctx.args, "memory")]
    if torch.cuda.is_available():
        plans += [(d, q, "cuda") for d, q in _size(ctx.args, "memory")]
    rows = []
    for d, q, dev in plans:
        r = measure(path, d, q, dev)
        ctx.log(f"memory: {d} {q} {dev}: " + (f"skipped ({r['skipped']})" if "skipped" in r else
                f"weights {r['weight_bytes'] / 2**20:.1f} MiB, "
                f"peak RSS {r['peak_rss_after_generate'] / 2**20:.0f} MiB"))
        rows.append(r)
    return {"rows": rows}


def _profile(ctx: _Ctx) -> dict:
    from localdiff.bench.history import profile_generate

    m = ctx.model()
    item = ctx.items(1)[0]
    ids = m.encode_prompt(item["prompt"], chat=True)[0]
    ctx.log("profile: one generation of the embedded model")
    return profile_generate(m, ids, seed=0, max_new_tokens=2 * m.config.canvas_length)


def _serve(ctx: _Ctx) -> dict:
    from localdiff.bench.serve import measure

    m = ctx.model()
    seeds, reps, secs = ((0, 1), 3, 0.0) if ctx.args.quick else ((0, 1, 2), 10, 12.0)
    return measure(m, "What is 27 + 58?", seeds=seeds, reps=reps, log=ctx.log, min_seconds=secs)


def _own_file(ctx: _Ctx, name: str) -> dict:
    """A section in its own file ``localdiff/bench/<name>.py``: its ``run(ctx)`` (``ctx.out``: the results JSON path,
    beside which a section may write files), else ``measure(quick, log)``."""
    from importlib import import_module

    mod = import_module(f"localdiff.bench.{name.replace('-', '_')}")
    return mod.run(ctx) if hasattr(mod, "run") else mod.measure(ctx.args.quick, log=ctx.log)


def _run_sections(ctx: _Ctx, names: list[str], res: dict, out: Path, log) -> bool:
    """Run each section into ``res["sections"]``; True when one failed with an unexpected error."""
    failed = False
    ctx.out = out
    for name in names:
        t0 = time.perf_counter()
        try:
            if name == "sweep":
                sec = _sweep(ctx, out.parent, out.stem, res["sections"].get("eval", {}).get("default"))
            else:
                fns = {"ref": _ref, "eval": _eval, "history": _history, "memory": _memory, "profile": _profile,
                       "serve": _serve}
                sec = fns[name](ctx) if name in fns else _own_file(ctx, name)
        except LocaldiffError as e:
            sec = {"skipped": str(e)}
            log(f"{name}: skipped ({e})")
        except Exception as e:  # a broken section must not hide the others' results
            sec = {"skipped": f"error: {type(e).__name__}: {e}"}
            failed = True
            log(f"{name}: ERROR {type(e).__name__}: {e}")
        res["sections"][name] = sec
        res["timings_s"][name] = time.perf_counter() - t0
    return failed


def _check_outputs(out: Path, md: Path | None, readme: Path | None) -> None:
    """Before any section runs (a run can take an hour): the result files can be written and ``--readme`` is a file.

    Raises:
        UsageError: naming the flag and the path.
    """
    for flag, path in (("--out", out), ("--md", md)):
        if path is None:
            continue
        if path.is_dir():
            raise UsageError(f"{flag} {path}: is a folder; give a file name")
        if path.exists() and not path.is_file():   # /dev/full, a pipe: the results (and the .md beside) are lost
            raise UsageError(f"{flag} {path}: not a regular file; give a file name")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"{flag} {path}: cannot create {path.parent}: {e.strerror or e}") from None
        if not os.access(path.parent, os.W_OK):
            raise UsageError(f"{flag} {path}: {path.parent} is not writable")
    if readme is not None and not readme.is_file():
        raise UsageError(f"--readme: {readme} " + ("is a folder; give the README file" if readme.is_dir() else
                                                   "does not exist" if not readme.exists() else "is not a file"))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``localdiff bench``. Returns the exit code (1 when a section failed with an error)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be ≥ 1 (got {args.batch_size})")
    import torch

    from localdiff.bench.report import render, replace_readme_section

    torch.set_num_threads(args.threads)
    names = _sections(args)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or Path("bench-results") / f"bench-{stamp}.json"
    _check_outputs(out, args.md, args.readme)
    check_inputs(args)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    ctx = _Ctx(args, log)
    res = {"quick": args.quick, "argv": list(argv or []), "environment": _environment(args.threads),
           "sections": {}, "timings_s": {}}
    t_all, failed = time.perf_counter(), False
    try:
        failed = _run_sections(ctx, names, res, out, log)
    finally:
        ctx.cleanup()
    res["duration_s"] = time.perf_counter() - t_all
    md = render(res)
    out.write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    md_path = out.with_suffix(".md")
    md_path.write_text(md, encoding="utf-8")
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(md, encoding="utf-8")
    print(md)
    if args.readme:
        if not replace_readme_section(args.readme, md):
            log(f"{args.readme}: no bench markers; appended a Benchmarks section")
    log(f"results: {out} and {md_path} ({res['duration_s']:.0f} s)")
    return 1 if failed else 0
