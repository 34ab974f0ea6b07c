"""The embedded tiny model's training recipe can't rot: generator, tokenizer, eval set, a few training steps."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny"
RECIPE = TINY / "recipe"

import tasks  # noqa: E402  (models/tiny/recipe is on pytest's pythonpath)


def test_generator_is_deterministic_and_covers_every_family():
    a = [tasks.sample(random.Random(7)) for _ in range(1)] + [
        tasks.sample(random.Random(7), family=f) for f in tasks.GENERATORS
    ]
    b = [tasks.sample(random.Random(7)) for _ in range(1)] + [
        tasks.sample(random.Random(7), family=f) for f in tasks.GENERATORS
    ]
    assert a == b
    rng = random.Random(3)
    fams = {tasks.sample(rng)["family"] for _ in range(500)}
    assert fams == set(tasks.GENERATORS)


@pytest.mark.parametrize("family", sorted(tasks.GENERATORS))
def test_answers_are_correct(family):
    rng = random.Random(11)
    for _ in range(50):
        it = tasks.sample(rng, family=family)
        p, a = it["prompt"], it["answer"]
        if family == "add":
            x, y = [int(t) for t in p.removeprefix("What is ").removesuffix("?").split(" + ")]
            assert a == f"{x} + {y} = {x + y}." and 10 <= x <= 99 and 10 <= y <= 99
        elif family == "reverse":
            assert a.split() == p.split(": ")[1].split()[::-1]
        elif family == "sort_letters":
            assert a.split() == sorted(p.split(": ")[1].split())
        elif family == "count_letter":
            ch, word = p.removeprefix("How many times does ").removesuffix("?").split(" appear in ")
            assert int(a) == word.split().count(ch)
        elif family == "list":
            nums = [int(t) for t in a.split(", ")]
            assert abs(nums[-1] - nums[0]) + 1 == len(nums) >= 10
        elif family in ("arith", "word_problem", "convert"):
            # every "x op y = z" clause is arithmetically right
            for clause in a.rstrip(".").split(". "):
                lhs, rhs = clause.split(" = ")
                toks = lhs.split()
                if family == "convert":
                    continue
                x, op, y = int(toks[0]), toks[1], int(toks[2])
                assert int(rhs) == (x + y if op == "+" else x - y) >= 0


def test_heldout_split_is_disjoint_and_eval_file_is_current():
    rng = random.Random(0)
    train = [tasks.sample(rng) for _ in range(3000)]
    assert not any(tasks.is_heldout(it["prompt"]) for it in train)
    shipped = [json.loads(x) for x in (TINY / "eval.jsonl").read_text().splitlines()]
    assert shipped == tasks.make_eval()  # regenerate with `python models/tiny/recipe/tasks.py`
    assert all(tasks.is_heldout(it["prompt"]) for it in shipped)
    assert not {it["prompt"] for it in shipped} & {it["prompt"] for it in train}
    per_fam = {f: sum(it["family"] == f for it in shipped) for f in tasks.GENERATORS}
    assert min(per_fam.values()) >= 30 and per_fam["add"] == 50 and per_fam["reverse"] == 50


def test_tokenizer_digits_letters_and_chat_template():
    from tokenizers import Tokenizer
    import jinja2

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    for i, s in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<mask>"]):
        assert tok.token_to_id(s) == i
    enc = tok.encode("27 + 58 = 85.", add_special_tokens=False)
    assert [t for t in enc.tokens if any(c.isdigit() for c in t)] == list("275885")  # one token per digit
    assert tok.encode("r e t t o", add_special_tokens=False).tokens == ["▁r", "▁e", "▁t", "▁t", "▁o"]
    tpl = jinja2.Environment().from_string((TINY / "chat_template.jinja").read_text())
    text = tpl.render(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        bos_token="<bos>",
    )
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.decode(tok.encode("What is 27 + 58?").ids) == "What is 27 + 58?"


def test_data_batches_pad_left_and_end_with_end_of_turn():
    import train
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    data = train.Data(tok, (TINY / "chat_template.jinja").read_text(), canvas=32, seed=0)
    p, a = data.encode_item({"prompt": "What is 27 + 58?", "answer": "27 + 58 = 85."})
    assert tok.decode(a[:-1]) == "27 + 58 = 85." and a[-1] == tok.token_to_id("<end_of_turn>")
    ids, mask, target = data.batch(16)
    assert ids.shape[0] == mask.shape[0] == target.shape[0] == 16 and target.shape[1] == 32
    assert bool(mask[:, -1].all()) and bool((ids[~mask] == train.PAD).all())
    assert int((target == tok.token_to_id("<end_of_turn>")).sum()) >= 1


def test_a_few_training_steps_lower_the_loss():
    import torch
    import train
    from tokenizers import Tokenizer
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(0)
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    model = DiffusionGemmaForBlockDiffusion(train.build_config(vocab, micro=True)).train()
    data = train.Data(tok, (TINY / "chat_template.jinja").read_text(), canvas=8, seed=0)
    batch = data.batch(16)
    gen = torch.Generator().manual_seed(0)
    _assert_loss_falls(
        model.parameters(), lambda step: train.loss_step(model, *batch, vocab=vocab, sc=step % 2 == 1, gen=gen)
    )


def _assert_loss_falls(params, loss_at) -> None:
    """30 AdamW steps of ``loss_at(step)`` on one fixed batch: starts near ln(vocab), ends below 70 % of that."""
    import torch

    opt = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for step in range(30):
        loss = loss_at(step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 4.5  # ~ln(365) at init
    assert last < 0.7 * first, losses


def test_train_script_writes_a_loadable_checkpoint(tmp_path):
    r = subprocess.run(
        [sys.executable, str(RECIPE / "train.py"), "--steps", "2", "--micro", "--batch", "4", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done: 2 steps" in r.stdout
    for f in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "chat_template.jinja"]:
        assert (tmp_path / f).is_file(), f
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "diffusion_gemma" and cfg["canvas_length"] == 8
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 5] and gen["pad_token_id"] == 0


def test_stage2_trainer_from_scratch_writes_a_checkpoint_localdiff_loads(tmp_path):
    """The shipped recipe's trainer (train_stage2.py, from a fresh reference initialisation) end to end."""
    r = subprocess.run(
        [
            sys.executable,
            str(RECIPE / "train_stage2.py"),
            "--steps",
            "2",
            "--micro",
            "--batch",
            "4",
            "--threads",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done: 2 steps" in r.stdout
    import localdiff

    m = localdiff.load(str(tmp_path))
    assert m.config.canvas_length == 8 and m.config.hidden_size == 64
    out = m.generate("What is 27 + 58?", max_new_tokens=8, seed=0)
    # a fresh model: any tokens, but the loop ran its steps and counted what it returned
    assert 1 <= out.stats.forwards <= 4 * m.sampler_options()["max_denoising_steps"]
    assert out.stats.new_tokens == len(out.token_ids) and 0 < len(out.token_ids) <= 8


def test_stage2_objective_steps_lower_the_loss(tmp_path):
    import torch
    import train
    import train_stage2
    from tokenizers import Tokenizer
    from transformers import DiffusionGemmaForBlockDiffusion

    from localdiff.loader import load_model

    torch.manual_seed(0)
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    train.save(DiffusionGemmaForBlockDiffusion(train.build_config(tok.get_vocab_size(), micro=True)), TINY, tmp_path)
    net, cfg = load_model(tmp_path, "cpu", torch.float32)
    net.train().requires_grad_(True)
    data = train.Data(tok, (TINY / "chat_template.jinja").read_text(), cfg.canvas_length, seed=0)
    ids, mask, target = next(train_stage2.batches(data, 8, pool=2))
    gen = torch.Generator().manual_seed(0)
    _assert_loss_falls(
        net.parameters(),
        lambda step: train_stage2.canvas_loss(net, ids, mask, target, 2, gen, self_condition=step % 2 == 1),
    )


def test_multi_turn_items_put_earlier_turns_in_the_prefix():
    import train
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    data = train.Data(tok, (TINY / "chat_template.jinja").read_text(), canvas=32, seed=0, history_prob=1.0)
    p, a = data.encode_item(
        {"prompt": "Reverse the letters: r i v e r", "answer": "r e v i r"},
        [{"prompt": "What is 12 + 34?", "answer": "12 + 34 = 46."}],
    )
    text = tok.decode(p, skip_special_tokens=False)
    assert text.count("<start_of_turn>user") == 2 and "12 + 34 = 46.<end_of_turn>" in text
    assert text.endswith("<start_of_turn>model\n") and tok.decode(a[:-1]) == "r e v i r"
    ids, mask, _ = data.batch(8)
    turns = [(row[m] == tok.token_to_id("<start_of_turn>")).sum().item() for row, m in zip(ids, mask)]
    assert all(t in (4, 6) for t in turns)  # every item follows 1 or 2 earlier (user, model) pairs
