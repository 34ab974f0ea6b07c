"""Decoder options: the registry of every policy's option set, one source of truth (torch-free).

Each field carries its metadata (type, range, default, CLI flag, ``LOCALDIFF_*`` variable, help, the checkpoint's
``generation_config.json`` key it maps from, ``/set`` aliases). Everything else is derived from it: the CLI flags
(``localdiff gen/chat``), the environment variables and config-file keys (``localdiff.config``), the chat's ``/set``
list, ``show``, the engine's validation and the server's request mapping. Adding an option is one field in its
family's ``options_<family>.py`` (schema: :mod:`localdiff.decoding.schema`); adding a policy is its class in
:data:`POLICIES` (and :data:`FAMILY_POLICY` / :data:`MODEL_POLICY`).

Validation messages have one shape from every source: ``"<what the user typed>: <rule> (got <value>)"``, where
"what the user typed" is the flag (``--steps``), the variable (``LOCALDIFF_MAX_DENOISING_STEPS``), the config key
(``config.toml: max_denoising_steps``), the ``/set`` word (``/set steps``) or the keyword argument.
"""
from __future__ import annotations

from localdiff.decoding.options_block import FastDLLMv2Options, SDAROptions
from localdiff.decoding.options_canvas import CanvasEBOptions
from localdiff.decoding.options_llada2 import LLaDA2Options
from localdiff.decoding.options_causal import CausalOptions
from localdiff.decoding.options_masked import DreamOptions, LLaDAOptions
from localdiff.decoding.options_slots import RefusionOptions
from localdiff.decoding.options_nap import NAPOptions
from localdiff.decoding.schema import ALIASES, POLICIES, Options, OptionSpec, opt, unknown_option  # noqa: F401
from localdiff.errors import UsageError

__all__ = ["CanvasEBOptions", "DreamOptions", "LLaDAOptions", "SDAROptions", "FastDLLMv2Options", "Options",
           "OptionSpec", "opt", "POLICIES", "FAMILY_POLICY", "MODEL_POLICY", "ALIASES", "unknown_option"]
__all__ += ["LLaDA2Options"]
__all__ += ["RefusionOptions", "CausalOptions"]


#: every decoder policy's options by policy name
POLICIES.update({c.POLICY: c for c in (CanvasEBOptions, LLaDAOptions, DreamOptions)})
POLICIES.update({c.POLICY: c for c in (SDAROptions, FastDLLMv2Options)})
POLICIES.update({c.POLICY: c for c in (LLaDA2Options,)})
POLICIES[NAPOptions.POLICY] = NAPOptions
POLICIES[CausalOptions.POLICY] = CausalOptions

#: the decoder policy each model family runs by default (localdiff.arch registry families)
FAMILY_POLICY: dict[str, str] = {"canvas": CanvasEBOptions.POLICY, "masked": LLaDAOptions.POLICY}
FAMILY_POLICY["block"] = SDAROptions.POLICY
POLICIES[RefusionOptions.POLICY] = RefusionOptions
FAMILY_POLICY["slots"] = RefusionOptions.POLICY
FAMILY_POLICY["causal"] = CausalOptions.POLICY

#: model_types (lower case) whose decoder differs from their family's default: Dream / DiffuCoder run Dream's
MODEL_POLICY: dict[str, str] = {"dream": DreamOptions.POLICY}
MODEL_POLICY["fast_dllm_qwen"] = FastDLLMv2Options.POLICY
MODEL_POLICY["llada2_moe"] = LLaDA2Options.POLICY

#: decoder policies every model of a family can also run besides its own (FAMILY_POLICY / MODEL_POLICY), chosen by
#: giving one of their options (:func:`localdiff.decoding.policy_select.select`)
FAMILY_POLICIES: dict[str, tuple[str, ...]] = {"masked": (NAPOptions.POLICY,)}


def policy_for_family(family: str, model_type: str | None = None) -> str:
    """The decoder policy name of a model family (and model_type, for a family with several decoders).
    Raises KeyError for a family without one."""
    if model_type is not None and str(model_type).lower() in MODEL_POLICY:
        return MODEL_POLICY[str(model_type).lower()]
    return FAMILY_POLICY[family]


#: /set and config-file aliases → option name (from the fields' ``aliases``)
for _c in POLICIES.values():
    for _s in _c.specs():
        for _a in _s.aliases:
            ALIASES.setdefault(_a, _s.name)
_NAMES = {n for _c in POLICIES.values() for n in _c.names()}


def all_specs() -> list[OptionSpec]:
    """Every option of every policy, one spec per name (first declaration wins), for CLI flags, env and config."""
    seen: dict[str, OptionSpec] = {}
    for c in POLICIES.values():
        for s in c.specs():
            seen.setdefault(s.name, s)
    return list(seen.values())


def cli_flags() -> list[tuple[str, str, OptionSpec]]:
    """(flag, key, spec) for every distinct CLI flag of every policy, first declaration first. ``key`` is the flag
    word with underscores ("steps", "temperature", "entropy_bound"): the value is passed to the engine under it, and
    each policy resolves it to its own option (its name or an alias), so ``--steps`` means each model's step count."""
    seen: dict[str, tuple[str, str, OptionSpec]] = {}
    for c in POLICIES.values():
        for spec in c.specs():
            flag = spec.cli_flag
            seen.setdefault(flag, (flag, flag[2:].replace("-", "_"), spec))
    return list(seen.values())


def flag_envs(flag: str) -> list[str]:
    """Every ``LOCALDIFF_*`` variable of the options a shared CLI flag sets (``--steps``: each policy's step count)."""
    out: list[str] = []
    for c in POLICIES.values():
        for s in c.specs():
            if s.cli_flag == flag and s.env not in out:
                out.append(s.env)
    return out


def resolve_key(word: str) -> str:
    """An option name from what the user typed (a name or an alias); unknown words come back unchanged."""
    w = word.strip().lower().replace("-", "_")
    return w if w in _NAMES else ALIASES.get(w, w)


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
