"""Shared fixtures. Helper modules beside the tests (refmodels, gen_checkpoint, hub_stand_in, fakenet, arch_baby,
tuihelpers) are importable because pyproject's ``[tool.pytest.ini_options] pythonpath`` lists ``tests`` and the
recipe folders; no test edits sys.path."""

import pytest


@pytest.fixture(scope="session")
def ref_small(tmp_path_factory):
    """(reference model, checkpoint dir) of the 'small' random config, saved sharded."""
    from refmodels import build_reference, save_reference

    ref = build_reference("small", canvas_length=8)
    d = tmp_path_factory.mktemp("ck_small")
    save_reference(ref, d)
    return ref, d


@pytest.fixture(scope="session")
def ref_odd(tmp_path_factory):
    from refmodels import build_reference, save_reference

    ref = build_reference("odd", canvas_length=6, seed=3)
    d = tmp_path_factory.mktemp("ck_odd")
    save_reference(ref, d)
    return ref, d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A small random DiffusionGemma checkpoint with the embedded tokenizer (built once per session)."""
    from gen_checkpoint import shared_checkpoint

    return shared_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def tiny():
    """The embedded model, loaded once per test module."""
    import localdiff

    return localdiff.load("tiny", device="cpu")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a test module (``pytestmark = pytest.mark.usefixtures("one_thread")``), restored
    after it: baby models' tensors are tiny, and one thread is ~100x faster than two on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def broken_cc(monkeypatch, tmp_path):
    """$CC set to a compiler that always fails ("cc: error: something broke"), and the native kernels' build cache
    (:func:`localdiff.kernels.build.cache_dir`) in ``tmp_path``, so no cached library is found: for the fallback
    tests."""
    from localdiff.kernels import build as native

    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\necho 'cc: error: something broke' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path / "cache")
    return bad
