"""Chat generation settings and the ``/set`` commands typed into the prompt.

``/set steps 8`` → ``max_denoising_steps=8``; ``/set threshold 0.9`` (confidence lock τ); ``/set entropy_bound 0.3``;
``/set seed 1`` (``/set seed none`` for a fresh seed each turn); ``/set max_tokens 128``; any other sampler option the
model reports in ``Model.sampler_options()`` by its own name. ``/set`` alone lists the current values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from localdiff.decoding.options import ALIASES as SCHEMA_ALIASES
from localdiff.decoding.options import DECODER, all_specs, resolve_for
from localdiff.errors import LocaldiffError, UsageError

#: Short names of the session settings accepted by /set → engine keyword (besides the option schema's aliases).
SESSION_ALIASES = {"max_tokens": "max_new_tokens", "tokens": "max_new_tokens"}


def aliases() -> dict:
    """Short names accepted by /set → engine keyword: the option schema's aliases plus the session settings."""
    return {**SCHEMA_ALIASES, **SESSION_ALIASES}


def known() -> dict:
    """Decoder options /set knows (name → OptionSpec), from the one schema (localdiff.decoding.options)."""
    return {spec.name: spec for spec in all_specs()}


@dataclass
class ChatSettings:
    """What each turn passes to ``Model.stream``.

    Attributes:
        max_new_tokens: cap on generated tokens per answer (None = the model's generation_config default).
        seed: RNG seed for every turn (reproducible answers), or None for a fresh draw.
        sampler: sampler-option overrides (engine keyword → value); empty = the model's defaults.
        system: system prompt for every turn (``/system TEXT``), or None.
    """

    max_new_tokens: int | None = None
    seed: int | None = None
    sampler: dict = field(default_factory=dict)
    typed: dict = field(default_factory=dict, repr=False)  # option → the /set word the user typed (messages)
    system: str | None = None

    def stream_kwargs(self) -> dict:
        """Keyword arguments for ``Model.stream`` (besides prompt and cache)."""
        extra = {"system": self.system} if self.system else {}
        return {"max_new_tokens": self.max_new_tokens, "seed": self.seed, **extra, **self.sampler}

    def persisted(self) -> dict:
        """The values ``/set`` changes, as config-file keys (None = unset): seed, max_new_tokens and each sampler
        option (see ``localdiff.tui.prefs.save_settings``)."""
        return {"seed": self.seed, "max_new_tokens": self.max_new_tokens, **self.sampler}

    def describe(self, defaults: dict | None = None) -> str:
        """One line per setting: overrides first, then the model's effective defaults (``defaults``)."""
        eff = dict(defaults or {})
        eff.update(self.sampler)
        parts = [
            f"max_tokens={self.max_new_tokens if self.max_new_tokens is not None else 'default'}",
            f"seed={self.seed if self.seed is not None else 'none'}",
        ]
        parts += [f"{k}={v}{'*' if k in self.sampler else ''}" for k, v in sorted(eff.items())]
        return "  ".join(parts)


def _coerce(key: str, raw: str, kind: type, lo, hi):
    text = raw.strip().lower()
    if kind is bool:
        if text in ("1", "true", "on", "yes"):
            return True
        if text in ("0", "false", "off", "no"):
            return False
        raise UsageError(f"/set {key}: expected on/off, got {raw!r}")
    try:
        number = float(text)
    except ValueError:
        raise UsageError(f"/set {key}: expected a number, got {raw!r}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise UsageError(f"/set {key}: expected a finite number, got {raw!r}")
    if kind is int and not number.is_integer():
        raise UsageError(f"/set {key}: expected a whole number, got {raw!r}")
    value = int(number) if kind is int else number
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise UsageError(f"/set {key}: {value} is outside {rng}")
    return value


def apply_set(settings: ChatSettings, args: str, model_options: dict | None = None) -> str:
    """Apply ``/set KEY VALUE`` (``args`` = the text after "/set") to ``settings`` in place.

    Args:
        model_options: the model's effective sampler options (``Model.sampler_options()``); keys there are settable
            too, typed like their current value.

    Returns:
        A one-line confirmation such as ``"max_denoising_steps = 8"``, or the settings listing for an empty ``args``.

    Raises:
        UsageError: unknown key, missing value, wrong type or out of range.
    """
    words = args.split()
    if not words:
        return settings.describe(model_options)
    if len(words) != 2:
        raise UsageError("usage: /set KEY VALUE  (keys: steps, threshold, entropy_bound, seed, max_tokens, ...)")
    word, raw = words[0].lower(), words[1]
    key = "max_new_tokens" if SESSION_ALIASES.get(word) == "max_new_tokens" else resolve_for(word, model_options)
    if key == "seed":
        settings.seed = None if raw.lower() in ("none", "off", "random") else _coerce("seed", raw, int, 0, 2**63 - 1)
        return f"seed = {settings.seed if settings.seed is not None else 'none'}"
    if key == "max_new_tokens":
        default = raw.lower() in ("default", "reset", "none")
        settings.max_new_tokens = None if default else _coerce(key, raw, int, 1, 1_000_000)
        return f"max_new_tokens = {settings.max_new_tokens if not default else 'model default'}"
    if raw.lower() in ("default", "reset"):
        settings.sampler.pop(key, None)
        return f"{key} = model default"
    model_options, specs = model_options or {}, known()
    if key not in specs or (model_options and key not in model_options):
        names = sorted({*(model_options or specs), "seed", "max_tokens"})
        raise UsageError(f"/set: unknown setting {words[0]!r}; one of: {', '.join(names)}")
    settings.sampler[key] = specs[key].coerce(raw, f"/set {words[0]}")
    settings.typed[key] = f"/set {words[0]}"
    return f"{key} = {settings.sampler[key]}"


def apply_set_checked(settings: ChatSettings, args: str, model=None) -> str:
    """``apply_set`` against a loaded model: its ``sampler_options()`` are the defaults and the engine's own range
    checks run on the result. On any error the settings are left exactly as they were.

    Raises:
        LocaldiffError (UsageError): as ``apply_set``, or the engine rejected the combination.
    """
    defaults: dict = {}
    if model is not None and hasattr(model, "sampler_options"):
        try:
            defaults = dict(model.sampler_options(decoder=settings.sampler.get(DECODER)))  # the chosen decoder's
        except Exception:
            defaults = {}
    before = (settings.max_new_tokens, settings.seed, dict(settings.sampler))
    try:
        note = apply_set(settings, args, defaults)
        if model is not None and hasattr(model, "sampler_options"):
            model.sampler_options(_typed=dict(settings.typed), **settings.sampler)
    except LocaldiffError:
        settings.max_new_tokens, settings.seed, settings.sampler = before
        raise
    return note
