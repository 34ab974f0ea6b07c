"""Model names → folders on disk; pull / list / rm on the Hugging Face cache.

A model name is one of:

- a catalog alias from ``models/*.toml`` (``tiny`` → the embedded folder; ``diffusiongemma:26b-a4b`` → a Hub repo);
- ``org/name[@revision]`` — a Hub model repo (revision: branch, tag or commit; default ``main``);
- a path to a checkpoint directory (anything containing a path separator or naming an existing folder).

Downloads go to the standard Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``), so ``hf download`` and
``localdiff pull`` share files. See ``pull.py`` for the download itself, ``installed.py`` for what is installed
(``list_models``) and ``hf_cache.py`` for the layout.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from localdiff.hub import catalog, gguf_names
from localdiff.hub.catalog import CatalogEntry
from localdiff.errors import CheckpointError, ModelNotFoundError, UsageError
from localdiff.hub.guard import changed_files
from localdiff.hub.hf_cache import (
    hub_cache_dir,
    read_ref,
    remove_snapshot,
    repo_id_from_folder,
    snapshot_status,
    storage_folder,
)
from localdiff.hub.installed import list_models, read_config

_REPO_RE = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+)(?:@(?P<rev>[\w.\-/]+))?$")


@dataclass(frozen=True)
class Target:
    """A parsed model name.

    Attributes:
        kind: "embedded", "repo" or "path".
        name: the name as the user wrote it.
        repo: Hub repo id for kind "repo".
        revision: branch / tag / commit for kind "repo".
        path: folder for kinds "embedded" and "path".
        entry: the catalog entry when the name is (or maps to) a catalog model.
        quant: the quantization label of a GGUF name (``org/repo:Q4_K_M``, ``<alias>-q4_k_m``), else None.
    """

    kind: str
    name: str
    repo: str | None = None
    revision: str = "main"
    path: Path | None = None
    entry: CatalogEntry | None = None
    quant: str | None = None

    @property
    def allow_patterns(self) -> tuple[str, ...]:
        if self.quant:
            return gguf_names.patterns(self.quant)
        return self.entry.allow_patterns if self.entry else catalog.DEFAULT_ALLOW_PATTERNS

    @property
    def ignore_patterns(self) -> tuple[str, ...]:
        if self.quant:
            return ()
        return self.entry.ignore_patterns if self.entry else catalog.DEFAULT_IGNORE_PATTERNS

    @property
    def label(self) -> str:
        """ "org/name@revision" for repos, the folder for paths."""
        return f"{self.repo}@{self.revision}" if self.kind == "repo" else str(self.path)


def _looks_like_path(name: str) -> bool:
    base = name.split("@", 1)[0]
    return name.startswith((".", "~", os.sep)) or (os.sep != "/" and os.sep in base) or base.count("/") > 1


def parse_name(name: str) -> Target:
    """Classify a model name (no network, no disk writes).

    Raises:
        UsageError: empty name, an empty or invalid revision (``org/repo@``).
        ModelNotFoundError: neither an alias, an ``org/name`` repo id, nor an existing folder (with suggestions).
    """
    if not isinstance(name, str) or not name.strip():
        raise UsageError("empty model name")
    name = name.strip()
    tagged = gguf_names.split_repo_tag(name)
    if tagged is not None:
        t = parse_name(tagged[0])
        if t.kind == "repo":
            return replace(t, name=name, quant=tagged[1])
    entry = catalog.lookup(name)
    if entry is None and (tagged := gguf_names.split_alias_tag(name)) is not None:
        base = catalog.lookup(tagged[0])
        if base is not None and base.gguf_repo:
            return Target("repo", name, repo=base.gguf_repo, revision=base.gguf_revision, entry=base, quant=tagged[1])
        if base is not None:
            raise ModelNotFoundError(
                f"{tagged[0]} has no GGUF files in the catalog, so no {tagged[1]} "
                f"quantization (pull {tagged[0]} itself, or a GGUF repo as org/repo:{tagged[1]})"
            )
    if entry is not None:
        if entry.embedded:
            return Target("embedded", name, path=entry.embedded_path, entry=entry)
        return Target("repo", name, repo=entry.repo, revision=entry.revision, entry=entry)
    p = Path(name).expanduser()
    if p.is_dir():
        return Target("path", name, path=p.resolve())
    if name.endswith("@") and _REPO_RE.match(name[:-1]) and not _looks_like_path(name):
        raise UsageError(f"{name}: empty revision after '@' (give a branch, tag or commit hash, or drop the '@')")
    m = _REPO_RE.match(name)
    if m and not _looks_like_path(name):
        repo = m.group("repo")
        rev = check_revision(m.group("rev") or "main")
        return Target("repo", name, repo=repo, revision=rev, entry=catalog.entry_for_repo(repo))
    if _looks_like_path(name) or p.exists():
        what = "is not a directory" if p.exists() else "does not exist"
        raise ModelNotFoundError(f"model folder {name} {what}")
    raise ModelNotFoundError(_unknown_message(name))


def check_revision(rev: str) -> str:
    """A revision must be a valid git ref name (``git check-ref-format`` rules) or a commit hash: no ``..``, no
    empty, ``.``-leading or ``.lock``-ending component, no trailing ``.`` / ``/`` — so ``refs/<revision>`` in the
    cache can never point outside the repo's folder. Returns ``rev``.

    Raises:
        UsageError: an invalid revision.
    """
    parts = rev.split("/")
    bad = (
        not rev
        or ".." in rev
        or rev.endswith(".")
        or rev == "@"
        or "@{" in rev
        or any(not p or p.startswith(".") or p.endswith(".lock") for p in parts)
    )
    if bad or not re.fullmatch(r"[\w.\-/]+", rev):
        raise UsageError(
            f"invalid revision {rev!r}: use a branch, tag or commit hash (git ref rules: no '..', no "
            "empty or '.'-leading part)"
        )
    return rev


def _unknown_message(name: str) -> str:
    pulled = [m["name"] for m in list_models()]
    near = catalog.suggest(name, extra=pulled)
    hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
    return (
        f"unknown model '{name}'{hint} (use a catalog name from `localdiff list --all`, org/name from the Hub, "
        "or a checkpoint folder)"
    )


def check_checkpoint_dir(path: Path) -> Path:
    """Cheap sanity checks on a checkpoint folder: it exists and holds a parseable ``config.json`` object.

    Raises:
        ModelNotFoundError: the folder does not exist.
        CheckpointError: no config.json, or it is not valid JSON / not an object.
    """
    if not path.is_dir():
        raise ModelNotFoundError(f"model folder {path} does not exist")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"{path} is not a checkpoint: it has no config.json")
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{cfg} must hold a JSON object")
    return path


def resolve_model(name: str) -> Path:
    """Return the checkpoint folder for a model name.

    Args:
        name: catalog alias, ``org/name[@revision]`` (must be completely pulled), or a checkpoint directory.
    Returns:
        Path of a folder with config.json (the embedded folder, the cache snapshot, or the directory itself).
    Raises:
        ModelNotFoundError: unknown name (with nearest-name suggestions), a repo that is not (completely) pulled —
            "not pulled: run `localdiff pull NAME`" —, or a missing folder.
        CheckpointError: the folder has no / a corrupt config.json.
    """
    t = parse_name(name)
    if t.kind == "embedded":
        if not t.path.is_dir():
            raise ModelNotFoundError(f"the embedded model '{name}' is missing from this install ({t.path})")
        return check_checkpoint_dir(t.path)
    if t.kind == "path":
        return check_checkpoint_dir(t.path)
    storage = storage_folder(t.repo)
    commit = read_ref(storage, t.revision)
    if commit is None:
        raise ModelNotFoundError(f"{t.label} is not pulled: run `localdiff pull {name}`")
    status = snapshot_status(storage, commit, t.allow_patterns, t.ignore_patterns)
    if not status.complete:
        snap = storage / "snapshots" / commit
        if (
            not any(snap.glob("*.safetensors"))
            and not any(snap.glob("*.gguf"))
            and not list(storage.glob("blobs/*.incomplete"))
        ):
            raise ModelNotFoundError(f"{t.label} is not pulled: run `localdiff pull {name}`")
        raise ModelNotFoundError(
            f"{t.label} is only partly pulled ({len(status.missing)} files missing): "
            f"run `localdiff pull {name}` to finish"
        )
    changed = changed_files(storage, commit, t.allow_patterns, t.ignore_patterns)
    if changed:
        raise CheckpointError(
            f"{t.label}: {changed[0]} changed on disk since it was verified"
            + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
            + f"; run `localdiff pull {name} --verify`"
        )
    if t.quant:
        snap = storage / "snapshots" / commit
        hits = sorted(p for p in snap.rglob("*.gguf") if gguf_names.matches(str(p.relative_to(snap)), t.quant))
        if len(hits) != 1:
            raise ModelNotFoundError(
                f"{t.label}: no single {t.quant} GGUF file in the snapshot: run `localdiff pull {name}`"
            )
        return hits[0]
    return check_checkpoint_dir(storage / "snapshots" / commit)


def describe_path(path: Path) -> str:
    """ "org/name@commit" when ``path`` is a snapshot in the HF cache, else the path itself (for --json output)."""
    path = Path(path).resolve()
    parts = path.parts
    for i in range(len(parts) - 2):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            return f"{repo_id_from_folder(Path(parts[i]))}@{parts[i + 2]}"
    return str(path)


def remove(name: str) -> dict:
    """Delete a pulled model from the HF cache: its snapshot, refs, unshared blobs and partial files.

    Returns:
        {"name", "repo", "commit", "freed_bytes"}.
    Raises:
        UsageError: an embedded model or a plain folder (not ours to delete); a GGUF ``NAME:QUANT`` whose snapshot
            also holds other quantizations (they would go with it).
        ModelNotFoundError: nothing of this model is in the cache.
        HubError: a pull of this repo is running (nothing is deleted).
    """
    try:
        t = parse_name(name)
    except ModelNotFoundError:
        raise ModelNotFoundError(f"'{name}' is not installed; nothing to remove (see `localdiff list`)") from None
    if t.kind == "embedded":
        raise UsageError(f"'{name}' is embedded in the package and cannot be removed")
    if t.kind == "path":
        raise UsageError(f"{name} is a folder, not a pulled model; delete it yourself if you mean to")
    storage = storage_folder(t.repo)
    commit = read_ref(storage, t.revision)
    if commit is None or not storage.is_dir():
        raise ModelNotFoundError(f"{t.label} is not in the cache ({hub_cache_dir()}); nothing to remove")
    if t.quant:  # a snapshot goes as a whole: never take other quantizations pulled beside this one with it
        snap = storage / "snapshots" / commit
        others = sorted(
            str(p.relative_to(snap))
            for p in snap.rglob("*.gguf")
            if not gguf_names.matches(str(p.relative_to(snap)), t.quant)
        )
        if others:
            whole = t.repo + ("" if t.revision == "main" else f"@{t.revision}")
            raise UsageError(
                f"{name}: {whole} also holds {', '.join(others)} in the same snapshot, and rm removes "
                f"a whole snapshot; run `localdiff rm {whole}` to remove every quantization in it"
            )
    from localdiff.hub.guard import no_pull_running

    with no_pull_running(storage, name):
        freed = remove_snapshot(storage, commit)
    return {"name": name, "repo": t.repo, "commit": commit, "freed_bytes": freed}


def pull(
    name: str, quiet: bool = False, progress=None, verify: bool = False, check_space: bool = True, force: bool = False
) -> dict:
    """Download a model into the HF cache, resuming partial files (see ``localdiff.hub.pull.pull``; ``force``: pull
    even when the model fits this machine in no precision)."""
    from localdiff.hub.pull import pull as _pull

    return _pull(parse_name(name), quiet=quiet, progress=progress, verify=verify, check_space=check_space, force=force)


def model_config(name: str, allow_network: bool = True) -> tuple[dict, Path | None, str]:
    """The config.json of a model, before or after a pull (for ``show``).

    Order: the pulled snapshot / folder; else the catalog's offline stand-in config; else (for ``org/name``) only
    config.json fetched from the Hub into the cache.

    Returns:
        (config dict, checkpoint folder or None when not pulled, source description).
    Raises:
        ModelNotFoundError / CheckpointError / HubError.
    """
    t = parse_name(name)
    try:
        folder = resolve_model(name)
        return read_config(folder), folder, str(folder)
    except ModelNotFoundError:
        if t.kind != "repo":
            raise
    if t.entry is not None and t.entry.offline_config is not None and t.entry.offline_config.is_file():
        try:
            cfg = json.loads(t.entry.offline_config.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"catalog stand-in config {t.entry.offline_config} is corrupt: {e}") from None
        return cfg, None, f"offline stand-in {t.entry.offline_config} (not pulled)"
    if not allow_network:
        raise ModelNotFoundError(f"{t.label} is not pulled: run `localdiff pull {name}`")
    from localdiff.hub.pull import fetch_config

    path = fetch_config(t)
    return read_config(path.parent), None, f"{t.label} config.json from the Hub (weights not pulled)"
