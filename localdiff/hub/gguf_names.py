"""GGUF model names: one quantization file of a GGUF repo, chosen by a tag.

* ``org/repo:Q4_K_M`` — the file of ``org/repo`` whose name carries the quantization label (as ``llama-server -hf
  org/repo:Q4_K_M`` and Ollama's ``hf.co/org/repo:Q4_K_M`` do); ``localdiff pull org/repo --quant Q4_K_M`` is the
  same name.
* ``<alias>-<quant>`` (``llada:8b-q4_k_m``) — a catalog entry with ``gguf_repo`` (``models/*.toml``) plus a label.

A label matches a file name case-insensitively when ``-``, ``.`` or ``_`` precede it and ``.gguf`` or ``-`` / ``.``
follow (``Q4_K_M`` in ``LLaDA-8B-Instruct-Q4_K_M.gguf``, not ``Q4_K`` in it). Split files (``-00001-of-00003.gguf``) are refused: one file
per model here.
"""

from __future__ import annotations

import fnmatch
import re

from localdiff.errors import HubError

#: quantization labels of llama.cpp files (``llama_ftype`` names: Q4_K_M, Q8_0, IQ4_XS, F16, BF16, TQ1_0, MXFP4 ...)
QUANT_RE = re.compile(
    r"^(?:[Qq]\d(?:_[Kk0-9])?(?:_[A-Za-z0-9]+)?|[Ii][Qq]\d_[A-Za-z0-9]+(?:_[A-Za-z0-9]+)?|"
    r"[Ff]16|[Ff]32|[Bb][Ff]16|[Tt][Qq]\d_\d|[Mm][Xx][Ff][Pp]4(?:_[Mm][Oo][Ee])?)$"
)
_SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def is_quant(label: str) -> bool:
    """True for a llama.cpp quantization label (case-insensitive)."""
    return bool(QUANT_RE.match(label or ""))


def patterns(quant: str) -> tuple[str, ...]:
    """fnmatch globs for the ``quant`` file in any letter case (fnmatch is case-sensitive on POSIX), the label
    bounded by ``-``, ``.`` or ``_`` (``*-Q4_K.gguf`` does not take ``*-Q4_K_M.gguf``)."""
    cls = "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in quant)
    return (f"*[-._]{cls}.gguf", f"*[-._]{cls}[-.]*.gguf")


def matches(path: str, quant: str) -> bool:
    """Whether a repo file is the ``quant`` GGUF (:func:`patterns`; not a split part)."""
    name = path.rsplit("/", 1)[-1]
    if _SPLIT_RE.search(name):
        return False
    return any(fnmatch.fnmatchcase(name, p) for p in patterns(quant))


def split_repo_tag(name: str) -> tuple[str, str] | None:
    """``org/repo[@rev]:QUANT`` → (``org/repo[@rev]``, QUANT upper-cased), else None."""
    if ":" not in name:
        return None
    base, tag = name.rsplit(":", 1)
    if base.count("/") == 1 and is_quant(tag):
        return base, tag.upper()
    return None


def split_alias_tag(name: str) -> tuple[str, str] | None:
    """``<alias>-<quant>`` → (alias, QUANT upper-cased), else None (the alias is checked by the caller)."""
    if "-" not in name:
        return None
    base, tag = name.rsplit("-", 1)
    return (base, tag.upper()) if is_quant(tag) else None


def pick(files: list, quant: str, label: str) -> list:
    """The one remote file (``RemoteFile``) of ``quant``; raises HubError listing the quantizations the repo has."""
    hits = [f for f in files if matches(f.path, quant)]
    if len(hits) == 1:
        return hits
    have = sorted(
        {
            m.group(0).upper()
            for f in files
            if f.path.lower().endswith(".gguf")
            for m in [
                re.search(
                    r"(?<![A-Za-z0-9])(I?Q\d[A-Z0-9_]*|B?F16|F32|TQ\d_\d)(?![A-Za-z0-9])",
                    f.path.rsplit("/", 1)[-1][:-5],
                    re.IGNORECASE,
                )
            ]
            if m
        }
    )
    if not hits:
        listed = f" (it has {', '.join(have)})" if have else " (it has no single-file .gguf)"
        raise HubError(f"{label} has no {quant} GGUF file{listed}")
    raise HubError(
        f"{label} has {len(hits)} {quant} GGUF files ({', '.join(f.path for f in hits[:3])}); pull one by its repo path"
    )
