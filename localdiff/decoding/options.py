"""Decoder options: one frozen dataclass per decoder policy, one source of truth (torch-free).

Each field carries its metadata (type, range, default, CLI flag, ``LOCALDIFF_*`` variable, help, the checkpoint's
``generation_config.json`` key it maps from, ``/set`` aliases). Everything else is derived from it: the CLI flags
(``localdiff gen/chat``), the environment variables and config-file keys (``localdiff.config``), the chat's ``/set``
list, ``show``, the engine's validation and the server's request mapping. Adding an option is one field here.

Validation messages have one shape from every source: ``"<what the user typed>: <rule> (got <value>)"``, where
"what the user typed" is the flag (``--steps``), the variable (``LOCALDIFF_MAX_DENOISING_STEPS``), the config key
(``config.toml: max_denoising_steps``), the ``/set`` word (``/set steps``) or the keyword argument.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping

from localdiff.errors import UsageError


@dataclass(frozen=True)
class OptionSpec:
    """Metadata of one decoder option (see the module docstring).

    Attributes:
        name: the keyword (the upstream name of the family's option).
        kind: int, float, bool or str.
        default: the built-in default (None = unset / off).
        help: one line for ``--help`` and ``/set``.
        lo / hi: closed bounds (None = unbounded); ``lo_open`` / ``hi_open`` make them open.
        choices: allowed values for str options.
        optional: None is a valid value (e.g. "no lock threshold").
        flag: the CLI flag (default ``--name-with-dashes``); ``metavar`` its placeholder.
        aliases: short names accepted by ``/set`` (and as extra keys in the config file).
        gen_key: the checkpoint ``generation_config.json`` key it is read from (None = not read).
        pair_of: for ``--temperature MAX[:MIN]``: the option that takes the part after ":".
    """

    name: str
    kind: type
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple | None = None
    optional: bool = False
    flag: str | None = None
    metavar: str | None = None
    aliases: tuple = ()
    gen_key: str | None = None
    pair_of: str | None = None

    @property
    def env(self) -> str:
        """The environment variable: ``LOCALDIFF_<NAME>``."""
        return "LOCALDIFF_" + self.name.upper()

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def rule(self) -> str:
        """The allowed values in words (used by ``--help``, ``/set`` and error messages)."""
        if self.kind is bool:
            return "on or off"
        if self.choices:
            return "one of " + ", ".join(self.choices)
        what = {int: "an integer", float: "a number", str: "text"}[self.kind]
        if self.lo is not None and self.hi is not None:
            a, b = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            return f"{what} in {a}{_num(self.lo)}, {_num(self.hi)}{b}"
        if self.lo is not None:
            return f"{what} {'>' if self.lo_open else '≥'} {_num(self.lo)}"
        return what

    def coerce(self, value: Any, typed: str) -> Any:
        """``value`` (a Python value, a TOML value or a flag / env / ``/set`` string) → the option's type.

        Args:
            typed: what the user typed, named first in the error message.
        Raises:
            UsageError: ``"<typed>: must be <rule> (got <value>)"``.
        """
        bad = UsageError(f"{typed}: must be {self.rule()} (got {value!r})")
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "off", "")
                             and self.optional and self.kind is not bool):
            if self.optional:
                return None
            raise bad
        if self.kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise bad
        if self.kind is str:
            if not isinstance(value, str) or (self.choices and value not in self.choices):
                raise bad
            return value
        if isinstance(value, bool):
            raise bad
        try:
            num = float(value.strip()) if isinstance(value, str) else float(value)
        except (TypeError, ValueError, OverflowError):
            raise bad from None
        if not math.isfinite(num):
            raise bad
        if self.kind is int:
            if not num.is_integer():
                raise bad
            num = int(value.strip()) if isinstance(value, str) and value.strip().lstrip("+-").isdigit() else int(num)
        if self.lo is not None and (num < self.lo or (self.lo_open and num == self.lo)):
            raise bad
        if self.hi is not None and (num > self.hi or (self.hi_open and num == self.hi)):
            raise bad
        return num


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else str(x)


def opt(default: Any, help: str, kind: type | None = None, **meta) -> Any:
    """A dataclass field carrying an :class:`OptionSpec` (``kind`` defaults to the default's type)."""
    return field(default=default, metadata={"opt": dict(meta, help=help, kind=kind)})


class Options:
    """Base of each policy's option dataclass (frozen). Subclasses set ``POLICY`` and may override :meth:`check`."""

    POLICY: ClassVar[str] = ""

    @classmethod
    def specs(cls) -> list[OptionSpec]:
        """The :class:`OptionSpec` of every field, in declaration order."""
        out = []
        for f in fields(cls):
            m = dict(f.metadata["opt"])
            kind = m.pop("kind") or type(f.default)
            m.setdefault("gen_key", f.name)
            out.append(OptionSpec(name=f.name, kind=kind, default=f.default, **m))
        return out

    @classmethod
    def spec(cls, name: str) -> OptionSpec:
        for s in cls.specs():
            if s.name == name:
                return s
        raise KeyError(name)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def aliases(cls) -> dict[str, str]:
        """Alias (``/set`` word, shared flag word such as "steps" or "temperature") → option name, for this policy."""
        return {a: s.name for s in cls.specs() for a in s.aliases}

    @classmethod
    def build(cls, values: Mapping[str, Any], typed: Mapping[str, str] | None = None) -> "Options":
        """Validate and build. ``values``: option name or alias → value (a Python value or a string; for an option
        with ``pair_of``, "A:B" also sets the paired option to B); ``typed``: key → what the user typed (for
        messages; default: the key itself).

        Raises:
            UsageError: unknown option (or one of another family's decoder), bad value, or a combination
                :meth:`check` rejects.
        """
        typed_in = dict(typed or {})
        known = {s.name: s for s in cls.specs()}
        alias = cls.aliases()
        out, typed_out = {}, {}
        for key, v in values.items():
            name = key if key in known else alias.get(key)
            shown = typed_in.get(key, key)
            if name is None:
                raise unknown_option(key, shown, cls)
            spec = known[name]
            if spec.pair_of and isinstance(v, str) and ":" in v:
                first, second = v.split(":", 1)
                out[spec.pair_of] = known[spec.pair_of].coerce(second, shown)
                if key in typed_in:
                    typed_out[spec.pair_of] = shown
                v = first
            out[name] = spec.coerce(v, shown)
            if key in typed_in:                  # what the user typed (not checkpoint defaults): named in messages
                typed_out[name] = shown
        obj = cls(**out)
        obj.check(typed_out)
        return obj

    def check(self, typed: Mapping[str, str]) -> None:
        """Cross-field rules (override); raise UsageError naming what the user typed."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def unknown_option(key: str, typed: str, cls: type[Options] | None = None) -> UsageError:
    """The one-line error for an option no policy (or not this model's policy) knows."""
    import difflib

    owners = [c.POLICY for c in POLICIES.values() if key in c.names()]
    if cls is not None and owners:
        return UsageError(f"{typed}: '{key}' is an option of the {', '.join(owners)} decoder, not of this model's "
                          f"({cls.POLICY}); its options: {', '.join(cls.names())}")
    pool = sorted({n for c in POLICIES.values() for n in c.names()} | set(ALIASES))
    near = difflib.get_close_matches(key, pool, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return UsageError(f"{typed}: unknown decoder option '{key}'{hint}")


# -- the policies' options ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CanvasEBOptions(Options):
    """DiffusionGemma's canvas decoder: uniform-noise canvas, temperature schedule, entropy-bound acceptance,
    optional τ-locking and Re-Noising correction, self-conditioning (transformers 5.23.0
    ``DiffusionGemmaForBlockDiffusion.generate``; keys = its ``generation_config``)."""

    POLICY: ClassVar[str] = "canvas_eb"

    max_denoising_steps: int = opt(48, "max denoising steps per canvas", lo=1, hi=100_000, flag="--steps",
                                   metavar="N", aliases=("steps", "max_steps"))
    t_min: float = opt(0.4, "temperature at the last step (linear schedule)", lo=0, flag="--t-min", metavar="T")
    t_max: float = opt(0.8, "temperature at the first step; --temperature MAX[:MIN] sets both", lo=0,
                       flag="--temperature", metavar="MAX[:MIN]", pair_of="t_min", aliases=("temperature",))
    entropy_bound: float = opt(0.1, "entropy-bound acceptance budget (nats)", lo=0, lo_open=True, metavar="X",
                               aliases=("eb",))
    stability_threshold: int = opt(1, "steps a canvas must stay unchanged before it stops early", lo=0,
                                   hi=100_000, metavar="N")
    confidence_threshold: float = opt(0.005, "mean-entropy level under which a stable canvas is final", lo=0,
                                      lo_open=True, metavar="X")
    threshold: float | None = opt(None, "confidence lock τ: a drafted token with probability ≥ τ is locked",
                                  kind=float, lo=0, hi=1, lo_open=True, optional=True, metavar="TAU",
                                  aliases=("tau",))
    correction: bool = opt(False, "Re-Noising correction: reopen locked tokens that lost confidence")
    correction_floor: float = opt(0.05, "reopen a locked token whose probability fell below this", lo=0, hi=1,
                                  metavar="P")
    correction_max_reopens: int = opt(8, "at most this many reopened tokens per step", lo=0, hi=100_000,
                                      metavar="N")

    def check(self, typed: Mapping[str, str]) -> None:
        if self.t_max < self.t_min:
            key = "t_min" if "t_min" in typed and "t_max" not in typed else "t_max"
            other = "t_max" if key == "t_min" else "t_min"
            rel = "≤" if key == "t_min" else "≥"
            raise UsageError(f"{typed.get(key, key)}: must be {rel} {other} ({getattr(self, other)}) "
                             f"(got {getattr(self, key)})")
        if self.t_min == 0 and self.t_max == 0:
            raise UsageError(f"{typed.get('t_max', 't_max')}: temperature must be > 0 at some step (got 0)")


@dataclass(frozen=True)
class _FastDLLM(Options):
    """Fast-dLLM's parallel decoding and approximate caches (NVlabs/Fast-dLLM, arXiv 2505.22618), shared by the
    masked family's decoders. ``kv_cache`` is Fast-dLLM's use_cache / dual_cache (``cache`` is Model.stream's)."""

    threshold: float | None = opt(None, "Fast-dLLM parallel decoding: also commit every masked position of the "
                                  "block with confidence ≥ τ (off = the step schedule)", kind=float, lo=0, hi=1,
                                  lo_open=True, optional=True, metavar="TAU")
    factor: float | None = opt(None, "Fast-dLLM factor rule: commit the n most confident while the n-th has "
                               "confidence ≥ 1 − factor/(n+1)", kind=float, lo=0, lo_open=True, optional=True,
                               metavar="F")
    kv_cache: str = opt("none", "approximate K/V cache (Fast-dLLM): none, prefix (prompt + finished blocks) or dual "
                        "(also the masked suffix); refreshed at each block", choices=("none", "prefix", "dual"))

    def check(self, typed: Mapping[str, str]) -> None:
        if self.threshold is not None and self.factor is not None:
            raise UsageError(f"{typed.get('factor', 'factor')}: give either threshold or factor, not both "
                             f"(got threshold={self.threshold}, factor={self.factor})")
        if getattr(self, "cfg_scale", 0) > 0 and self.kv_cache != "none":
            raise UsageError(f"{typed.get('kv_cache', 'kv_cache')}: classifier-free guidance (cfg_scale > 0) "
                             f"needs kv_cache none (got {self.kv_cache!r})")


@dataclass(frozen=True)
class LLaDAOptions(_FastDLLM):
    """LLaDA's decoder (ML-GSAI/LLaDA ``generate.py``, arXiv 2502.09992): ``gen_length`` (our max_new_tokens) masks,
    semi-autoregressive blocks, ``steps`` split over blocks and within a block, low-confidence / random remasking,
    Gumbel-max sampling, classifier-free guidance; plus Fast-dLLM's options."""

    POLICY: ClassVar[str] = "llada"

    steps: int | None = opt(None, "denoising steps over the whole answer, split evenly over blocks (default: one "
                            "token per step)", kind=int, lo=1, hi=1_000_000, optional=True, metavar="N")
    block_length: int = opt(32, "semi-autoregressive block length (tokens)", lo=1, hi=1_000_000, metavar="N")
    temperature: float = opt(0.0, "Gumbel-max sampling temperature (0 = argmax)", lo=0, metavar="T")
    cfg_scale: float = opt(0.0, "classifier-free guidance scale (unconditional = prompt masked)", lo=0, metavar="W")
    remasking: str = opt("low_confidence", "which predictions to commit", choices=("low_confidence", "random"))


@dataclass(frozen=True)
class DreamOptions(_FastDLLM):
    """Dream's decoder (HKUNLP/Dream ``generation_utils.py`` ``diffusion_generate``, arXiv 2508.15487): timesteps
    linspace(1, eps, steps + 1), ``alg``, ``alg_temp``, temperature / top_p / top_k, shifted logits; ``block_length``
    (Fast-dLLM's Dream) splits the answer into semi-autoregressive blocks; plus Fast-dLLM's options."""

    POLICY: ClassVar[str] = "dream"

    steps: int | None = opt(None, "denoising steps over the whole answer (default: one token per step)", kind=int,
                            lo=1, hi=1_000_000, optional=True, metavar="N")
    block_length: int | None = opt(None, "semi-autoregressive block length (default: one block)", kind=int, lo=1,
                                   hi=1_000_000, optional=True, metavar="N")
    temperature: float = opt(0.0, "sampling temperature (0 = argmax)", lo=0, metavar="T")
    top_p: float | None = opt(None, "nucleus sampling mass", kind=float, lo=0, hi=1, lo_open=True, optional=True,
                              metavar="P")
    top_k: int | None = opt(None, "sample among the k most likely tokens", kind=int, lo=1, hi=1_000_000_000,
                            optional=True, metavar="K")
    alg: str = opt("entropy", "which predictions to commit: origin (random), maskgit_plus (top-1 probability), "
                   "topk_margin (top-1 − top-2), entropy (lowest entropy)",
                   choices=("origin", "maskgit_plus", "topk_margin", "entropy"))
    alg_temp: float | None = opt(None, "sample the committed positions from softmax(confidence / alg_temp) "
                                 "(off or 0 = the most confident)", kind=float, lo=0, optional=True, metavar="T")
    eps: float = opt(1e-3, "last timestep of the schedule", lo=0, hi=1, lo_open=True, hi_open=True, metavar="E")


#: every decoder policy's options by policy name (the block family adds its own here)
POLICIES: dict[str, type[Options]] = {c.POLICY: c for c in (CanvasEBOptions, LLaDAOptions, DreamOptions)}

#: the decoder policy each model family runs by default (localdiff.arch registry families)
FAMILY_POLICY: dict[str, str] = {"canvas": CanvasEBOptions.POLICY, "masked": LLaDAOptions.POLICY}

#: model_types (lower case) whose decoder differs from their family's default: Dream / DiffuCoder run Dream's
MODEL_POLICY: dict[str, str] = {"dream": DreamOptions.POLICY}


def policy_for_family(family: str, model_type: str | None = None) -> str:
    """The decoder policy name of a model family (and model_type, for a family with several decoders).
    Raises KeyError for a family without one."""
    if model_type is not None and str(model_type).lower() in MODEL_POLICY and family == "masked":
        return MODEL_POLICY[str(model_type).lower()]
    return FAMILY_POLICY[family]


#: /set and config-file aliases → option name (from the fields' ``aliases``)
ALIASES: dict[str, str] = {}
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
