"""localdiff.heap: after a load, a step's large temporaries come from the heap (no fresh page faults on reuse), the
weights still load as fresh mappings, LOCALDIFF_HEAP=0 leaves malloc alone, and tokens do not change."""

import resource
import sys

import pytest
import torch

import localdiff
from localdiff import heap

linux = pytest.mark.skipif(not sys.platform.startswith("linux") or heap._fn() is None, reason="glibc mallopt only")


REUSED = 800  # minor faults of three 40 MiB reuses: 0 from the heap; fresh mappings each time took 1,599 on a Zen 4
# VM (2 MiB pages for part of them) and 30,720 in 4 KiB pages; one of the three mapped afresh (532, once in CI after
# the GGUF tests' threads) still passes


def _faults_of_reuse(nbytes: int = 40 << 20) -> int:
    """Minor page faults of allocating, touching and freeing a tensor of ``nbytes`` three times (after a first)."""
    torch.ones(nbytes // 4)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        t = torch.ones(nbytes // 4)
        del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


@linux
def test_after_a_load_large_temporaries_do_not_fault_again():
    localdiff.load("tiny", device="cpu", dtype="float32")
    assert heap.status().startswith("step temporaries from the heap")
    assert _faults_of_reuse() < REUSED  # (was < 200: 532 once in CI)
    with heap.for_weights():  # while loading: the freed 40 MiB went back to the kernel,
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # so a weight copy's first touch faults
        torch.ones(10 << 20)
        # a fresh 40 MiB mapping faults at least once per 2 MiB page (19–20 with THP everywhere, 10,240 in 4 KiB pages;
        # 290 once in CI); the heap's reuse above faults ~0 times
        assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0 >= 16
    assert _faults_of_reuse() < REUSED  # restored


@linux
def test_off_switch(monkeypatch):
    monkeypatch.setenv(heap.ENV, "0")
    assert heap.for_steps() is False and heap.status() == f"malloc defaults ({heap.ENV}=0)"
    monkeypatch.delenv(heap.ENV)
    assert heap.for_steps() is True


def test_same_tokens_either_way():
    m = localdiff.load("tiny", device="cpu", dtype="float32")
    a = m.generate("What is 27 + 58?", seed=3, max_new_tokens=64).token_ids
    with heap.for_weights():
        b = m.generate("What is 27 + 58?", seed=3, max_new_tokens=64).token_ids
    assert a == b and len(a) > 0
