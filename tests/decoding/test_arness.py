"""ARness (localdiff.decoding.arness, issue #21): DiffuCoder / NAP Local and Global AR-ness@k of a decoding order.
Every expected value below is computed by hand in the comment next to it."""

import random

import pytest

from localdiff.decoding import arness


def _both(commit_step, k):
    o = arness.decoding_order(commit_step)
    return arness.local_arness(o, k), arness.global_arness(o, k)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 9])
def test_left_to_right_is_one(k):
    assert _both([1, 2, 3, 4, 5, 6], k) == (1.0, 1.0)
    assert _both([1, 1, 2, 2, 3, 3], k) == (1.0, 1.0)  # two per step, left to right: still 1


def test_right_to_left_by_hand():
    # commit steps [4, 3, 2, 1] → order p = 3, 2, 1, 0 (N = 4)
    assert arness.decoding_order([4, 3, 2, 1]) == [3, 2, 1, 0]
    # local@1: p_1 = 3 needs p_0 = 2 but p_0 = -1 (prompt); 2 after 3, 1 after 2, 0 after 1: never a successor
    assert arness.local_arness([3, 2, 1, 0], 1) == 0.0
    # global@1: masked before each step {0..3}, {0,1,2}, {0,1}, {0}; only the last step takes the leftmost → 1/4
    assert arness.global_arness([3, 2, 1, 0], 1) == 0.25
    # global@2: leftmost two {0,1},{0,1},{0,1},{0}: steps 3 and 4 hit → 2/4
    assert arness.global_arness([3, 2, 1, 0], 2) == 0.5


def test_random_order_by_hand():
    # commit steps [1, 3, 4, 2] → order p = 0, 3, 1, 2
    o = arness.decoding_order([1, 3, 4, 2])
    assert o == [0, 3, 1, 2]
    # local@1: 0 after the prompt (−1) ✓; 3 after 0 ✗; 1 after 3 ✗; 2 after 1 ✓ → 2/4
    assert arness.local_arness(o, 1) == 0.5
    # local@2: t=1 needs p_0 = −1, p_−1 = −2 (prompt) ✓; t=4 needs p_3 = 1 ✓ and p_2 = 0 but p_2 = 3 ✗ → 1/4
    assert arness.local_arness(o, 2) == 0.25
    # global@1: masked {0..3}: 0 ✓; {1,2,3}: 3 ✗; {1,2}: 1 ✓; {2}: 2 ✓ → 3/4
    assert arness.global_arness(o, 1) == 0.75
    assert arness.global_arness(o, 2) == 0.75  # {1,2} still excludes 3 at step 2
    assert arness.global_arness(o, 3) == 1.0


def test_parallel_blocks_by_hand():
    # two blocks decoded in parallel (NAP-like): step 1 commits positions 0 and 2, step 2 commits 1 and 3;
    # one step's tokens taken left to right → order 0, 2, 1, 3
    o = arness.decoding_order([1, 2, 1, 2])
    assert o == [0, 2, 1, 3]
    # global@1: 0 ✓; {1,2,3}: 2 ✗; {1,3}: 1 ✓; {3}: 3 ✓ → 3/4
    assert arness.global_arness(o, 1) == 0.75
    # local@1: 0 after −1 ✓; 2 after 0 ✗; 1 after 2 ✗; 3 after 1 ✗ → 1/4
    assert arness.local_arness(o, 1) == 0.25


def test_template_positions_are_context():
    # step 0 = prefilled template token (NAP tags): left out, positions re-numbered over the decoded ones
    assert arness.decoding_order([0, 0, 1, 2, 0, 3]) == [0, 1, 2]
    s = arness.summary([0, 0, 1, 2, 0, 3])
    assert s["local@1"] == 1.0 and s["global@1"] == 1.0


def test_global_matches_a_direct_count_on_random_orders():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 30)
        order = rng.sample(range(n), n)
        for k in (1, 2, 5):
            done, hits = set(), 0
            for p in order:
                masked = sorted(set(range(n)) - done)
                hits += p in masked[:k]
                done.add(p)
            assert arness.global_arness(order, k) == hits / n


def test_summary_keys_batch_mean_and_empty():
    s = arness.summary([[1, 2, 3, 4], [4, 3, 2, 1]])
    assert s["global@1"] == (1.0 + 0.25) / 2 and s["local@1"] == 0.5
    assert set(s) == {f"{kind}@{k}" for kind in ("local", "global") for k in arness.KS}
    assert arness.summary([]) == {} and arness.summary([0, 0]) == {}
    assert arness.describe(s) == "ARness local@1 0.50 global@1 0.62"
    assert arness.describe({}) == ""


def test_bad_input():
    with pytest.raises(ValueError):
        arness.local_arness([0, 1], 0)
    with pytest.raises(ValueError):
        arness.global_arness([0, 0], 1)
