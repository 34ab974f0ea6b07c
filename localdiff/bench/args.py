"""``localdiff bench``'s command line: the section names and the argument parser (``localdiff/bench/run.py`` runs them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from localdiff.errors import UsageError
from localdiff.usage_parser import UsageParser as _Parser

SECTIONS = (
    "ref",
    "eval",
    "sweep",
    "history",
    "memory",
    "profile",
    "serve",
    "masked",
    "block",
    "scale",
    "approx",
    "gguf",
    "gguf-block",
    "slots",
    "nap",
    "dflash",
    "experts",
    "precision",
    "int4",
    "v2cache",
    "serve-batch",
    "serve-batch-canvas",
)


def _threads(value: str) -> int:
    """``--threads N``: 1 … 4 × the CPU count, as for ``localdiff gen`` (``setting_values.check_threads``)."""
    from localdiff.setting_values import check_threads

    return check_threads(value, "--threads")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="localdiff bench",
        description="localdiff bench: speed and quality side by side with the reference (transformers), in one run.",
    )
    p.add_argument("--quick", action="store_true", help="a smaller run of every section (≈ 2 min on 2 cores)")
    p.add_argument("--eval", action="store_true", help="only the embedded model's eval (accuracy per family + TPF)")
    p.add_argument("--only", help=f"comma-separated sections to run ({','.join(SECTIONS)})")
    p.add_argument("--model", default="tiny", help="the embedded model (alias or folder; default tiny)")
    p.add_argument("--eval-file", type=Path, help="held-out items (default: <model folder>/eval.jsonl)")
    p.add_argument("--per-family", type=int, help="eval items per family (default: quick 3, full all)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help="eval: max new tokens per item (default: the longest answer's canvases + one canvas)",
    )
    p.add_argument(
        "--random-model",
        type=Path,
        help="checkpoint folder to use as the random model of the reference comparison "
        "(default: build the wider tiny-random DiffusionGemma in a temp dir)",
    )
    p.add_argument(
        "--random-steps",
        type=int,
        default=4,
        help="denoising steps per canvas on the random model (random weights are chaotic past ~8)",
    )
    p.add_argument(
        "--ref-on",
        choices=["both", "embedded", "random"],
        default="both",
        help="models of the reference comparison (default both)",
    )
    p.add_argument(
        "--ld-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="localdiff's dtype in the reference comparison (the reference runs fp32; default float32)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        help="seeds per model in the reference comparison; seed bases of the "
        "precision section's paired eval (default quick 2, full 10)",
    )
    p.add_argument("--reps", type=int, help="repetitions per seed in the reference comparison")
    p.add_argument("--threads", type=_threads, default=2, help="torch.set_num_threads for the whole run (default 2)")
    p.add_argument("--batch-size", type=int, default=16, help="eval batch size (default 16)")
    p.add_argument("--history", help="comma-separated history lengths (default: quick 256,1024; full up to 8192)")
    p.add_argument("--out", type=Path, help="results JSON (default bench-results/bench-<time>.json)")
    p.add_argument("--md", type=Path, help="also write the Markdown report here")
    p.add_argument("--readme", type=Path, help="replace the bench section of this README (between markers)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot of the sweep")
    return p


def _sections(args) -> list[str]:
    if args.only is not None:
        names = [s.strip() for s in args.only.split(",") if s.strip()]
        if not names:
            raise UsageError(f"--only: name at least one section ({', '.join(SECTIONS)})")
        bad = [s for s in names if s not in SECTIONS]
        if bad:
            raise UsageError(f"unknown section {bad[0]!r} (choose from {', '.join(SECTIONS)})")
        return names
    return ["eval"] if args.eval else list(SECTIONS)


# Count flags and their meaning, for the one-line message (every one must be a positive integer).
_COUNTS = {
    "per_family": ("--per-family", "eval items per family"),
    "max_new_tokens": ("--max-new-tokens", "new tokens per eval item"),
    "random_steps": ("--random-steps", "denoising steps per canvas"),
    "seeds": ("--seeds", "seeds per model"),
    "reps": ("--reps", "repetitions per seed"),
    "batch_size": ("--batch-size", "eval items per batch"),
}


#: the longest ``--history`` (tokens): the catalog's longest context; 10⁸ asked for a 77 GB cache, 2⁶³ overflowed
MAX_HISTORY = 131_072


def check_counts(args) -> None:
    """Before anything runs or loads: every count flag is a positive integer and ``--history`` is a comma-separated
    list of positive token counts. Unchecked, ``--reps -1`` ended in an IndexError in a section, ``--history -5`` in
    "negative dimension", ``--max-new-tokens 0`` ran the full eval as if unset and ``--random-steps 0`` skipped its
    section with exit 0.

    Raises:
        UsageError: naming the flag and the range, e.g. ``--reps: must be a positive integer (repetitions per seed;
            got -1)``.
    """
    for attr, (flag, what) in _COUNTS.items():
        v = getattr(args, attr)
        if v is not None and v < 1:
            raise UsageError(f"{flag}: must be a positive integer ({what}; got {v})")
    if args.history is not None:
        parts = [s.strip() for s in args.history.split(",")]
        for s in parts:
            if not (s.isascii() and s.isdigit()) or not 1 <= int(s) <= MAX_HISTORY:
                raise UsageError(
                    f"--history: must be comma-separated integers from 1 to {MAX_HISTORY:,} (history lengths in "
                    f"tokens, e.g. 256,1024; got {args.history!r})"
                )
        args.history = ",".join(parts)


def check_inputs(args) -> None:
    """Before any section runs: the files and the model named on the command line are there. A section that cannot
    run is otherwise "skipped" in the report with exit 0 (``--eval --eval-file /dev/zero`` ended 0, ``--model
    nonexistent --quick`` ran every other section for minutes first).

    Raises:
        UsageError: ``--eval-file`` not a regular file, ``--readme`` missing or with one bench marker of the two,
            ``--random-model`` not a checkpoint folder.
        ModelNotFoundError / UsageError / CheckpointError: ``--model`` names no model or a folder that is no
            checkpoint (as ``localdiff gen -m``), or a model of another family than DiffusionGemma.
    """
    if args.eval_file is not None and not args.eval_file.is_file():
        what = (
            "is a folder"
            if args.eval_file.is_dir()
            else "does not exist"
            if not args.eval_file.exists()
            else "is not a regular file"
        )
        raise UsageError(f"--eval-file {args.eval_file}: {what}; give a JSONL file of eval items")
    if args.readme is not None:  # the markers checked now, not after the sections ran
        from localdiff.bench.report import END, START

        if not args.readme.is_file():
            raise UsageError(f"--readme: {args.readme} does not exist")
        text = args.readme.read_text(encoding="utf-8", errors="replace")
        if (START in text) != (END in text):
            have, lack = (START, END) if START in text else (END, START)
            raise UsageError(f"--readme: {args.readme} has {have} but no {lack}; add it where the section ends")
    if args.random_model is not None and not (args.random_model / "config.json").is_file():
        raise UsageError(f"--random-model {args.random_model}: not a checkpoint folder (no config.json)")
    import localdiff
    from localdiff.errors import CheckpointError
    from localdiff.loader import load_config

    folder = localdiff._resolve_path(args.model)[0]  # an unknown name, a missing folder: the line gen -m gives
    try:
        mod, _ = load_config(folder)
    except CheckpointError as e:
        raise CheckpointError(f"--model {args.model}: {e}") from None
    arch = mod.__name__.rsplit(".", 1)[-1]
    if arch != "diffusion_gemma":  # eval, sweep, ref, ... read canvas fields (tiny-mdm: an AttributeError)
        raise UsageError(
            f"--model {args.model}: a {arch} checkpoint; --model runs a DiffusionGemma model such as "
            "tiny (the other families have their own sections: --only masked, block, slots, nap, dflash)"
        )
