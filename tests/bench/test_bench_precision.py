"""``localdiff bench --only precision`` (issue #24's accuracy line): the paired-seed statistics against hand-worked
values, and the section end to end on three items whose answers are the float32 path's own."""

import json
import math

import pytest

from localdiff.bench import precision
from localdiff.bench import run as bench


def test_t_quantiles():
    assert precision.t975(1) == 12.706 and precision.t975(20) == 2.086 and precision.t975(500) == 1.96
    with pytest.raises(ValueError):
        precision.t975(0)


def test_paired_difference_by_hand():
    p = precision.paired([12, 10, 9, 13], [10, 10, 10, 10], n_items=200)  # d = 2, 0, -1, 3
    sd = math.sqrt((1 + 1 + 4 + 4) / 3)
    half = 3.182 * sd / 2
    assert p["diffs"] == [2, 0, -1, 3] and p["mean_items"] == 1 and p["sd_items"] == pytest.approx(sd)
    assert p["mean_pt"] == pytest.approx(0.5)
    assert p["ci_pt"] == pytest.approx([(1 - half) * 0.5, (1 + half) * 0.5])
    assert precision.paired([3], [1], 100)["ci_pt"] is None
    with pytest.raises(ValueError):
        precision.paired([1, 2], [1], 10)


def test_verdict_needs_the_interval_above_minus_one_point():
    def rows(ds):
        return [
            {"seed": s, "float32": 100, "bfloat16": 100 + d, "float32 fast": 100 - d, "float64": 100}
            for s, d in enumerate(ds)
        ]

    assert precision.summarize(rows([1, 1, 0, 1, 0, 1, 1, 0]), 100)["within_1pt"] is True  # CI +0.19 … +1.06
    noisy = precision.summarize(rows([1, -1, 0, 2]), 100)  # mean +0.5 pt but CI −1.6 … +2.6: not shown
    assert noisy["within_1pt"] is False and noisy["bfloat16_minus_float32"]["ci_pt"][0] < -1
    lossy = precision.summarize(rows([-2, -3, -2, -3]), 100)
    assert lossy["within_1pt"] is False and lossy["bfloat16_minus_float32"]["mean_pt"] == -2.5
    assert lossy["float32_fast_within_1pt"] is True and lossy["float32_fast_minus_float32"]["mean_pt"] == 2.5
    assert precision.summarize(rows([3]), 100)["within_1pt"] is None


def test_section_end_to_end(tmp_path):
    import localdiff

    m = localdiff.load("tiny", device="cpu", dtype="float32")
    prompts = ["What is 27 + 58?", "Reverse the letters: c a t", "What is 13 + 40?"]
    g = m.generate(prompts, seed=0, max_new_tokens=64, chat=True)
    f = tmp_path / "eval.jsonl"
    f.write_text("".join(json.dumps({"family": "a", "prompt": p, "answer": t}) + "\n" for p, t in zip(prompts, g.text)))
    out = tmp_path / "p.json"
    assert (
        bench.main(
            [
                "--only",
                "precision",
                "--eval-file",
                str(f),
                "--seeds",
                "2",
                "--max-new-tokens",
                "64",
                "--out",
                str(out),
                "--md",
                str(tmp_path / "p.md"),
            ]
        )
        == 0
    )
    sec = json.loads(out.read_text())["sections"]["precision"]
    assert [r["seed"] for r in sec["rows"]] == [0, 1000] and sec["n_items"] == 3
    assert sec["rows"][0]["float32"] == 3  # the answers are float32's own at seed 0
    assert all(0 <= r[d] <= 3 for r in sec["rows"] for d in precision.DTYPES)
    assert len(sec["bfloat16_minus_float32"]["diffs"]) == 2
    md = (tmp_path / "p.md").read_text()
    assert "bf16 fast path vs exact float32, paired over 2 seeds" in md and "| float64 (control) |" in md
    assert "| float32, fast sampler |" in md and "float32 with the fast sampler vs exact float32:" in md
