"""DFlash speculative decoding (arXiv 2602.06036) on tiny random Qwen3 targets + drafts in their upstream layouts:
lossless (greedy DFlash = the target's own greedy decoding, 20 prompts × several block sizes, whatever the draft),
the same tokens AND per-step acceptance lengths as z-lab/dflash ``dflash_generate`` (a test-side transcription in
tests/helpers/dflash_ref.py; checked against the PyPI package itself when installed), seeded sampling equal to the
reference's draws, the events the chat shows, one-line errors."""

from __future__ import annotations

import json
import pytest
import torch

import localdiff
from dflash_ref import (
    EOS,
    MASK,
    VOCAB,
    force_acceptance,
    load_ref_draft,
    ref_generate,
    target_config,
    write_draft,
    write_target,
)
from localdiff.errors import CheckpointError, UsageError
from localdiff.events import CanvasDone, StepEvent
from hub_fixtures import cache  # noqa: F401  (the Hub stand-in fixture: huggingface_hub pointed at it)

PROMPTS = [
    torch.randint(0, VOCAB - 3, (1, 4 + i % 7), generator=torch.Generator().manual_seed(100 + i)) for i in range(20)
]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{"random": ..., "forced": ...} → (target folder, draft folder, transformers target, reference draft). The
    forced pair agrees often by construction (tests/dflash_ref.force_acceptance)."""
    from transformers import Qwen3ForCausalLM

    out = {}
    for kind in ("random", "forced"):
        root = tmp_path_factory.mktemp(kind)
        ref = write_target(root / "target", "qwen3")
        write_draft(root / "draft", target_config("qwen3"), layers=2, block_size=5)
        if kind == "forced":
            force_acceptance(root / "target", root / "draft")
            ref = Qwen3ForCausalLM.from_pretrained(root / "target").eval()
        out[kind] = (root / "target", root / "draft", ref, load_ref_draft(root / "draft"))
    return out


@pytest.mark.parametrize("kind", ["random", "forced"])
def test_greedy_dflash_is_lossless(pairs, kind):
    target, draft, _, _ = pairs[kind]
    alone = localdiff.load(str(target), device="cpu")
    spec = localdiff.load(str(target), device="cpu", draft=str(draft))
    taus = []
    for p in PROMPTS:
        want = alone.generate(p[0].tolist(), max_new_tokens=24, chat=False).token_ids
        for bs in (2, 3, 5, 8):
            g = spec.generate(p[0].tolist(), max_new_tokens=24, chat=False, block_size=bs)
            assert g.token_ids == want, (bs, p)
            assert sum(g.stats.acceptance_lengths) == len(want) - 1  # the first token comes from the prefill
            assert max(g.stats.acceptance_lengths, default=0) <= bs
            taus.append(g.stats.acceptance_length)
    if kind == "forced":  # the construction really drafts several accepted tokens per step
        assert sum(taus) / len(taus) > 2.0
    assert spec.draft.block_size == 5


@pytest.mark.parametrize("kind", ["random", "forced"])
@pytest.mark.parametrize("bs", [None, 3, 8])
def test_tokens_and_acceptance_lengths_equal_the_reference(pairs, kind, bs):
    target, draft, ref, rdraft = pairs[kind]
    spec = localdiff.load(str(target), device="cpu", draft=str(draft))
    for p in PROMPTS[:6]:
        want, lengths = ref_generate(rdraft, ref, p, 24, [EOS], block_size=bs)
        g = spec.generate(p[0].tolist(), max_new_tokens=24, chat=False, block_size=bs)
        assert g.token_ids == want[0, p.shape[1] :].tolist()
        assert g.stats.acceptance_lengths == lengths


@pytest.mark.parametrize("t,top_p,top_k", [(1.0, 1.0, 0), (0.8, 0.9, 13)])
def test_seeded_sampling_equals_the_reference_draws(pairs, t, top_p, top_k):
    target, draft, ref, rdraft = pairs["forced"]
    spec = localdiff.load(str(target), device="cpu", draft=str(draft))
    for i, p in enumerate(PROMPTS[:4]):
        torch.manual_seed(i)
        want, lengths = ref_generate(rdraft, ref, p, 24, [EOS], t, top_p, top_k)
        g = spec.generate(p[0].tolist(), max_new_tokens=24, chat=False, seed=i, temperature=t, top_p=top_p, top_k=top_k)
        assert g.token_ids == want[0, p.shape[1] :].tolist()
        assert g.stats.acceptance_lengths == lengths


def test_the_transcription_equals_the_pypi_package(pairs):
    dm = pytest.importorskip("dflash.model")
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    target, draft, ref, rdraft = pairs["forced"]
    raw = json.loads((draft / "config.json").read_text())
    pk = dm.DFlashDraftModel(Qwen3Config(**raw)).eval()
    pk.load_state_dict(load_file(str(draft / "model.safetensors")), strict=False)
    dm._cuda_time = lambda: 0.0  # its stats timer synchronises CUDA
    for p in PROMPTS[:4]:
        r = dm.dflash_generate(pk, ref, p, 24, [EOS], return_stats=True)
        want, lengths = ref_generate(rdraft, ref, p, 24, [EOS])
        assert torch.equal(r.output_ids, want) and r.acceptance_lengths == lengths


def test_events_show_each_drafted_block_and_what_was_accepted(pairs):
    from localdiff.tui.runner import NEW, NOISY, TokenText, frame_from_step

    target, draft, _, _ = pairs["forced"]
    spec = localdiff.load(str(target), device="cpu", draft=str(draft))
    evs = list(spec.stream(PROMPTS[0][0].tolist(), max_new_tokens=24, chat=False))
    steps = [e for e in evs if isinstance(e, StepEvent)]
    done = evs[-1]
    assert len(steps) == len(done.stats.acceptance_lengths)
    out = []
    for e in evs:
        if isinstance(e, CanvasDone):
            out += e.token_ids[0].tolist()
    assert out == done.token_ids
    for e, produced in zip(steps, done.stats.acceptance_lengths):
        n = e.canvas_ids.shape[1]
        acc = int(e.accepted[0].sum())  # the last token + the accepted drafts
        assert 1 <= acc <= n and bool(e.renoised[0, acc:].all()) and not bool(e.renoised[0, :acc].any())
        assert produced <= acc  # + 1 bonus, unless EOS / max_new_tokens cut it
        frame = frame_from_step(e, TokenText(None), None, MASK)
        assert frame.count(NEW) == acc and frame.count(NOISY) == n - acc
    assert done.stats.draft_forwards == len(steps) and done.stats.forwards == len(steps) + 1


def test_errors_are_one_line(pairs, tmp_path):
    target, draft, _, _ = pairs["random"]
    with pytest.raises(UsageError, match="is a DFlash draft"):
        localdiff.load(str(draft), device="cpu")
    with pytest.raises(UsageError, match="causal targets"):
        localdiff.load("tiny", device="cpu", draft=str(draft))
    with pytest.raises(UsageError, match="not a DFlash draft"):
        localdiff.load(str(target), device="cpu", draft=str(target))
    with pytest.raises(UsageError, match="one prompt at a time"):
        localdiff.load(str(target), device="cpu", draft=str(draft)).generate([[3, 4], [5, 6]], chat=False)
    for change, what in (
        ({"hidden_size": 24}, "does not fit"),
        ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 9]}}, "target_layer_ids"),
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2"),
        ({"dflash_config": {}}, "mask_token_id"),
    ):
        bad = tmp_path / what.replace(" ", "_")
        write_draft(bad, dict(target_config("qwen3"), **({"hidden_size": 24} if "hidden_size" in change else {})))
        raw = json.loads((bad / "config.json").read_text())
        raw.update(change)
        (bad / "config.json").write_text(json.dumps(raw))
        with pytest.raises((CheckpointError, UsageError), match=what) as e:
            localdiff.load(str(target), device="cpu", draft=str(bad))
        assert "\n" not in str(e.value)


@pytest.fixture
def stand_in(pairs):
    """The Hub stand-in (tests/helpers/hub_stand_in.py) serving the random pair under the catalog's repo names."""
    from hub_stand_in import StandInHub

    target, draft, _, _ = pairs["forced"]
    with StandInHub() as h:
        for repo, folder in (("Qwen/Qwen3-8B", target), ("z-lab/Qwen3-8B-DFlash-b16", draft)):
            h.add_as_catalog(repo, {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()})
        yield h


