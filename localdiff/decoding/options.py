"""Decoder options: the registry of every policy's option set, one source of truth (torch-free).

Each field carries its metadata (type, range, default, CLI flag, ``LOCALDIFF_*`` variable, help, the checkpoint's
``generation_config.json`` key it maps from, ``/set`` aliases). Everything else is derived from it: the CLI flags
(``localdiff gen/chat``), the environment variables and config-file keys (``localdiff.config``), the chat's ``/set``
list, ``show``, the engine's validation and the server's request mapping. Adding an option is one field in its
family's ``options_<family>.py`` (schema: :mod:`localdiff.decoding.schema`); adding a decoder is its options class
with one :func:`~localdiff.decoding.schema.decoder` declaration (name, family, policy class, model types) plus its
policy file: the tables below (:data:`POLICIES`, :func:`policy_for_family`, :func:`runnable`,
:func:`policy_classes`) are derived from the declarations. Which decoder runs is the ``decoder`` option
(:func:`decoder_spec`), default the model's own; an option of another decoder is an error naming the ``decoder``
value to give (:func:`localdiff.decoding.schema.unknown_option`).

Validation messages have one shape from every source: ``"<what the user typed>: <rule> (got <value>)"``, where
"what the user typed" is the flag (``--steps``), the variable (``LOCALDIFF_MAX_DENOISING_STEPS``), the config key
(``config.toml: max_denoising_steps``), the ``/set`` word (``/set steps``) or the keyword argument.
"""

from __future__ import annotations

from typing import Any

# the option modules, in the order their decoders are declared (the first declaration of a shared option name,
# e.g. ``steps``, gives its flag's help and the config file's range check)
from localdiff.decoding.options_canvas import CanvasEBOptions
from localdiff.decoding.options_masked import DreamOptions, LLaDAOptions
from localdiff.decoding.options_block import FastDLLMv2Options, SDAROptions
from localdiff.decoding.options_llada2 import LLaDA2Options
from localdiff.decoding.options_nap import NAPOptions
from localdiff.decoding.options_causal import CausalOptions
from localdiff.decoding.options_slots import RefusionOptions
from localdiff.decoding.schema import ALIASES, DECODERS, POLICIES, Decoder, Options, OptionSpec  # noqa: F401
from localdiff.decoding.schema import decoder, opt, unknown_option  # noqa: F401
from localdiff.errors import UsageError

__all__ = [
    "CanvasEBOptions",
    "DreamOptions",
    "LLaDAOptions",
    "SDAROptions",
    "FastDLLMv2Options",
    "Options",
    "OptionSpec",
    "opt",
    "decoder",
    "POLICIES",
    "DECODERS",
    "ALIASES",
    "unknown_option",
]
__all__ += ["LLaDA2Options", "NAPOptions", "RefusionOptions", "CausalOptions"]

#: the ``decoder`` option's name: which decoder runs (default: the model's, :func:`default_decoder`)
DECODER = "decoder"


def decoder_spec() -> OptionSpec:
    """The ``decoder`` option (``--decoder``, ``LOCALDIFF_DECODER``, config key ``decoder``, ``/set decoder``, the
    server's ``localdiff.decoder``): a declared decoder's name; unset = the model's own."""
    return OptionSpec(
        name=DECODER,
        kind=str,
        default=None,
        optional=True,
        choices=tuple(POLICIES),
        help="the decoder to run (default: the model's; `localdiff show MODEL` lists those it can run)",
        metavar="NAME",
        gen_key=DECODER,
    )


def has_decoder(family: str) -> bool:
    """Whether some declared decoder runs on ``family``'s models."""
    return any(d.family == family for d in DECODERS.values())


def policy_for_family(family: str, model_type: str | None = None) -> str:
    """The decoder a model of ``family`` (and ``model_type``) runs by default: the decoder declaring its model_type,
    else its family's default (:class:`localdiff.decoding.schema.Decoder`). Raises KeyError for a family without one."""
    mt = str(model_type).lower() if model_type is not None else None
    for d in DECODERS.values():
        if d.family == family and mt in d.model_types:
            return d.name
    for d in DECODERS.values():
        if d.family == family and d.family_default:
            return d.name
    raise KeyError(family)


def runnable(family: str, own: str) -> list[str]:
    """The decoders a model of ``family`` whose own decoder is ``own`` may run: its own, then the family's
    selectable ones (NAP's parallel-forced decoding on any masked model)."""
    return [own] + [d.name for d in DECODERS.values() if d.family == family and d.selectable and d.name != own]


def choose(own: str, decoders, name, typed: str = DECODER) -> str:
    """The decoder of one request: ``name`` (the ``decoder`` option; None = ``own``, the model's default) when it
    is one of ``decoders`` (those the model can run, :func:`runnable`).

    Raises:
        UsageError: ``"<typed>: ..."`` for a name no decoder has, or one this model cannot run (naming those it can).
    """
    if name is None:
        return own
    name = decoder_spec().coerce(name, typed)
    if name not in decoders:
        raise UsageError(
            f"{typed}: this model runs the decoder{'s' if len(decoders) > 1 else ''} {', '.join(decoders)}; {name} is a "
            f"{DECODERS[name].family}-family decoder (got {name!r})"
        )
    return name


