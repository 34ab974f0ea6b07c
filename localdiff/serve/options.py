"""Request fields → engine options, in one place (``to_engine_options``).

The OpenAI and Ollama parsers first bring their request to one neutral dict (``max_tokens``, ``temperature``,
``seed``, ``stop``, ``sampler``: localdiff's own decoder options), then this module checks JSON types and, through
the decoder option schema (``localdiff.decoding.options``), names and ranges, and returns what ``Model.stream``
takes. Rules that depend on the model (its family's decoder, its context length) are the engine's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from localdiff.decoding.options import all_specs, resolve_key
from localdiff.errors import UsageError
from localdiff.serve.errors import bad_request, json_repr
from localdiff.wire import EVENT_LEVELS

MAX_STOP = 4  # stop sequences per request (OpenAI's limit)
MAX_SEED = 2**63 - 1


@dataclass
class GenRequest:
    """One generation asked for over HTTP, in engine terms.

    Attributes:
        model: requested model name ("" = the resident / default model).
        prompt: chat messages [{"role", "content"}] (chat=True) or a string (raw completion).
        chat: render the chat template.
        max_new_tokens: None = the model's default.
        seed: None = random (the seed used is reported back).
        sampler: decoder options set by this request (schema names, see ``localdiff.decoding.options``).
        shown: schema name (or the typed key) → how the client named it (``options.top_k``, ``temperature``), for
            the engine's error messages (``localdiff.serve.errors.from_engine``).
        stop: stop strings (the text is cut before the first one and the generation ends there).
        stream / include_usage: response shape.
        events: localdiff's canvas events in the stream: "none", "canvases" or "steps" (``localdiff.wire``).
        load_only: Ollama's load request (an empty or absent prompt / messages): load the model, generate nothing.
    """

    model: str
    prompt: object
    chat: bool = True
    max_new_tokens: int | None = None
    seed: int | None = None
    sampler: dict = field(default_factory=dict)
    shown: dict = field(default_factory=dict)
    stop: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    events: str = "none"
    load_only: bool = False


def check_int(value, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int (bools, floats with a fraction and floats past 2^53, which hold no exact integer such as
    1e30, rejected) within [lo, hi]; else a 400."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and (not math.isfinite(value) or not value.is_integer() or abs(value) > 2**53))
    ):
        raise bad_request(f"'{name}' must be an integer (got {json_repr(value)})", param=name)
    value = int(value)
    if lo is not None and value < lo:
        raise bad_request(f"'{name}' must be ≥ {lo} (got {value})", param=name)
    if hi is not None and value > hi:
        raise bad_request(f"'{name}' must be ≤ {hi} (got {value})", param=name)
    return value


def check_number(value, name: str) -> float:
    """A finite number (not a bool); else a 400."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number (got {json_repr(value)})", param=name)
    return float(value)


def check_bool(value, name: str) -> bool:
    """A JSON boolean; else a 400."""
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false (got {json_repr(value)})", param=name)
    return value


def check_str(value, name: str) -> str:
    """A JSON string; else a 400."""
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string (got {json_repr(value, 40)})", param=name)
    return value


def check_stop(value, name: str = "stop") -> list[str]:
    """``stop``: null, a string or a list of up to 4 non-empty strings."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request(f"'{name}' must be a string or a list of strings", param=name)
    if len(items) > MAX_STOP:
        raise bad_request(f"'{name}' takes at most {MAX_STOP} sequences (got {len(items)})", param=name)
    if any(not s for s in items):
        raise bad_request(f"'{name}' sequences must not be empty", param=name)
    return list(items)


def option_specs() -> dict:
    """Every decoder option of every policy by name, ``decoder`` included (the schema's ``OptionSpec``; derived on
    each request from the declarations)."""
    return {spec.name: spec for spec in all_specs()}


def _meanings() -> dict:
    """Option name or alias → {its rule in words: its type} over every decoder that knows it. A key with more than one
    (``steps``: [1, 100000] for DiffusionGemma's sampler and SDAR, [1, 1000000] for LLaDA; ``remasking``'s choices
    for LLaDA and SDAR; ``threshold``) can only be range-checked against the model's own decoder, by the engine."""
    from localdiff.decoding.schema import POLICIES

    out: dict = {}
    for cls in POLICIES.values():
        for s in cls.specs():
            out.setdefault(s.name, {})[s.rule()] = s.kind
        for alias, name in cls.aliases().items():
            s = cls.spec(name)
            out.setdefault(alias, {})[s.rule()] = s.kind
    return out


def _typed_only(value, kinds: set, shown: str):
    """A decoder option whose range depends on the model: its JSON type checked here (when every decoder gives it
    the same type), its range by the engine; the value as sent (the engine's message then quotes it as sent)."""
    if value is not None and len(kinds) == 1:
        kind = next(iter(kinds))
        if kind is bool:
            check_bool(value, shown)
        elif kind is int:
            check_int(value, shown)
        elif kind is float:
            check_number(value, shown)
        else:
            check_str(value, shown)
    return value