def test_pull_both_by_alias_then_draft_auto_from_the_catalog_pairing(cache, stand_in, pairs):
    from localdiff.hub import models as hub

    target, _, _, _ = pairs["forced"]
    for alias in ("qwen3:8b", "qwen3-8b-dflash"):
        hub.pull(alias, quiet=True)
    names = [m["name"] for m in hub.list_models()]
    assert "qwen3:8b" in names and "qwen3-8b-dflash" in names
    m = localdiff.load("qwen3:8b", device="cpu", draft="auto")
    alone = localdiff.load(str(target), device="cpu")
    p = PROMPTS[3][0].tolist()
    g = m.generate(p, max_new_tokens=20, chat=False)
    assert g.token_ids == alone.generate(p, max_new_tokens=20, chat=False).token_ids and g.stats.acceptance_lengths
    with pytest.raises(UsageError, match="pairs no draft"):
        localdiff.load(str(target), device="cpu", draft="auto")


def test_chat_shows_each_drafted_block_and_how_much_was_accepted(pairs):
    import threading

    from localdiff.tui.runner import CanvasText, FrameSlot, GenerationFinished, GenerationJob, run_generation
    from localdiff.tui.widgets.canvas_view import CanvasView

    target, draft, _, _ = pairs["forced"]
    spec = localdiff.load(str(target), device="cpu", draft=str(draft))
    posted = []
    run_generation(
        spec,
        None,
        GenerationJob(PROMPTS[2][0].tolist(), {"max_new_tokens": 20}),
        FrameSlot(),
        posted.append,
        threading.Event(),
    )
    done = posted[-1]
    assert isinstance(done, GenerationFinished) and done.error is None
    frames = [m.frame for m in posted if isinstance(m, CanvasText) and m.frame is not None and m.frame.drafted]
    assert len(frames) == len(done.stats.acceptance_lengths)
    view = CanvasView()
    for f, produced in zip(frames, done.stats.acceptance_lengths):
        view.show(f)
        acc = f.count("new") - 1
        assert view.border_title == f"drafted block {f.canvas_index} · accepted {acc}/{len(f.states) - 1}"
        assert produced <= acc + 1  # the accepted drafts + the target's token (fewer at EOS / the cap)