def policy_class(name: str):
    """The policy class of decoder ``name`` (its declaration's ``"module:Class"``, imported now: torch).
    Raises KeyError for a decoder without one (its runner's loop is the decoder)."""
    import importlib

    where = DECODERS[name].policy
    if where is None:
        raise KeyError(name)
    module, cls = where.split(":")
    return getattr(importlib.import_module(module), cls)


def policy_classes(family: str) -> dict[str, type]:
    """Decoder name → policy class for every declared decoder of ``family`` that has one."""
    return {d.name: policy_class(d.name) for d in DECODERS.values() if d.family == family and d.policy}


def all_specs() -> list[OptionSpec]:
    """Every option of every policy, one spec per name (first declaration wins), for CLI flags, env and config."""
    seen: dict[str, OptionSpec] = {DECODER: decoder_spec()}
    for c in POLICIES.values():
        for s in c.specs():
            seen.setdefault(s.name, s)
    return list(seen.values())


def specs_by_key() -> dict[str, OptionSpec]:
    """Option name or alias → its spec (:func:`all_specs`; an alias maps to the first option declaring it), for
    the config file's ``[sampler]`` keys and ``/set``. Derived anew on each call: a decoder declared later counts."""
    out = {spec.name: spec for spec in all_specs()}
    out.update({a: spec for spec in all_specs() for a in spec.aliases if a not in out})
    return out


def cli_flags() -> list[tuple[str, str, OptionSpec]]:
    """(flag, key, spec) for every distinct CLI flag of every policy, first declaration first. ``key`` is the flag
    word with underscores ("steps", "temperature", "entropy_bound"): the value is passed to the engine under it, and
    each policy resolves it to its own option (its name or an alias), so ``--steps`` means each model's step count."""
    seen: dict[str, tuple[str, str, OptionSpec]] = {}
    for spec in [decoder_spec()] + [s for c in POLICIES.values() for s in c.specs()]:
        flag = spec.cli_flag
        seen.setdefault(flag, (flag, flag[2:].replace("-", "_"), spec))
    return list(seen.values())


def flag_envs(flag: str) -> list[str]:
    """Every ``LOCALDIFF_*`` variable of the options a shared CLI flag sets (``--steps``: each policy's step count)."""
    out: list[str] = ["LOCALDIFF_DECODER"] if flag == "--decoder" else []
    for c in POLICIES.values():
        for s in c.specs():
            if s.cli_flag == flag and s.env not in out:
                out.append(s.env)
    return out


def resolve_key(word: str) -> str:
    """An option name from what the user typed (a name or an alias); unknown words come back unchanged."""
    w = word.strip().lower().replace("-", "_")
    return w if w == DECODER or any(w in c.names() for c in POLICIES.values()) else ALIASES.get(w, w)


def resolve_for(word: str, names) -> str:
    """An option name of one model's policy (``names``: its option names) from what the user typed: the name
    itself, else that policy's alias (``/set steps`` is ``max_denoising_steps`` on DiffusionGemma, ``steps`` on
    LLaDA); without ``names``, :func:`resolve_key`'s answer with the first policy's aliases."""
    w = word.strip().lower().replace("-", "_")
    if names:
        if w in names:
            return w
        for c in POLICIES.values():
            for s in c.specs():
                if s.name in names and w in s.aliases:
                    return s.name
    return ALIASES.get(w, w)


def coerce_setting(key: str, value: Any, where: str) -> Any:
    """One decoder option's value from the config file or the environment, accepted exactly as its flag is: typed by
    the option's spec, else — a string some decoder's reading of the same word accepts, as ``--temperature 1:0.5``
    (DiffusionGemma's ``t_max:t_min`` pair behind the word ``temperature``) — kept as given, for each model's
    decoder to read as it reads the flag's value.

    Args:
        key: an option name (:func:`resolve_key`'s answer). where: the variable or ``<file>: [sampler] <word>``.
    Raises:
        UsageError: no decoder accepts the value (the option's own message, naming ``where``).
    """
    spec = specs_by_key()[key]
    try:
        return spec.coerce(value, where)
    except UsageError:
        if not isinstance(value, str) or key == DECODER:
            raise
        text = value.strip()
        for cls in POLICIES.values():
            if key in cls.names() or key in cls.aliases():
                try:
                    cls.build({key: text}, {key: where})
                    return text
                except UsageError:
                    pass
        raise


def check_overrides(options: dict, typed: dict | None = None) -> None:
    """Check each user-set decoder option alone before any model is chosen (``chat`` / ``serve`` start: the model,
    hence its decoder, is known only later): a key passes when at least one decoder that has it accepts its value.
    Cross-option rules wait for the model (``Model.sampler_options``).

    Args:
        options: option name or alias → value (as from ``localdiff.config.sampler_overrides``); other keys (e.g.
            ``max_new_tokens``, ``seed``) are skipped.
        typed: key → what the user typed (for the message), e.g. "--steps".
    Raises:
        UsageError: the first key no decoder accepts (that decoder's message).
    """
    for key, value in options.items():
        if key == DECODER:
            decoder_spec().coerce(value, (typed or {}).get(key, key))
            continue
        classes = [c for c in POLICIES.values() if key in c.names() or key in c.aliases()]
        first = None
        for cls in classes:
            try:
                cls.build({key: value}, {key: (typed or {}).get(key, key)})
                first = None
                break
            except UsageError as e:
                first = first or e
        if first is not None:
            raise first
