"""Every decoder policy class conforms to its loop's protocol (localdiff.decoding.protocols, issue #41 item 1)."""

from __future__ import annotations

import pytest
import torch

from localdiff.decoding.options import policy_classes
from localdiff.decoding.protocols import BlockPolicy, WindowPolicy, conforms
from localdiff.decoding.canvas_reuse import CanvasEBReuse

# every declared decoder with a policy class, by the loop that drives it (the canvas and block families' block loop,
# the masked family's window loop)
BLOCK = {**policy_classes("canvas"), "canvas_reuse": CanvasEBReuse, **policy_classes("block")}
WINDOW = policy_classes("masked")


@pytest.mark.parametrize("name", sorted(BLOCK))
def test_block_loop_policies_conform(name):
    assert conforms(BLOCK[name], BlockPolicy) == []


@pytest.mark.parametrize("name", sorted(WINDOW))
def test_window_loop_policies_conform(name):
    assert conforms(WINDOW[name], WindowPolicy) == []


@pytest.mark.parametrize("name", ["llada", "dream"])
def test_window_policy_instances_have_the_loop_attributes(name):
    from localdiff.decoding.options import POLICIES

    policy = WINDOW[name](POLICIES[name](), torch.Generator().manual_seed(0), 7)
    assert isinstance(policy, WindowPolicy) and isinstance(policy.parallel, bool)


def test_a_policy_that_misses_or_misnames_a_call_is_reported():
    class Broken:
        parallel = False

        def begin_window(self, start=None):  # the block loop's signature under the window call's name
            pass

    problems = conforms(Broken, WindowPolicy)
    assert any("begin_window" in p and "does not match" in p for p in problems)
    assert any("step is missing" in p for p in problems)
    assert conforms(Broken, BlockPolicy) and "Broken.assess is missing" in conforms(Broken, BlockPolicy)


def test_the_two_loops_open_a_block_through_differently_named_calls():
    """The block loop's ``begin_block(start)`` and the masked loop's ``begin_window(masked, steps, offset)`` differ
    in name, so a policy written for one loop cannot be handed to the other and fail only inside it."""
    assert "begin_block" in vars(BlockPolicy) and "begin_window" not in vars(BlockPolicy)
    assert "begin_window" in vars(WindowPolicy) and "begin_block" not in vars(WindowPolicy)
    assert any(
        "begin_window is missing" in p
        for p in conforms(type("BlockOnly", (), {"begin_block": lambda s: 0}), WindowPolicy)
    )
