"""User configuration: a TOML file in the platformdirs config dir, ``LOCALDIFF_*`` environment variables, and flags.

Precedence, highest first: command-line flag > ``LOCALDIFF_*`` env > config file > the checkpoint's
``generation_config.json`` > built-in defaults. This module owns the first three layers; the last two are applied by
the engine (``Model.sampler_options(**overrides)``), so :func:`sampler_overrides` returns only the keys the user set.

Config file (``localdiff config path`` prints where; ``LOCALDIFF_CONFIG`` overrides the location)::

    default_model = "tiny"
    device = "cpu"            # or "cuda", "cuda:1", "auto"
    quant = "int8"            # optional: "int8" or "int4"
    max_new_tokens = 256
    seed = 0                  # optional; unset = a fresh random seed per run (printed with --json)
    theme = "textual-dark"    # the chat's theme (ctrl+t and `/set` in the chat write it and the values here)

    [sampler]                 # any decoder option (localdiff.decoding.options)
    max_denoising_steps = 16
    threshold = 0.9

Environment: ``LOCALDIFF_MODEL``, ``LOCALDIFF_DEVICE``, ``LOCALDIFF_QUANT``, ``LOCALDIFF_MAX_NEW_TOKENS``,
``LOCALDIFF_SEED``, and ``LOCALDIFF_<OPTION>`` for every decoder option (e.g. ``LOCALDIFF_MAX_DENOISING_STEPS``,
``LOCALDIFF_THRESHOLD``): names, types and ranges come from the option schema (:mod:`localdiff.decoding.options`).
"""

from __future__ import annotations

import difflib
import os
import stat
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import platformdirs

from localdiff.decoding.options import all_specs, coerce_setting, resolve_key, specs_by_key, unknown_option
from localdiff.errors import UsageError
from localdiff.setting_values import DTYPES, check_threads, coerce, dtype_name  # noqa: F401  (re-exported)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

APP_NAME = "localdiff"

_TOP_KEYS: dict[str, type] = {
    "default_model": str,
    "device": str,
    "quant": str,
    "max_new_tokens": int,
    "seed": int,
    "theme": str,
    "threads": int,
}
_ENV_OTHER = (
    "LOCALDIFF_CONFIG",
    "LOCALDIFF_DATA_DIR",
    "LOCALDIFF_DEBUG",
    "LOCALDIFF_NO_BNB",  # read elsewhere
    "LOCALDIFF_API_KEY",
    "LOCALDIFF_DTYPE",
    "LOCALDIFF_TIMEOUT",
    "LOCALDIFF_LLAMA_CPP_SDIST",
    "LOCALDIFF_BENCH_CACHE",
    "LOCALDIFF_BENCH_TINY_MDM",
    "LOCALDIFF_BENCH_GGUF_HISTORY",
    "LOCALDIFF_REQUIRE_GGUF",
    "LOCALDIFF_BENCH_BATCH_LAYERS",  # .ci/run: no GGUF skips
    "LOCALDIFF_INT8_KERNEL",
    "LOCALDIFF_NATIVE_INT8",
    "LOCALDIFF_NATIVE_INT4",
    "LOCALDIFF_CUDA_INT4",  # quantize/
    "LOCALDIFF_VOCAB_KERNEL",  # kernels/vocab.py
    "LOCALDIFF_NATIVE_EXPERTS",  # kernels/experts.py
    "LOCALDIFF_NATIVE_ATTEND",
    "LOCALDIFF_NATIVE_ROWOPS",  # kernels/attend, rowops
    "LOCALDIFF_NATIVE_INT4_VNNI",  # kernels/int4_vnni.py
    "LOCALDIFF_NATIVE_INT8_VNNI",  # kernels/int8_vnni.py
    "LOCALDIFF_HEAP",
)  # heap.py
_ENV_TOP = {
    "LOCALDIFF_MODEL": "default_model",
    "LOCALDIFF_DEVICE": "device",
    "LOCALDIFF_QUANT": "quant",
    "LOCALDIFF_MAX_NEW_TOKENS": "max_new_tokens",
    "LOCALDIFF_SEED": "seed",
    "LOCALDIFF_THREADS": "threads",
}


