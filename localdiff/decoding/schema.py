"""The decoder-option schema (torch-free): :class:`OptionSpec`, :func:`opt` and the :class:`Options` base class that
every policy's frozen dataclass derives from. The policies' option sets live in ``options_<family>.py``; the registry
and everything derived from it (CLI flags, aliases, lookups) in :mod:`localdiff.decoding.options`.

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
        lo / hi: closed bounds (None = unbounded); ``lo_open`` / ``hi_open`` make them open; ``min_positive``:
            0 or at least this (temperatures: 1/T overflows float32 below ~1e-38).
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
    min_positive: float | None = None
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
        if self.min_positive is not None and self.hi is not None:
            return f"0 or {what} in [{_num(self.min_positive)}, {_num(self.hi)}]"
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
        # "none" / "off" turn an optional option off; "" does not (an unset `--threshold "$TAU"` is a mistake)
        if value is None or (
            isinstance(value, str)
            and value.strip().lower() in ("none", "off")
            and self.optional
            and self.kind is not bool
        ):
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
        if self.min_positive is not None and 0 < num < self.min_positive:
            raise bad
        return num

    def split_pair(self, value: str, other: "OptionSpec", typed: str) -> tuple:
        """``"A:B"`` (``--temperature MAX:MIN``) → (A as this option, B as ``other``, the ``pair_of`` option).

        Raises:
            UsageError: naming the whole value as typed, e.g. ``"--temperature: must be 0 or a number in
                [0.001, 100], or a pair MAX:MIN of such (got ':')"``.
        """
        if value.count(":") != 1:
            raise UsageError(f"{typed}: expected a value or a pair A:B (got {value!r})")
        first, second = value.split(":")
        try:
            return self.coerce(first, typed), other.coerce(second, typed)
        except UsageError:
            pair = (self.metavar or "A[:B]").replace("[", "").replace("]", "")
            raise UsageError(f"{typed}: must be {self.rule()}, or a pair {pair} of such (got {value!r})") from None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else str(x)


def opt(default: Any, help: str, kind: type | None = None, **meta) -> Any:
    """A dataclass field carrying an :class:`OptionSpec` (``kind`` defaults to the default's type)."""
    return field(default=default, metadata={"opt": dict(meta, help=help, kind=kind)})


def temperature_opt(default: float, help: str, **meta) -> Any:
    """A sampling-temperature field, every decoder's bounds in one place: 0 (greedy / argmax) or a number in
    [1e-3, 100] (below 1e-3, ``logits / T`` overflows float32 on large logits); ``metavar`` T unless given."""
    meta.setdefault("metavar", "T")
    return opt(default, help, lo=0, hi=100, min_positive=1e-3, **meta)


_SPECS: dict = {}  # Options subclass → its OptionSpecs (Options.specs)


class Options:
    """Base of each policy's option dataclass (frozen). Subclasses set ``POLICY`` and may override :meth:`check`."""

    POLICY: ClassVar[str] = ""

    @classmethod
    def specs(cls) -> list[OptionSpec]:
        """The :class:`OptionSpec` of every field, in declaration order (made once per class: they are frozen, and
        every generation's options are built from them)."""
        made = _SPECS.get(cls)
        if made is None:
            made = []
            for f in fields(cls):
                m = dict(f.metadata["opt"])
                kind = m.pop("kind") or type(f.default)
                m.setdefault("gen_key", f.name)
                made.append(OptionSpec(name=f.name, kind=kind, default=f.default, **m))
            made = _SPECS[cls] = tuple(made)
        return list(made)

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
        with ``pair_of``, "A:B" also sets the paired option to B, and a single value A typed by the user — a key of
        ``typed`` — sets both to A unless the paired option is typed too: ``--temperature 0.3`` is a constant 0.3);
        ``typed``: key → what the user typed (for messages; default: the key itself).

        Raises:
            UsageError: unknown option (or one of another family's decoder), bad value, or a combination
                :meth:`check` rejects.
        """
        typed_in = dict(typed or {})
        known = {s.name: s for s in cls.specs()}
        alias = cls.aliases()
        out, typed_out, constant = {}, {}, {}
        for key, v in values.items():
            name = key if key in known else alias.get(key)
            shown = typed_in.get(key, key)
            if name is None:
                raise unknown_option(key, shown, cls)
            spec = known[name]
            if spec.pair_of and isinstance(v, str) and ":" in v:
                v, out[spec.pair_of] = spec.split_pair(v, known[spec.pair_of], shown)
                if key in typed_in:
                    typed_out[spec.pair_of] = shown
            elif spec.pair_of and key in typed_in:
                constant[spec.pair_of] = (v, shown)
            out[name] = spec.coerce(v, shown)
            if key in typed_in:  # what the user typed (not checkpoint defaults): named in messages
                typed_out[name] = shown
        for pair, (v, shown) in constant.items():  # a single value typed for a pair: constant (A = B)
            if pair not in typed_out:  # unless the user set the pair itself too
                out[pair] = known[pair].coerce(v, shown)
                typed_out[pair] = shown
        obj = cls(**out)
        obj.check(typed_out)
        return obj

    def check(self, typed: Mapping[str, str]) -> None:
        """Cross-field rules (override); raise UsageError naming what the user typed."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Decoder:
    """One decoder's registration, declared next to its options class with :func:`decoder` (docs/ARCHITECTURE.md,
    "Adding a decoder"); every table the front ends and runners read is derived from these
    (:mod:`localdiff.decoding.options`).

    Attributes:
        name: the ``decoder`` option's value and ``Options.POLICY`` ("sdar").
        family: the model family whose runner runs it (``localdiff.arch`` registry families: "masked", "block", ...).
        options: its :class:`Options` subclass.
        policy: ``"module:Class"`` of the policy class its family's loop drives (imported on first use, so the
            registry stays torch-free); None where the runner's own loop is the decoder (Fast-dLLM v2, ReFusion).
        model_types: ``model_type`` values (lower case) that run it by default ("dream", "fast_dllm_qwen").
        family_default: the decoder of the family's other models.
        selectable: every model of the family may run it (``decoder`` option), not only its own model types.
    """

    name: str
    family: str
    options: type
    policy: str | None = None
    model_types: tuple[str, ...] = ()
    family_default: bool = False
    selectable: bool = False


#: every decoder's declaration by name, in declaration order (:mod:`localdiff.decoding.options` imports the option
#: modules in a fixed order: the first declaration of a shared option name gives its flag's help), and the derived
#: name → options class map; both filled by :func:`decoder`, read by the registry and :func:`unknown_option`
DECODERS: dict[str, Decoder] = {}
POLICIES: dict[str, type[Options]] = {}
ALIASES: dict[str, str] = {}


def decoder(
    name: str,
    family: str,
    policy: str | None = None,
    model_types: tuple[str, ...] = (),
    family_default: bool = False,
    selectable: bool = False,
):
    """Class decorator declaring an :class:`Options` subclass as the options of decoder ``name`` (arguments: the
    :class:`Decoder` fields); sets ``cls.POLICY = name`` and registers it.

    Raises:
        ValueError: ``name`` is declared by another class already.
    """

    def register(cls):
        old = POLICIES.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"decoder {name!r} is declared twice ({old.__qualname__}, {cls.__qualname__})")
        cls.POLICY = name
        DECODERS[name] = Decoder(
            name, family, cls, policy, tuple(t.lower() for t in model_types), family_default, selectable
        )
        POLICIES[name] = cls
        for spec in cls.specs():
            for a in spec.aliases:
                ALIASES.setdefault(a, spec.name)
        return cls

    return register


def undeclare(name: str) -> None:
    """Remove decoder ``name`` from the registry (tests that declare one of their own)."""
    DECODERS.pop(name, None)
    POLICIES.pop(name, None)
    ALIASES.clear()
    for cls in POLICIES.values():
        for spec in cls.specs():
            for a in spec.aliases:
                ALIASES.setdefault(a, spec.name)


def unknown_option(key: str, typed: str, cls: type[Options] | None = None) -> UsageError:
    """The one-line error for an option no policy (or not this model's policy) knows."""
    import difflib

    owners = [c.POLICY for c in POLICIES.values() if key in c.names()]
    if cls is not None and owners:
        named = "" if typed == key else f"'{key}' is "  # ("top_k: 'top_k' is ..." named it twice)
        return UsageError(
            f"{typed}: {named}an option of the {', '.join(owners)} decoder, not of this model's "
            f"({cls.POLICY}); its options: {', '.join(cls.names())}"
        )
    pool = sorted({n for c in POLICIES.values() for n in c.names()} | set(ALIASES))
    near = difflib.get_close_matches(key, pool, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return UsageError(f"{typed}: unknown decoder option '{key}'{hint}")
