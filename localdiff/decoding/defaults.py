"""Decoder options seen from a checkpoint: the ``generation_config.json`` defaults and ``localdiff show``'s decoder
section, both derived from the one schema (:mod:`localdiff.decoding.options`)."""

from __future__ import annotations

import json
from pathlib import Path

from localdiff.decoding.options import DECODER, POLICIES, all_specs, policy_for_family, runnable


def read_generation_config(path: Path) -> dict:
    """Decoder defaults and special ids from a checkpoint's ``generation_config.json`` (missing / bad file → {}):
    every option whose ``gen_key`` is present (DiffusionGemma's ``sampler_config.entropy_bound`` too), plus
    ``eos_token_id``, ``pad_token_id``, ``max_new_tokens``."""
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return {}
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return {}
    if not isinstance(raw, dict):
        return {}
    out = {s.name: raw[s.gen_key] for s in all_specs() if s.gen_key and raw.get(s.gen_key) is not None}
    sc = raw.get("sampler_config")
    if isinstance(sc, dict) and sc.get("entropy_bound") is not None:
        out["entropy_bound"] = sc["entropy_bound"]
    for k in ("eos_token_id", "pad_token_id", "max_new_tokens"):
        if raw.get(k) is not None:
            out[k] = raw[k]
    return out


def describe(family: str, folder: Path | None, model_type: str | None = None, decoder: str | None = None) -> dict:
    """``localdiff show``'s decoder section: the decoder a model of ``family`` (and ``model_type``: the pulled
    config's, else the one given — a stand-in config's, or a GGUF file's metadata) runs — ``decoder`` when given and
    runnable, else the one its generation_config names, else its own — the decoders it can run, and per option of
    that decoder its effective default (built-in < the checkpoint's generation_config), flag, environment variable,
    allowed values and help."""
    if folder is not None and (Path(folder) / "config.json").is_file():
        try:
            model_type = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (json.JSONDecodeError, UnicodeDecodeError, OSError, AttributeError):
            pass
    gen = read_generation_config(folder) if folder is not None else {}
    own = policy_for_family(family, model_type)
    decoders = runnable(family, own)
    name = next((d for d in (decoder, gen.get(DECODER)) if d in decoders), own)
    cls = POLICIES[name]
    if name != own:  # as the engine does: the model's own decoder's values do not carry over
        gen = {k: v for k, v in gen.items() if k not in POLICIES[own].names()}
    opts = {}
    for spec in cls.specs():
        value = gen.get(spec.name, spec.default)
        opts[spec.name] = {
            "value": value,
            "flag": spec.cli_flag,
            "env": spec.env,
            "allowed": spec.rule(),
            "help": spec.help,
            "from": "generation_config" if spec.name in gen else "built-in",
        }
    return {"policy": name, "decoders": decoders, "options": opts}
