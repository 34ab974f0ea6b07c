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
        Among the policies whose options accept every user key (the default and the family's extra policies), the
        first extra one that has an option of its own (one the default lacks) among the user or config keys; else
        the default when it accepts them; else the first that does; else ``default`` (whose validation then names
        the unknown option's owner).
    """
    extras = [p for p in FAMILY_POLICIES.get(family, ()) if p != default]
    if not extras:
        return default

    def known(name):
        cls = POLICIES[name]
        return set(cls.names()) | set(cls.aliases())

    user = list(user_keys)
    fits = [p for p in [default] + extras if all(k in known(p) for k in user)]
    given = set(user) | set(config_keys)
    for p in fits:
        if p != default and given & (set(POLICIES[p].names()) - known(default)):
            return p
    return default if default in fits or not fits else fits[0]
