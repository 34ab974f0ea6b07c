"""localdiff.hugepages: weights copied out of the memory-mapped file into huge-page-advised memory keep their values
(and dtype conversion), small tensors are left alone, and the loader's CPU weights no longer view the file."""
from __future__ import annotations

import torch

from localdiff import hugepages


def test_resident_copies_equal_values_and_converts():
    t = torch.randn(3, 1 << 20)                              # 12 MiB fp32
    r = hugepages.resident(t)
    assert r.data_ptr() != t.data_ptr() or not hugepages.available()
    assert torch.equal(r, t) and r.is_contiguous()
    b = hugepages.resident(t, torch.bfloat16)
    assert b.dtype == torch.bfloat16 and torch.equal(b, t.to(torch.bfloat16))


def test_small_tensor_is_copied_too():
    """(so that no tensor keeps the checkpoint file mapped)"""
    t = torch.randn(16, 16)
    r = hugepages.resident(t)
    assert torch.equal(r, t) and (r.data_ptr() != t.data_ptr()) == hugepages.available()
    assert torch.equal(hugepages.resident(t, torch.bfloat16), t.to(torch.bfloat16))


def test_advise_when_available():
    t = torch.empty(8 << 20, dtype=torch.uint8)
    assert hugepages.advise(t) == hugepages.available()
    assert not hugepages.advise(torch.empty(1 << 10, dtype=torch.uint8))   # no 2 MiB-aligned interior


def test_resident_copies_a_mapped_file_tensor(tmp_path):
    """A tensor of a safetensors file (a view of its mmap) over the size limit comes back as a copy."""
    from safetensors.torch import save_file

    from localdiff.hugepages import resident

    w = torch.randn(1 << 21)                                   # 8 MiB
    save_file({"w": w}, str(tmp_path / "x.safetensors"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "x.safetensors"), framework="pt", device="cpu") as h:
        mm = h.get_tensor("w")
        r = resident(mm)
    assert torch.equal(r, w)
    if hugepages.available():
        assert r.data_ptr() != mm.data_ptr()
