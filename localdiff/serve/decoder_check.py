"""``serve --decoder NAME`` (or ``LOCALDIFF_DECODER``): the decoder applies to every served model that can run it;
when none of the offered models can, the server refuses to start (it started and ran every request with each model's
own decoder, the option silently unused)."""

from __future__ import annotations

import json
from pathlib import Path

from localdiff.errors import LocaldiffError, UsageError


def model_decoders(name: str) -> tuple[str, list[str]] | None:
    """(what to call it, the decoders it can run — its own first) for a served model name or path, read from its
    config.json without loading weights; None when that cannot be told here (a GGUF file, a model not there: its
    load reports that)."""
    import localdiff
    from localdiff.arch import entry_for
    from localdiff.decoding.options import policy_for_family, runnable
    from localdiff.loader import gguf_target

    try:
        if gguf_target(name) is not None:
            return None
        folder = localdiff._resolve_path(name)[0]
        model_type = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")).get("model_type")
        family = entry_for(model_type).family
    except (LocaldiffError, OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    return name, runnable(family, policy_for_family(family, model_type))


def check_decoder(decoder: str, models: list[str], where: str) -> None:
    """Refuse ``decoder`` given for this run (``where``: "--decoder" or "LOCALDIFF_DECODER") when none of ``models``
    (the ``-m`` models, else the default model) can run it; models whose decoders cannot be told are skipped.

    Raises:
        UsageError: ``"--decoder: none of the served models can run llada (tiny runs canvas_eb)"``.
    """
    known = [m for m in (model_decoders(n) for n in models) if m is not None]
    if not known or any(decoder in d for _, d in known):
        return
    runs = "; ".join(f"{n} runs {', '.join(d)}" for n, d in known)
    raise UsageError(f"{where}: none of the served models can run the decoder {decoder} ({runs})")
