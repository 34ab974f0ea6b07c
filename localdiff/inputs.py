"""Checks of the Python API's generation arguments, with the command line's messages
(``localdiff.setting_values.coerce``).

``Model.generate`` / ``Model.stream`` call these before any work: a bad argument raises ``localdiff.errors.UsageError``
with one clear line, never a raw ValueError / TypeError / RuntimeError from deep inside torch. Sampler options are
checked elsewhere (``Model.sampler_options``).
"""

from __future__ import annotations

import numbers

from localdiff.errors import UsageError
from localdiff.setting_values import coerce

#: Chat roles the prompt may use (what the chat templates of the supported families render).
ROLES = ("system", "user", "assistant")


def _int_arg(key: str, value):
    """``value`` as an int via the CLI's coercion (messages "KEY: invalid value … (expected an integer)" and its range
    checks); strings and bools are refused here (the CLI parses strings; the API takes numbers)."""
    if isinstance(value, (str, bytes, bool)) or value is None:
        raise UsageError(f"{key}: invalid value {value!r} for '{key}' (expected an integer)")
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 and not isinstance(value, numbers.Number):
        value = value.item()  # a 0-d tensor / numpy scalar
    if not isinstance(value, numbers.Integral):
        raise UsageError(f"{key}: invalid value {value!r} for '{key}' (expected an integer)")
    return coerce(key, int(value), int, key)


def check_max_new_tokens(value) -> int | None:
    """``max_new_tokens`` of generate / stream: None (the model's default) or an int > 0.

    Raises:
        UsageError: a string, bool, float, or a value ≤ 0 (same message as the CLI's ``LOCALDIFF_MAX_NEW_TOKENS``).
    """
    return None if value is None else _int_arg("max_new_tokens", value)


def check_seed(value) -> int | None:
    """``seed`` of generate / stream: None (a fresh random seed) or an int in [0, 2**63), as ``--seed`` accepts.

    Raises:
        UsageError: a string, bool, float, a negative seed or one ≥ 2**63.
    """
    return None if value is None else _int_arg("seed", value)


def _is_int_like(x) -> bool:
    """A Python / numpy integer or a 0-d integer tensor / array (bools are not token ids)."""
    if isinstance(x, bool):
        return False
    if isinstance(x, numbers.Integral):
        return True
    dtype = getattr(x, "dtype", None)
    return getattr(x, "ndim", None) == 0 and dtype is not None and _int_dtype(dtype)


def _int_dtype(dtype) -> bool:
    name = str(dtype).replace("torch.", "")
    return name.startswith(("int", "uint")) or name == "long"


def _ids(seq, what: str) -> list[int]:
    out = []
    for x in seq:
        if not _is_int_like(x):
            raise UsageError(f"{what}: token ids must be integers (got {type(x).__name__} {x!r})")
        out.append(int(x))
    return out


def check_messages(messages: list) -> list[dict]:
    """Chat messages: dicts with a known ``role`` (:data:`ROLES`) and string ``content``.

    Raises:
        UsageError: naming the first bad message (1-based).
    """
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            raise UsageError(f"message {i}: expected a dict with 'role' and 'content' (got {type(m).__name__})")
        if m.get("role") not in ROLES:
            raise UsageError(f"message {i}: unknown role {m.get('role')!r} (use {', '.join(ROLES)})")
        if not isinstance(m.get("content"), str):
            raise UsageError(f"message {i}: content must be a string (got {type(m.get('content')).__name__})")
    return messages


def normalize_prompt(prompt):
    """A prompt in one of the accepted forms, with array-likes turned into plain lists of ints.

    Accepted: str; chat messages (list of dicts, see :func:`check_messages`); token ids as list[int] (Python or
    numpy integers, or 0-d integer tensors), a 1-D / 2-D integer LongTensor or numpy array ([T] or [B, T]);
    a list of those (a batch). Tensors are returned unchanged after their checks (shape and dtype).

    Raises:
        UsageError: a tensor / array with other than 1 or 2 dimensions or a non-integer dtype, non-integer ids,
            bad messages, or an unsupported type.
    """
    shape = getattr(prompt, "shape", None)
    if shape is not None and hasattr(prompt, "dtype") and not isinstance(prompt, (str, list)):
        if len(shape) not in (1, 2):
            raise UsageError(f"a tensor prompt must be token ids [T] or [B, T] (got {len(shape)} dimensions)")
        if not _int_dtype(prompt.dtype):
            raise UsageError(f"a tensor prompt must hold integer token ids (got dtype {prompt.dtype})")
        if type(prompt).__module__.startswith("numpy"):
            return prompt.tolist() if len(shape) == 1 else [list(r) for r in prompt.tolist()]
        return prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, tuple):
        prompt = list(prompt)
    if not isinstance(prompt, list):
        raise UsageError(
            f"unsupported prompt type {type(prompt).__name__} (use str, chat messages, token ids or a list of those)"
        )
    if prompt and isinstance(prompt[0], dict):
        return check_messages(prompt)
    if prompt and all(type(x) is int for x in prompt):  # plain ints, the common case: no per-id ABC checks
        return list(prompt)  # (~2 µs per id; a served prompt's ids: ~50 µs)
    if prompt and all(_is_int_like(x) for x in prompt):
        return _ids(prompt, "prompt")
    if prompt and any(_is_int_like(x) for x in prompt):
        return _ids(prompt, "prompt")  # a mix: name the first non-integer
    return [normalize_prompt(p) for p in prompt]
