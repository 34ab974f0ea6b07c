"""Step-level batching harness for the tests: a request run alone, and requests run as lanes of one
:class:`localdiff.engine.batch.Batcher` joining at given steps (optionally cancelled mid-way)."""

from __future__ import annotations

from localdiff.engine.batch import Batcher
from localdiff.events import Done


def alone(m, r: dict) -> list[int]:
    """The token ids of request ``r`` (``prompt`` + generate kwargs) run alone on model ``m``."""
    r = dict(r)
    return m.generate(r.pop("prompt"), **r).token_ids


def batched(m, reqs: list[dict], arrive: list[int], cancel_at: dict | None = None) -> tuple[list, Batcher, list]:
    """Run ``reqs`` as lanes (request i joins at step ``arrive[i]``); ``cancel_at``: {i: poll count that cancels}."""
    b = Batcher(m)
    got: list = [None] * len(reqs)
    widths = []

    def lane(i):
        def fn(view):
            r = dict(reqs[i])
            polls = [0]

            def cancel():
                polls[0] += 1
                return cancel_at is not None and polls[0] >= cancel_at.get(i, 1 << 30)

            for ev in view.stream(r.pop("prompt"), cancel=cancel, **r):
                if isinstance(ev, Done):
                    got[i] = ev.token_ids

        return fn

    step = 0
    while step <= max(arrive) or b.lanes:
        for i, a in enumerate(arrive):
            if a == step:
                b.add(lane(i))
        b.step()
        widths.append(len(b.lanes))
        step += 1
    return got, b, widths
