"""What front ends (the chat, ``serve``) ask the engine about models without loading one: the installed models and
a model's catalog card. The chat and the server import these from :mod:`localdiff.engine`, never from the hub."""

from __future__ import annotations


def installed_models() -> list[dict]:
    """Models that load without a download (embedded + fully pulled): ``localdiff.hub.models.list_models()``.
    The chat's model switcher reads this, so the UI talks to the engine only."""
    from localdiff.hub import models as hub

    return list(hub.list_models())


def model_card(model) -> dict:
    """What the catalog says about a model, for front ends (the chat's start-up line, single-turn handling).

    Args:
        model: a :class:`Model` or a name ("tiny", "org/repo[@rev]", a checkpoint folder).
    Returns:
        {"name", "description", "single_turn": bool, "prompt_examples": list[str]}; empty description, False and
        [] for a model the catalog does not know (a folder or an uncatalogued repo).
    """
    from pathlib import Path

    from localdiff.hub import catalog

    name = str(getattr(model, "name", model) or "")
    path = getattr(model, "path", None)
    entry = None
    try:
        entry = catalog.lookup(name) or catalog.entry_for_repo(name.split("@", 1)[0])
        if entry is None and (path is not None or Path(name).is_dir()):
            where = Path(path if path is not None else name).resolve()
            entry = next(
                (
                    e
                    for e in catalog.entries()
                    if e.embedded_path is not None and Path(e.embedded_path).resolve() == where
                ),
                None,
            )
    except Exception:  # a broken catalog must not stop a chat from starting
        entry = None
    if entry is None:
        return {"name": name, "description": "", "single_turn": False, "prompt_examples": []}
    return {
        "name": name,
        "description": entry.description,
        "single_turn": bool(entry.single_turn),
        "prompt_examples": list(entry.prompt_examples),
    }
