"""The gguf backend's head-row contract (``rows`` / ``select``, as ``localdiff.arch.masked.MaskedLM``: the masked
loop reads only still-masked rows) and the bench's one-line skip when llama.cpp's program cannot be built."""

from __future__ import annotations

import pytest
import torch

from gguf_models import need as _need


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    _need("gguf")
    _need("llama_cpp")
    import gguf_models as gm

    import localdiff

    _, path = gm.write_both("llada", tmp_path_factory.mktemp("rows"), q8=False, seed=5)
    return localdiff.load(str(path), threads=1).net


def test_rows_and_select_are_the_full_pass_cut_and_zeroed(net):
    torch.manual_seed(0)
    ids = torch.randint(10, 100, (2, 13))
    full = net.logits_full(ids)
    assert full.shape == (2, 13, net.n_vocab)
    sel = torch.rand(2, 5) > 0.4
    part = net.logits_full(ids, rows=(6, 11), select=sel)
    assert torch.equal(part, torch.where(sel[..., None], full[:, 6:11], torch.zeros(())))
    one = net.logits_full(ids[:1], rows=(3, 9))
    assert torch.equal(one, full[:1, 3:9])


def test_rows_with_left_padding_keep_positions(net):
    ids = torch.tensor([[0, 0, 41, 42, 43, 44, 45], [50, 51, 52, 53, 54, 55, 56]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7]).bool()
    full = net.logits_full(ids, mask)
    assert torch.equal(full[0, :2], torch.zeros(2, net.n_vocab))
    alone = net.logits_full(ids[:1, 2:])  # the same real tokens, but at positions 0..4
    assert not torch.allclose(full[0, 2:], alone[0])  # positions kept as in the padded row (RoPE differs)
    part = net.logits_full(ids, mask, rows=(1, 5))
    assert torch.equal(part, full[:, 1:5])


def test_a_token_id_out_of_range_is_one_usage_error(net):
    from localdiff.errors import UsageError

    with pytest.raises(UsageError, match="out of range"):
        net.logits_full(torch.tensor([[1, net.n_vocab]]))


def test_without_cmake_the_program_build_is_skipped_with_one_line(monkeypatch, tmp_path):
    from localdiff.bench import gguf_cli

    monkeypatch.setenv("LOCALDIFF_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(gguf_cli.shutil, "which", lambda name: None if name == "cmake" else f"/usr/bin/{name}")
    with pytest.raises(gguf_cli.CliUnavailable) as e:
        gguf_cli.build_cli("0.3.36")
    assert str(e.value) == "no cmake on PATH: cannot build llama.cpp's llama-diffusion-cli"


def test_the_program_s_timing_and_answer_are_read_from_its_log(tmp_path):
    """``run_cli`` reads diffusion_generate's ``total time`` and the answer printed after it (llama-diffusion-cli's
    stderr log, the "0.00.273.081 I " prefix removed); a log without the timing is one error line."""
    from localdiff.bench import gguf_cli
    from localdiff.errors import LocaldiffError

    fake = tmp_path / "llama-diffusion-cli"
    fake.write_text(
        "#!/bin/sh\nprintf 'diffusion step: 3/3 [===] 100%%\\ntotal time: 12.50ms, time per step: 4.1ms\\n"
        "0.00.273.081 I \\n 41 + 93 = 134.\\n' >&2\n"
    )
    fake.chmod(0o755)
    r = gguf_cli.run_cli(fake, tmp_path / "m.gguf", "What is 41 + 93?", 20, steps=20, threads=1, block_length=4)
    assert (r["ms"], r["text"]) == (12.5, "41 + 93 = 134.")
    fake.write_text("#!/bin/sh\necho 'diffusion step: 1/3' >&2\n")
    with pytest.raises(LocaldiffError, match="llama-diffusion-cli failed"):
        gguf_cli.run_cli(fake, tmp_path / "m.gguf", "x", 20, steps=20, threads=1)


def test_the_realistic_size_checkpoint_is_a_llada_the_converter_and_both_backends_read(tmp_path):
    """``localdiff.bench.gguf_random`` (the bench's realistic-size model), at a small shape: the checkpoint loads
    on the torch path with the shape asked for, converts, and llama.cpp's logits agree with torch's."""
    _need("gguf")
    _need("llama_cpp")
    import localdiff
    from localdiff.bench.gguf_convert import convert_llada
    from localdiff.bench.gguf_random import random_llada
    from localdiff.paths import models_dir

    shape = {"d_model": 96, "n_layers": 2, "mlp_hidden_size": 200, "n_heads": 3}
    folder, n = random_llada(models_dir() / "tiny-mdm", tmp_path / "r", shape, seed=1)
    assert n == 2 * 365 * 96 + 96 + 2 * (4 * 96 * 96 + 3 * 96 * 200 + 2 * 96)
    ref = localdiff.load(str(folder))
    gg = localdiff.load(str(convert_llada(folder, tmp_path / "r.gguf")), threads=1)
    assert (ref.config.hidden_size, ref.config.num_hidden_layers) == (96, 2)
    ids = torch.tensor([ref.tokenizer.encode("<bos>7 + 5 =") + [6] * 9])
    a, b = ref.net.logits_full(ids), gg.net.logits_full(ids)
    assert ((a - b).abs().max() / a.abs().max()) <= 1e-3