@dataclass(frozen=True)
class Config:
    """The user's settings from the config file and environment (flags are applied later by the CLI).

    Attributes:
        default_model: model used when ``-m`` is not given ("tiny" built in).
        device: "cpu", "cuda", "cuda:N", "auto" or None (the engine picks).
        quant: quantization name (e.g. "int8") or None.
        max_new_tokens: generation length cap in tokens, or None (engine default).
        seed: fixed seed, or None (random per run).
        theme: the chat's Textual theme name, or None (the chat's default).
        threads: CPU threads of the gguf backend (llama.cpp), or None (all cores).
        sampler: read-only mapping of decoder options set by the user (names from the option schema).
        path: the config file that was read (it may not exist).
        origins: read-only mapping key → "file" or "env:NAME" telling where each set value came from.
    """

    default_model: str = "tiny"
    device: str | None = None
    quant: str | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    theme: str | None = None
    threads: int | None = None
    sampler: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    path: Path | None = None
    origins: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def as_dict(self) -> dict:
        """Plain dict (JSON-serialisable) of the settings."""
        return {
            "default_model": self.default_model,
            "device": self.device,
            "quant": self.quant,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
            "theme": self.theme,
            "threads": self.threads,
            "sampler": dict(self.sampler),
            "path": str(self.path) if self.path else None,
            "origins": dict(self.origins),
        }


def config_path(env: Mapping[str, str] | None = None) -> Path:
    """Where the TOML config lives: ``$LOCALDIFF_CONFIG`` or ``<platformdirs user_config_dir>/config.toml``."""
    env = os.environ if env is None else env
    if env.get("LOCALDIFF_CONFIG"):
        return Path(env["LOCALDIFF_CONFIG"]).expanduser()
    return Path(platformdirs.user_config_dir(APP_NAME)) / "config.toml"


def data_path() -> Path:
    """The platformdirs user data dir (chat history and other state)."""
    return Path(platformdirs.user_data_dir(APP_NAME))


def _unknown(key: str, known: list[str], where: str) -> UsageError:
    if resolve_key(key) in specs_by_key():  # a decoder option written at the top level
        return UsageError(f"{where}: '{key}' is a decoder option: put it under [sampler] ({key} = ...)")
    near = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return UsageError(f"{where}: unknown setting '{key}'{hint}")


#: the largest config file read (a settings file is a few hundred bytes; ``/dev/zero`` read until memory ran out)
MAX_CONFIG_BYTES = 4 * 2**20


def _read_file(path: Path, named: str | None = None) -> dict:
    """The config file's TOML table. ``named``: the variable that named ``path`` (then a missing file is an error).

    Raises:
        UsageError: a named file is missing; the path is a folder or not a regular file (a device, a pipe); the file
            is over :data:`MAX_CONFIG_BYTES`, unreadable, not UTF-8 or not TOML.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
    except FileNotFoundError:
        if named:
            raise UsageError(
                f"config file {path} ({named}) does not exist; create it (an empty file is fine) or unset {named}"
            ) from None
        return {}
    except IsADirectoryError:
        fd = None
    except OSError as e:
        raise UsageError(f"cannot read config file {path}: {e.strerror or e}") from None
    if fd is None or stat.S_ISDIR(os.fstat(fd).st_mode):
        if fd is not None:
            os.close(fd)
        raise UsageError(f"config file {path} is a folder; it must be a TOML file (or set LOCALDIFF_CONFIG to one)")
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"config file {path} is not a regular file (a device or a pipe); it must be a TOML file")
        try:
            data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise UsageError(f"cannot read config file {path}: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise UsageError(
            f"config file {path} is over {MAX_CONFIG_BYTES // 2**20} MiB; a config file holds a few settings"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"config file {path} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "TOML files are UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"config file {path} is not valid TOML: {e}") from None
    except RecursionError:
        raise UsageError(f"config file {path} is not valid TOML: nested too deeply") from None
    except ValueError:  # int() of a number over sys.get_int_max_str_digits() (4300) digits
        raise UsageError(f"config file {path} has a number too long to read (over 4300 digits)") from None


def known_environment() -> set[str]:
    """Every ``LOCALDIFF_*`` variable some part of localdiff reads: the settings, the decoder options' (the option
    schema's ``env``) and the others (:data:`_ENV_OTHER`)."""
    return {*_ENV_TOP, *_ENV_OTHER, *(spec.env for spec in all_specs())}