def split_extension(ext, name: str = "localdiff") -> tuple[dict | None, str]:
    """The ``localdiff`` request object → (decoder options or None, events level).

    ``events`` ("none" | "canvases" | "steps", default "none") asks for localdiff's canvas events in the stream
    (``localdiff.wire``); every other key is a decoder option (checked by :func:`to_engine_options`).
    Raises ApiError(400): not an object, or a bad events value.
    """
    if ext is None:
        return None, "none"
    if not isinstance(ext, dict):
        raise bad_request(f"'{name}' must be an object of decoder options", param=name)
    if "events" not in ext:
        return ext, "none"
    events = ext["events"]
    if events is None:
        events = "none"
    if events not in EVENT_LEVELS:
        raise bad_request(
            f"'{name}.events' must be one of {', '.join(map(repr, EVENT_LEVELS))} (got {json.dumps(events)[:40]})",
            param=f"{name}.events",
        )
    return {k: v for k, v in ext.items() if k != "events"}, events


def check_clashes(options_cls, sampler: dict, shown: dict) -> None:
    """Two names of a request that set one option of the model's decoder (``options_cls``: its options class), e.g.
    the standard ``temperature`` and ``localdiff.t_max`` on DiffusionGemma's sampler, or ``steps`` and
    ``max_denoising_steps`` there (an alias and its option): a 400 naming both as sent, instead of one winning
    silently. ``shown``: option key → as the client named it (:attr:`GenRequest.shown`).

    Raises:
        ApiError(400).
    """
    if len(sampler) < 2:  # (nothing can clash: most requests set no option or one)
        return
    names, aliases, seen = set(options_cls.names()), options_cls.aliases(), {}
    for key in sampler:
        option = key if key in names else aliases.get(key, key)
        if option in seen:
            a, b = shown.get(seen[option], seen[option]), shown.get(key, key)
            raise bad_request(f"'{a}' and '{b}' both set this model's '{option}': send one", param=b)
        seen[option] = key


def _sampler_value(spec, value, shown: str):
    """A JSON value for one decoder option: the JSON type first (no numbers as strings), then the schema's range."""
    if value is None:
        if spec.optional:
            return None
        raise bad_request(f"'{shown}' must be {spec.rule()} (got null)", param=shown)
    if spec.kind is bool:
        check_bool(value, shown)
    elif spec.kind in (int, float):
        check_number(value, shown)
    elif spec.kind is str:
        check_str(value, shown)
    try:
        return spec.coerce(value, shown)
    except UsageError as e:
        raise bad_request(str(e), param=shown) from None


def to_engine_options(fields: dict) -> dict:
    """The one mapping from neutral request fields to ``Model.stream`` keyword arguments.

    Args:
        fields: ``max_tokens`` (int ≥ 1 or None), ``temperature`` (number ≥ 0 or None: a constant temperature over
            the denoising steps, e.g. ``t_max = t_min``; 0 where the model's decoder has it, checked by the
            engine), ``seed`` (int in [0, 2^63) or None), ``stop``, and ``sampler`` (dict of decoder options by
            schema name or alias, or None); optional ``names``: {field (or "sampler"): how the client's API names
            it} for the messages (OpenAI: ``max_completion_tokens``; Ollama: ``options.seed``, ``options``).
    Returns:
        {"max_new_tokens", "seed", "stop", "sampler", "shown"} (``shown``: option name → as the client named it,
        :attr:`GenRequest.shown`); the engine still checks ranges that depend on the model
        (context length) and the options' combined rules.
    Raises:
        ApiError(400) for a wrong type, a value out of range or an unknown option.
    """
    where = fields.get("names") or {}  # request field → how the client's API names it (Ollama: under options)
    sampler_name = where.get("sampler", "localdiff")
    out = {
        "max_new_tokens": None,
        "seed": None,
        "stop": check_stop(fields.get("stop"), where.get("stop", "stop")),
        "sampler": {},
        "shown": {},
    }
    if fields.get("max_tokens") is not None:
        out["max_new_tokens"] = check_int(fields["max_tokens"], where.get("max_tokens", "max_tokens"), lo=1)
    if fields.get("seed") is not None:
        out["seed"] = check_int(fields["seed"], where.get("seed", "seed"), lo=0, hi=MAX_SEED)
    sampler = fields.get("sampler")
    specs = option_specs()
    if sampler is not None:
        if not isinstance(sampler, dict):
            raise bad_request(f"'{sampler_name}' must be an object of decoder options", param=sampler_name)
        for key, value in sampler.items():
            name = resolve_key(str(key))
            shown = f"{sampler_name}.{key}"
            if name not in specs:
                raise bad_request(f"unknown option '{shown}' (known: {', '.join(specs)})", param=shown)
            meanings = _meanings().get(str(key), {})
            if len(meanings) > 1 and value is not None:
                v = _typed_only(value, set(meanings.values()), shown)
            else:
                v = _sampler_value(specs[name], value, shown)
            if v is not None or specs[name].optional:
                out["sampler"][name] = v
                out["shown"][name] = out["shown"][str(key)] = shown
    if fields.get("temperature") is not None:
        raw, shown = fields["temperature"], where.get("temperature", "temperature")
        t = check_number(raw, shown)
        name = resolve_key("temperature")  # a constant schedule: the option and its pair (t_max, t_min)
        if name in specs:  # its range from the schema (1e308 gave an empty answer); the
            t = _sampler_value(specs[name], raw, shown)  # message shows the value as sent (-1, not -1.0)
        if out["shown"].get(name, shown) != shown:  # also set under the extension key (Ollama: the same place)
            raise bad_request(f"'{shown}' and '{out['shown'][name]}' both set the temperature: send one", param=shown)
        for key in (name, getattr(specs.get(name), "pair_of", None)):
            if key and key not in out["sampler"]:  # (the pair's other option set under the extension key stays)
                out["sampler"][key], out["shown"][key] = t, shown
        out["shown"].setdefault("temperature", shown)
    return out
