"""The embedded default model: found from a built wheel as well as from the source tree; answers fixed prompts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import localdiff
from localdiff.paths import models_dir

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny"


def test_embedded_model_found_from_source_tree():
    assert models_dir() == ROOT / "models"
    m = localdiff.load("tiny", device="cpu")
    assert m.path == TINY.resolve() and m.tokenizer is not None and m.config.canvas_length == 32


def test_embedded_model_found_from_built_wheel(tmp_path):
    wheels = tmp_path / "wheels"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    whl = next(wheels.glob("localdiff-*.whl"))
    import zipfile

    shipped = set(zipfile.ZipFile(whl).namelist())
    sources = {"localdiff/" + p.relative_to(ROOT / "localdiff").as_posix() for p in (ROOT / "localdiff").rglob("*.c")}
    assert sources and sources <= shipped, sources - shipped  # the native kernels' C sources (built on first use)
    target = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(whl)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    code = (
        "import json, localdiff; m = localdiff.load('tiny', device='cpu'); "
        "g = m.generate('Reverse the letters: c a t', seed=0); "
        "print(json.dumps({'file': localdiff.__file__, 'path': str(m.path), 'text': g.text}))"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["file"].startswith(str(target)) and out["path"].startswith(str(target))
    assert "_data/models/tiny" in out["path"] and out["text"].strip()


FIXED = [  # prompt → answer the shipped model must give with its default sampler and seed 0
    ("What is 27 + 58?", "27 + 58 = 85."),
    ("What is 41 + 93?", "41 + 93 = 134."),
    ("What is 12 + 75?", "12 + 75 = 87."),
    ("Reverse the letters: d r a g o n", "n o g a r d"),
    ("Reverse the letters: p l a n e t", "t e n a l p"),
    ("Reverse the letters: r i v e r", "r e v i r"),
]


@pytest.mark.parametrize("prompt,answer", FIXED)
def test_shipped_model_answers_fixed_prompts(prompt, answer):
    m = localdiff.load("tiny", device="cpu")
    g = m.generate(prompt, seed=0)
    assert g.text.strip() == answer
    assert g.finish_reason == "eos"


def test_multi_canvas_answer_completes_with_eos():
    m = localdiff.load("tiny", device="cpu")
    items = [json.loads(line) for line in (TINY / "eval.jsonl").read_text().splitlines()]
    longest = max((it for it in items if it["family"] == "list"), key=lambda it: len(it["answer"]))
    g = m.generate(longest["prompt"], seed=0, max_new_tokens=256)
    assert g.stats.canvases >= 2 and g.finish_reason == "eos"


def test_shipped_generation_config_loads_in_the_reference():
    """transformers' DiffusionGemma generation config rejects keys it does not know: ours must stay reference-clean."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    g = DiffusionGemmaGenerationConfig.from_pretrained(TINY)
    m = localdiff.load("tiny", device="cpu")
    opts = m.sampler_options()
    assert g.max_denoising_steps == opts["max_denoising_steps"] == 4
    assert g.sampler_config.entropy_bound == opts["entropy_bound"] == 1.0
