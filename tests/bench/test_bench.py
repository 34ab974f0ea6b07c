"""`localdiff bench`: the quick reference comparison on a tiny random model, the eval on a few items, the report."""

import json

import pytest

from localdiff.bench import run as bench
from localdiff.bench.eval_tasks import best_point, exact_match, load_items, sweep_settings
from localdiff.bench.report import END, START, replace_readme_section
from localdiff.errors import UsageError
from localdiff.paths import models_dir

TINY = models_dir() / "tiny"


def test_quick_reference_comparison_json(ref_small, tmp_path):
    _, path = ref_small
    out = tmp_path / "r.json"
    rc = bench.main(
        [
            "--quick",
            "--only",
            "ref",
            "--ref-on",
            "random",
            "--random-model",
            str(path),
            "--seeds",
            "4",
            "--reps",
            "2",
            "--out",
            str(out),
            "--md",
            str(tmp_path / "r.md"),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["environment"]["threads"] == 2 and res["quick"] is True
    sec = res["sections"]["ref"]
    assert "skipped" not in sec
    (run,) = sec["runs"]
    assert run["settings"]["max_new_tokens"] == 2 * 8 and run["settings"]["max_denoising_steps"] == 4
    assert [r["seed"] for r in run["seeds"]] == [0, 1, 2, 3]
    for r in run["seeds"]:
        assert r["forwards"]["ref"] > 0 and r["forwards"]["localdiff"] > 0
        assert r["tokens_per_s"]["ref"]["n"] == 2 and r["tokens_per_s"]["localdiff"]["median"] > 0
        assert r["speed_ratio"]["min"] <= r["speed_ratio"]["median"] <= r["speed_ratio"]["max"]
        if r["identical"]:  # same tokens → the same decoder forwards and TPF
            assert r["forwards"]["ref"] == r["forwards"]["localdiff"]
    s = run["summary"]
    assert s["seeds"] == 4 and s["identical_seeds"] >= 3  # 4 steps per canvas: reference-exact
    assert s["speed_ratio"]["n"] == 2 * s["identical_seeds"]
    md = (tmp_path / "r.md").read_text()
    assert "Reference comparison" in md and "| 3 |" in md


def test_eval_on_three_items(tmp_path):
    """Model-independent: the expected answers are what the model itself generates with the bench's batching and
    seeds (family "a" = batch 0 / seed 0, family "b" = batch 1 / seed 1), one of them altered to be wrong."""
    import localdiff

    m = localdiff.load("tiny", device="cpu")
    pa, pb = ["What is 27 + 58?", "Reverse the letters: c a t"], ["What is 13 + 40?"]
    ga = m.generate(pa, seed=0, max_new_tokens=64)
    gb = m.generate(pb, seed=1, max_new_tokens=64)
    items = [
        {"family": "a", "prompt": pa[0], "answer": "  " + ga.text[0] + " "},
        {"family": "a", "prompt": pa[1], "answer": ga.text[1] + " extra"},
        {"family": "b", "prompt": pb[0], "answer": gb.text},
    ]
    f = tmp_path / "eval.jsonl"
    f.write_text("".join(json.dumps(i) + "\n" for i in items))
    out = tmp_path / "e.json"
    assert bench.main(["--eval", "--eval-file", str(f), "--max-new-tokens", "64", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert list(res["sections"]) == ["eval"]
    d = res["sections"]["eval"]["default"]
    assert (d["n"], d["correct"]) == (3, 2)
    assert {k: (v["correct"], v["n"]) for k, v in d["per_family"].items()} == {"a": (1, 2), "b": (1, 1)}
    assert [x["prompt"] for x in d["failures"]] == [pa[1]]
    assert d["forwards"] == ga.stats.forwards + gb.stats.forwards
    assert d["tpf"] == pytest.approx((ga.stats.new_tokens + gb.stats.new_tokens) / d["forwards"])
    assert d["per_family"]["b"]["tpf"] == pytest.approx(gb.stats.tokens_per_forward)


def test_exact_match_and_items(tmp_path):
    assert exact_match(" 27 + 58 = 85. ", "27 + 58 = 85.")
    assert exact_match("t  a\nc", "t a c")
    assert not exact_match("27 + 58 = 86.", "27 + 58 = 85.")
    f = tmp_path / "e.jsonl"
    f.write_text(
        "".join(json.dumps({"family": k, "prompt": f"p{i}", "answer": "a"}) + "\n" for i, k in enumerate("aabbb"))
    )
    assert [i["prompt"] for i in load_items(f, per_family=1)] == ["p0", "p2"]
    assert len(load_items(f)) == 5
    f.write_text('{"family": "x"}\n')
    with pytest.raises(UsageError, match="not an eval item"):
        load_items(f)


def test_best_point_and_sweep_grid():
    rows = [
        {"label": "a", "setting": {}, "accuracy": 0.90, "tpf": 2.0},
        {"label": "b", "setting": {}, "accuracy": 0.895, "tpf": 5.0},
        {"label": "c", "setting": {}, "accuracy": 0.50, "tpf": 9.0},
        {"label": "d", "setting": {}, "accuracy": 0.40, "tpf": 3.0},
        {"label": "e", "setting": {}, "accuracy": 0.87, "tpf": 7.0},
    ]
    b = best_point(rows)  # margin 1 pp
    assert b["label"] == "b" and set(b["pareto"]) == {"a", "b", "c", "e"}
    assert best_point(rows, n_items=100)["label"] == "e"  # one standard error of 0.90 over 100 items = 3 pp
    ties = [
        {
            "label": "eb=1.0 τ=0.95",
            "setting": {"entropy_bound": 1.0, "threshold": 0.95},
            "accuracy": 0.41,
            "tpf": 4.8505,
        },
        {
            "label": "eb=1.0 τ=off",
            "setting": {"entropy_bound": 1.0, "threshold": None},
            "accuracy": 0.41,
            "tpf": 4.8491,
        },
        {"label": "eb=0.1 τ=off", "setting": {}, "accuracy": 0.42, "tpf": 4.59},
    ]
    assert best_point(ties, n_items=180)["label"] == "eb=1.0 τ=off"  # a 0.03 % TPF edge is a tie: no τ wins
    ties[2]["label"], ties[2]["tpf"] = "default", 4.84
    assert best_point(ties, n_items=180)["label"] == "default"  # within 1 % of the fastest: the default stays
    full = sweep_settings(quick=False, default_steps=16)
    assert len([s for s in full if "threshold" in s and not s["correction"]]) == 20
    assert {s.get("max_denoising_steps") for s in full} >= {4, 8, 32}


def test_readme_section_replaced(tmp_path):
    r = tmp_path / "README.md"
    r.write_text(f"# x\n\n{START}\nold table\n{END}\n\nafter\n")
    assert replace_readme_section(r, "new table\n")
    text = r.read_text()
    assert "old table" not in text and f"{START}\nnew table\n{END}" in text and text.endswith("after\n")
    r.write_text("# no markers\n")
    assert not replace_readme_section(r, "t")
    assert r.read_text().count(START) == 1
    r.write_text(f"# half a pair\n{START}\nold\n")
    with pytest.raises(UsageError, match="has .* but no "):
        replace_readme_section(r, "t")
    assert r.read_text() == f"# half a pair\n{START}\nold\n"


def test_bad_section_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="unknown section"):
        bench.main(["--only", "nope", "--out", str(tmp_path / "x.json")])


def test_targets_table_reports_met_and_unmet():
    from localdiff.bench.report import _targets_md

    spread = {"median": 1.65, "min": 1.4, "max": 1.9, "n": 5}
    secs = {
        "ref": {
            "runs": [{"model": "embedded (tiny)", "summary": {"speed_ratio": spread, "identical_seeds": 5, "seeds": 5}}]
        },
        "history": {
            "model": "embedded (tiny)",
            "ratio_8192_vs_256": 2.35,
            "rest_ratio_8192_vs_256": 1.44,
            "others": [{"model": "wider", "ratio_8192_vs_256": 1.2}],
        },
        "sweep": {"best": {"label": "default"}},
    }
    lines = _targets_md(secs)
    assert lines[0] == "| target | wanted | this run | met |"
    table = {ln.split(" | ")[0][2:]: ln for ln in lines[2:] if ln}
    assert table["speed vs the reference, embedded model, identical tokens"].endswith("| 1.65× on 5/5 seeds | no |")
    assert table["step time, 8192 ÷ 256 tokens of history (embedded (tiny))"].endswith(
        "| 2.35× (1.44× without the step's attention) | no |"
    )
    assert table["step time, 8192 ÷ 256 tokens of history (wider)"].endswith("| 1.20× | yes |")
    assert table["generation_config defaults = best accuracy-per-TPF point"].endswith("| default | yes |")
    assert _targets_md({}) == []
    quick = {"history": {"model": "embedded (tiny)", "ratio_1024_vs_256": 1.1}, "sweep": {"best": {"label": "x"}}}
    assert all(ln.endswith("| — (not this run's sizes) |") for ln in _targets_md(quick, quick=True)[2:] if ln)


def test_profile_section_keeps_the_profilers_lines_off_stderr(tmp_path):
    """``bench --only profile`` printed Kineto's "USDT:... profiler_start" / "profiler_stop" lines to stderr (newcomer
    check, session 8); a fresh process, since Kineto reads its log level once."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "localdiff",
            "bench",
            "--only",
            "profile",
            "--quick",
            "--threads",
            "1",
            "--no-plot",
            "--out",
            str(tmp_path / "b.json"),
            "--md",
            str(tmp_path / "b.md"),
        ],
        capture_output=True,
        env=env,
        cwd=root,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert b"USDT" not in r.stderr and b"profiler_start" not in r.stderr, r.stderr
    assert json.loads((tmp_path / "b.json").read_text())["sections"]["profile"]["forwards"] > 0


def test_a_readme_with_half_the_markers_is_refused_before_any_section(tmp_path):
    r = tmp_path / "README.md"
    r.write_text(f"# x\n{END}\n")
    out = tmp_path / "new" / "x.json"
    with pytest.raises(UsageError, match=f"has {END} but no {START}"):
        bench.main(["--quick", "--readme", str(r), "--out", str(out)])
    assert r.read_text() == f"# x\n{END}\n" and not out.exists()
