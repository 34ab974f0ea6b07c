"""What is installed: the embedded models and every complete snapshot in the Hugging Face cache (``localdiff list``),
one row per model, or per GGUF file of a GGUF repo. :mod:`localdiff.hub.models` names and resolves them."""

from __future__ import annotations

import json
from pathlib import Path

from localdiff.errors import CheckpointError
from localdiff.hub import catalog
from localdiff.hub.guard import changed_files
from localdiff.hub.hf_cache import cached_repos, repo_id_from_folder, repo_revisions, snapshot_status


def read_config(folder: Path) -> dict:
    """``folder``'s config.json as a dict; {} when it is missing, unreadable or not a JSON object."""
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, UnicodeDecodeError):
        return {}


def _weights_kind(cfg: dict) -> str:
    """A short precision label: the quantization method, else the stored dtype."""
    q = cfg.get("quantization_config")
    if isinstance(q, dict):
        return str(q.get("quant_method") or q.get("bits") or "quantized")
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype") or "?")


def _mark_draft(row: dict, cfg: dict) -> dict:
    """``row`` with ``draft`` (bool) and, for a draft, ``draft_for`` (its catalog targets)."""
    row["draft"] = catalog.is_draft(cfg)
    if row["draft"]:
        row["draft_for"] = catalog.draft_targets(row["name"])
    return row


def _dir_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def list_models(cache_dir: Path | None = None) -> list[dict]:
    """Models ready to load: the embedded ones and every *complete* repo snapshot in the HF cache with a config.json.

    Returns:
        list of dicts with keys name, repo, revision, commit, size_bytes, quant, path, backend ("torch" / "gguf": one
        row per pulled GGUF file, named ``org/repo:QUANT``), embedded, description, draft (a DFlash draft, which runs
        only as ``--draft`` of a target; then also draft_for: its catalog targets) and,
        for pulled repos, changed (repo paths modified since they were verified: run ``pull NAME --verify``).
        Partial pulls are left out. Repos in the catalog are named by their alias.
    """
    out: list[dict] = []
    for e in catalog.entries():
        if e.embedded and (e.embedded_path / "config.json").is_file():
            cfg = read_config(e.embedded_path)
            out.append(
                _mark_draft(
                    {
                        "name": e.alias,
                        "repo": None,
                        "revision": None,
                        "commit": None,
                        "size_bytes": _dir_size(e.embedded_path),
                        "quant": _weights_kind(cfg),
                        "path": str(e.embedded_path),
                        "backend": "torch",
                        "embedded": True,
                        "description": e.description,
                    },
                    cfg,
                )
            )
    for storage in cached_repos(cache_dir):
        repo = repo_id_from_folder(storage)
        for rev, commit in sorted(repo_revisions(storage).items()):
            entry = catalog.entry_for_repo(repo)
            allow = entry.allow_patterns if entry else catalog.DEFAULT_ALLOW_PATTERNS
            ignore = entry.ignore_patterns if entry else catalog.DEFAULT_IGNORE_PATTERNS
            snap = storage / "snapshots" / commit
            cfg = read_config(snap)
            if not cfg:
                out += _gguf_rows(storage, repo, rev, commit)
                continue
            status = snapshot_status(storage, commit, allow, ignore)
            if not status.complete:
                continue
            if entry is not None and entry.revision in (rev, commit):
                name = entry.alias
            else:
                name = repo if rev == "main" else f"{repo}@{rev}"
            out.append(
                _mark_draft(
                    {
                        "name": name,
                        "repo": repo,
                        "revision": rev,
                        "commit": commit,
                        "size_bytes": status.size_bytes,
                        "quant": _weights_kind(cfg),
                        "path": str(snap),
                        "backend": "torch",
                        "embedded": False,
                        "description": entry.description if entry else "",
                        "changed": changed_files(storage, commit, allow, ignore),
                    },
                    cfg,
                )
            )
    return out


def _gguf_rows(storage: Path, repo: str, rev: str, commit: str) -> list[dict]:
    """One row per complete GGUF file of a snapshot without config.json: named ``org/repo[@rev]:QUANT`` (or the
    catalog's ``<alias>-<quant>``), backend "gguf", quant from the file's header."""
    from localdiff.backends.gguf_config import cache_modes
    from localdiff.backends.gguf_file import read_header

    snap = storage / "snapshots" / commit
    rows = []
    for f in sorted(snap.rglob("*.gguf")):
        rel = str(f.relative_to(snap))
        if not f.is_file() or not snapshot_status(storage, commit, (rel,), ()).complete:
            continue
        try:
            h = read_header(f)
            quant = h.quant
        except CheckpointError:
            continue
        family = "block" if h.metadata.get("localdiff.family") == "block" else "masked"
        entry = next(
            (
                e
                for e in catalog.entries()
                if e.gguf_repo and e.gguf_repo.lower() == repo.lower() and e.gguf_revision in (rev, commit)
            ),
            None,
        )
        name = f"{entry.alias}-{quant.lower()}" if entry else (repo if rev == "main" else f"{repo}@{rev}") + f":{quant}"
        rows.append(
            {
                "name": name,
                "repo": repo,
                "revision": rev,
                "commit": commit,
                "size_bytes": f.stat().st_size,
                "quant": quant,
                "path": str(f),
                "backend": "gguf",
                "embedded": False,
                "engine": "llama.cpp",
                "family": family,
                "cache": cache_modes(family, h.architecture),
                "description": entry.description if entry else "",
                "draft": False,
                "changed": changed_files(storage, commit, (rel,), ()),
            }
        )
    return rows
