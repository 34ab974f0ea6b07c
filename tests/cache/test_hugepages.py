"""localdiff.hugepages: weights copied out of the memory-mapped file into huge-page-advised memory keep their values
(and dtype conversion), small tensors are left alone, and the loader's CPU weights no longer view the file."""

from __future__ import annotations

import torch

from localdiff import hugepages


def test_resident_copies_equal_values_and_converts():
    t = torch.randn(3, 1 << 20)  # 12 MiB fp32
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
    assert not hugepages.advise(torch.empty(1 << 10, dtype=torch.uint8))  # no 2 MiB-aligned interior


def test_resident_copies_a_mapped_file_tensor(tmp_path):
    """A tensor of a safetensors file (a view of its mmap) over the size limit comes back as a copy."""
    from safetensors.torch import save_file

    from localdiff.hugepages import resident

    w = torch.randn(1 << 21)  # 8 MiB
    save_file({"w": w}, str(tmp_path / "x.safetensors"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "x.safetensors"), framework="pt", device="cpu") as h:
        mm = h.get_tensor("w")
        r = resident(mm)
    assert torch.equal(r, w)
    if hugepages.available():
        assert r.data_ptr() != mm.data_ptr()


def test_fits_in_memory_reads_memavailable(monkeypatch, tmp_path):
    """A checkpoint larger than the memory available stays memory-mapped (the loader asks this first)."""
    from pathlib import Path

    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       1000 kB\nMemAvailable:    100 kB\n")
    real = Path.read_text
    monkeypatch.setattr(
        Path, "read_text", lambda self, *a, **k: real(info) if str(self) == "/proc/meminfo" else real(self, *a, **k)
    )
    assert hugepages.fits_in_memory(80 * 1024) and not hugepages.fits_in_memory(81 * 1024)


def test_loader_keeps_weights_mapped_when_they_do_not_fit(monkeypatch):
    """With copies refused, no weight is copied and the loaded weights equal the copied ones."""
    import localdiff
    from localdiff import loader

    copied = localdiff.load("tiny").net.state_dict()
    monkeypatch.setattr(loader, "fits_in_memory", lambda nbytes: False)
    monkeypatch.setattr(loader, "resident", lambda *a, **k: (_ for _ in ()).throw(AssertionError("copied")))
    mapped = localdiff.load("tiny").net.state_dict()
    assert copied.keys() == mapped.keys() and all(torch.equal(copied[k], mapped[k]) for k in copied)
