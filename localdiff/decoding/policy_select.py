"""Which of its family's decoder policies a model runs for one request (torch-free).

A model runs its own decoder policy (``FAMILY_POLICY`` / ``MODEL_POLICY``: LLaDA's or Dream's for the masked family)
unless the request selects one its family's models can all run besides (``FAMILY_POLICIES``: NAP's parallel-forced
decoding for the masked family): giving an option only that policy has (``trajectories``, ``think_length``, ...)
selects it, and a checkpoint whose ``generation_config.json`` carries such a key (``models/tiny-nap``) runs it by
default.
"""
from __future__ import annotations

from localdiff.decoding.options import FAMILY_POLICIES, POLICIES


def select(default: str, family: str, user_keys, config_keys=()) -> str:
    """The policy name for a request.

    Args:
        default: the model's own policy. family: its family.
        user_keys: option names / aliases the user gave (flags, env, config file, ``/set``, keyword arguments).
        config_keys: the checkpoint's generation_config keys.
    Returns:
        The first of (default, then the family's extra policies in order) whose options accept every user key and
        every config key that is an option of some family policy; else the first that accepts the user keys; else
        ``default`` (whose validation then names the unknown option's owner).
    """
    members = [default] + [p for p in FAMILY_POLICIES.get(family, ()) if p != default]
    if len(members) == 1:
        return default

    def accepts(name, keys):
        cls = POLICIES[name]
        known = set(cls.names()) | set(cls.aliases())
        return all(k in known for k in keys)

    family_names = {n for p in members for n in POLICIES[p].names()}
    user = [k for k in user_keys]
    both = user + [k for k in config_keys if k in family_names]
    for keys in (both, user):
        for p in members:
            if accepts(p, keys):
                return p
    return default