#: variables with a fixed set of values (checked by :func:`check_environment`; others are checked where read)
_ENV_CHOICES = {
    "LOCALDIFF_NATIVE_INT8": ("0", "1", "fma", "off", "on", "false", "true", "no", "yes"),  # kernels/int8.py
    "LOCALDIFF_NATIVE_INT4": ("0", "1", "fma", "off", "on", "false", "true", "no", "yes"),  # kernels/int4.py
    "LOCALDIFF_DEBUG": ("0", "1", "off", "on", "false", "true", "no", "yes"),  # cli/dispatch.py
    "LOCALDIFF_NATIVE_EXPERTS": ("0", "1", "avx512", "off", "on", "false", "true", "no", "yes"),  # kernels/experts
    "LOCALDIFF_HEAP": ("0", "1", "off", "on", "false", "true", "no", "yes"),  # heap.py
    "LOCALDIFF_NATIVE_ATTEND": ("0", "1", "off", "on", "false", "true", "no", "yes"),  # kernels/attend.py
    "LOCALDIFF_NATIVE_ROWOPS": ("0", "1", "off", "on", "false", "true", "no", "yes"),  # kernels/rowops.py
    "LOCALDIFF_NATIVE_INT4_VNNI": ("0", "1", "off", "on", "false", "true", "no", "yes"),  # kernels/int4_vnni.py
    "LOCALDIFF_NATIVE_INT8_VNNI": ("0", "1", "off", "on", "false", "true", "no", "yes"),  # kernels/int8_vnni.py
    "LOCALDIFF_INT8_KERNEL": ("auto", "native", "int8pack", "dequant"),  # quantize/choose.py
    "LOCALDIFF_DTYPE": DTYPES,  # localdiff.load
    "LOCALDIFF_VOCAB_KERNEL": ("auto", "native", "torch"),  # kernels/vocab.py
    "LOCALDIFF_CUDA_INT4": ("auto", "tinygemm", "bnb", "dequant"),  # quantize/cuda4.py (BACKENDS + auto)
    "LOCALDIFF_NO_BNB": ("0", "1", "off", "on", "false", "true", "no", "yes"),  # quantize/int8.py
}


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """Refuse a ``LOCALDIFF_*`` variable that nothing reads (a typo would otherwise be ignored silently), with the
    nearest known name. Every subcommand runs it (``localdiff.cli.dispatch``).

    Raises:
        UsageError: ``unknown environment variable LOCALDIFF_X (did you mean LOCALDIFF_Y?); unset it or use a known
            LOCALDIFF_* name`` for the first unknown one (sorted).
    """
    env = os.environ if env is None else env
    known_env = known_environment()
    for var in sorted(v for v in env if v.startswith("LOCALDIFF_") and v not in known_env):
        tail = var[len("LOCALDIFF_") :]
        near = [k for k in sorted(known_env) if tail and k.endswith("_" + tail)]
        near = near or difflib.get_close_matches(var, sorted(known_env), n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise UsageError(f"unknown environment variable {var}{hint}; unset it or use a known LOCALDIFF_* name")
    for var, choices in _ENV_CHOICES.items():
        value = env.get(var)
        if value is not None and value.strip() and value.strip().lower() not in choices:
            raise UsageError(f"{var}={value!r}: use one of {', '.join(choices)} (or unset it)")


def load_user_config(env: Mapping[str, str] | None = None, path: Path | None = None) -> Config:
    """Read the config file, then apply ``LOCALDIFF_*`` environment variables on top.

    Args:
        env: environment mapping (default ``os.environ``).
        path: config file (default :func:`config_path`).
    Returns:
        A frozen Config. A missing file at the default place is not an error; one named by ``LOCALDIFF_CONFIG`` is.
    Raises:
        UsageError: a missing named file, one not regular or over :data:`MAX_CONFIG_BYTES`, invalid TOML, an
            unknown key or ``LOCALDIFF_*`` variable, or a value of the wrong type / out of range.
    """
    env = os.environ if env is None else env
    named = "LOCALDIFF_CONFIG" if path is None and env.get("LOCALDIFF_CONFIG") else None
    path = Path(path) if path is not None else config_path(env)
    raw = _read_file(path, named)
    top: dict[str, Any] = {}
    sampler: dict[str, Any] = {}
    origins: dict[str, str] = {}
    where = str(path)
    for key, value in raw.items():
        if key == "sampler":
            if not isinstance(value, dict):
                raise UsageError(f"{where}: [sampler] must be a table")
            for word, sv in value.items():
                sk, specs = resolve_key(word), specs_by_key()  # decoder options by name (the option schema)
                if sk not in specs:
                    raise unknown_option(word, f"{where}: [sampler] {word}")
                sampler[sk] = coerce_setting(sk, sv, f"{where}: [sampler] {word}")
                origins[sk] = "file"
        elif key in _TOP_KEYS:
            top[key] = coerce(key, value, _TOP_KEYS[key], where)
            if key == "default_model" and not top[key].strip():  # named here: gen said only "empty model name"
                raise UsageError(f"{where}: default_model: empty model name (remove the line for the default, tiny)")
            origins[key] = "file"
        else:
            raise _unknown(key, [*_TOP_KEYS, "sampler"], where)
    check_environment(env)
    for var, key in _ENV_TOP.items():
        if env.get(var, "") != "":
            top[key] = coerce(key, env[var], _TOP_KEYS[key], var)
            if key == "default_model" and not top[key].strip():
                raise UsageError(f"{var}: empty model name (unset it for the config's model or tiny)")
            origins[key] = f"env:{var}"
    for spec in all_specs():
        if env.get(spec.env, "") != "":
            sampler[spec.name] = coerce_setting(spec.name, env[spec.env], spec.env)
            origins[spec.name] = f"env:{spec.env}"
    _check_pair(sampler, where, origins)
    return Config(**top, sampler=MappingProxyType(sampler), path=path, origins=MappingProxyType(origins))


def _check_pair(sampler: Mapping[str, Any], where: str, origins: Mapping[str, str] | None = None) -> None:
    """t_min ≤ t_max; the message names where t_max came from (the file, or ``LOCALDIFF_T_MAX``)."""
    lo, hi = sampler.get("t_min"), sampler.get("t_max")  # a "MAX:MIN" string: its decoder checks the pair
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and hi < lo:
        got = (origins or {}).get("t_max", "")
        where = got[len("env:") :] if got.startswith("env:") else where
        raise UsageError(f"{where}: t_max: must be ≥ t_min ({sampler['t_min']}) (got {sampler['t_max']})")


def sampler_overrides(flags: Mapping[str, Any], config: Config) -> dict:
    """Merge sampler options: flag > env/file (already merged in ``config``).

    Args:
        flags: decoder options given on the command line (option names; None values mean "not given").
        config: from :func:`load_user_config`.
    Returns:
        dict of the options the user set anywhere; pass it to ``Model.sampler_options(**d)`` / ``generate(**d)``
        so the checkpoint's generation_config and the built-ins fill in the rest.
    Raises:
        UsageError: an unknown key, a bad value, or t_max < t_min after merging.
    """
    out = dict(config.sampler)
    for key, value in flags.items():
        if value is None:
            continue
        if key not in specs_by_key():
            raise unknown_option(key, "--" + key.replace("_", "-"))
        out[key] = value  # checked by the model's own decoder options (they resolve shared flag words)

    return out


def with_flags(config: Config, **flags: Any) -> Config:
    """A copy of ``config`` with the non-None top-level ``flags`` (model/device/quant/...) applied."""
    keymap = {"model": "default_model"}
    changes = {}
    for key, value in flags.items():
        if value is None:
            continue
        key = keymap.get(key, key)
        if key not in _TOP_KEYS:
            raise _unknown(key, list(_TOP_KEYS), "flag")
        changes[key] = coerce(key, value, _TOP_KEYS[key], "--" + key.replace("_", "-"))
    return replace(config, **changes)