def test_cli_gen_draft_json_equals_the_target_alone_and_reports_tau(pairs, capsys):
    from localdiff.cli import main

    from wordlevel import save_wordlevel_tokenizer

    target, draft, _, _ = pairs["forced"]
    target = target.parent / "with-tokenizer"
    if not target.exists():
        import shutil

        shutil.copytree(pairs["forced"][0], target)
        save_wordlevel_tokenizer(target, VOCAB)
    ids = " ".join(f"t{i}" for i in PROMPTS[5][0].tolist())
    base = ["gen", "-m", str(target), "--raw", "-n", "16", "--temperature", "0", "--json", "-p", ids]
    assert main(base) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft", str(draft), "--block-size", "4"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == alone["token_ids"] and spec["sampler"]["block_size"] == 4
    assert spec["draft"] == str(draft) and alone["draft"] is None
    lengths = spec["stats"]["acceptance_lengths"]
    assert (
        lengths
        and max(lengths) <= 4
        and spec["stats"]["acceptance_length"] == pytest.approx(sum(lengths) / len(lengths))
    )
    assert main(base[:-3] + ["-v", "--draft", str(draft), "-p", ids]) == 0
    assert "DFlash τ" in capsys.readouterr().err
    assert main(["serve", "--draft", str(target)]) == 2  # serve runs drafts (tests/serve/test_serve_drafts.py)
    assert "not a DFlash draft model" in capsys.readouterr().err


def test_the_shipped_tiny_pair_is_lossless_and_drafts_more_than_one_token():
    from localdiff.paths import models_dir

    root = models_dir() / "tiny-dflash"
    assert (root / "draft" / "config.json").is_file(), "models/tiny-dflash is shipped with the package"
    alone = localdiff.load("tiny-qwen3", device="cpu")
    spec = localdiff.load("tiny-qwen3", device="cpu", draft="auto")
    lengths = []
    for prompt in ("What is 41 + 93?", "Reverse the letters: d r a g o n", "Sort these words: elk cat gnu"):
        g = spec.generate(prompt, max_new_tokens=32)
        assert g.token_ids == alone.generate(prompt, max_new_tokens=32).token_ids
        lengths += g.stats.acceptance_lengths
    assert sum(lengths) / len(lengths) > 1.5
