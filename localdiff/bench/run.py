"""localdiff bench: speed and quality side by side with the reference (transformers), in one run.

Sections (``--only`` picks some; ``--eval`` alone = the eval section only; the first seven are in
:mod:`localdiff.bench.sections`):

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
import sys
import time
from pathlib import Path

from localdiff.bench.args import SECTIONS, _sections, build_parser, check_counts, check_inputs  # noqa: F401  (re-exported)
from localdiff.bench.sections import SECTION_FUNCTIONS, Ctx
from localdiff.errors import LocaldiffError, UsageError


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
    env = {
        "load_average_1min": load,
        "cpu_count": cores,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": threads,
        "cpu": cpu,
        "device": "cpu",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    from localdiff import __version__

    env["localdiff"] = __version__
    return env


def _own_file(ctx: Ctx, name: str) -> dict:
    """A section in its own file ``localdiff/bench/<name>.py``: its ``run(ctx)`` (``ctx.out``: the results JSON path,
    beside which a section may write files), else ``measure(quick, log)``."""
    from importlib import import_module

    mod = import_module(f"localdiff.bench.{name.replace('-', '_')}")
    return mod.run(ctx) if hasattr(mod, "run") else mod.measure(ctx.args.quick, log=ctx.log)


def _run_sections(ctx: Ctx, names: list[str], res: dict, out: Path, log) -> bool:
    """Run each section into ``res["sections"]``; True when one failed with an unexpected error."""
    failed = False
    ctx.out = out
    for name in names:
        t0 = time.perf_counter()
        try:
            if name == "sweep":
                sec = SECTION_FUNCTIONS["sweep"](
                    ctx, out.parent, out.stem, res["sections"].get("eval", {}).get("default")
                )
            else:
                fns = SECTION_FUNCTIONS
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
        if path.exists() and not path.is_file():  # /dev/full, a pipe: the results (and the .md beside) are lost
            raise UsageError(f"{flag} {path}: not a regular file; give a file name")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"{flag} {path}: cannot create {path.parent}: {e.strerror or e}") from None
        if not os.access(path.parent, os.W_OK):
            raise UsageError(f"{flag} {path}: {path.parent} is not writable")
    if readme is not None and not readme.is_file():
        raise UsageError(
            f"--readme: {readme} "
            + (
                "is a folder; give the README file"
                if readme.is_dir()
                else "does not exist"
                if not readme.exists()
                else "is not a file"
            )
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``localdiff bench``. Returns the exit code (1 when a section failed with an error)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    check_counts(args)  # before the outputs are created, the model read or any section run
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

    ctx = Ctx(args, log)
    res = {
        "quick": args.quick,
        "argv": list(argv or []),
        "environment": _environment(args.threads),
        "sections": {},
        "timings_s": {},
    }
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
