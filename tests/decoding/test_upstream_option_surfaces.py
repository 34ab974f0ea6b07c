"""Issue #45's options reach every surface a user meets: SDAR's entropy-bounded remasking, Fast-dLLM v2's sub-block
cache, dInfer's decoders and vicinity refresh and LLaDA's upstream noise are in ``localdiff gen --help``, in
``localdiff show`` for a model of their decoder, and taken by the server (a request's ``localdiff`` object reaches
the model's decoder and comes back in the response's settings)."""

from __future__ import annotations

import re

import httpx
import pytest
from servehelpers import Running

import localdiff
from localdiff.cli.dispatch import build_parser, main
from localdiff.decoding.options import POLICIES

#: (model, option, value): each item's options on an embedded (or catalog) model whose decoder has them
SDAR = [("tiny-bd", "remasking_strategy", "entropy_bounded"), ("tiny-bd", "eb_threshold", 0.5)]
V2 = [("fast-dllm-v2:1.5b", "kv_cache", "dual"), ("fast-dllm-v2:1.5b", "use_block_cache", True)]
DINFER = [("tiny-mdm", "parallel_decoding", v) for v in ("threshold", "credit", "hierarchy")] + [
    ("tiny-mdm", k, v)
    for k, v in (
        ("low_threshold", 0.4),
        ("credit_alpha", 0.5),
        ("boost_gamma", 0.3),
        ("decay_beta", 0.7),
        ("start_block_align", True),
        ("kv_cache", "vicinity"),
        ("prefix_look", 4),
        ("after_look", 3),
        ("warmup_steps", 1),
    )
]
NOISE = [("tiny-mdm", "noise", "upstream")]
CASES = SDAR + V2 + DINFER + NOISE
Q = "What is 41 + 93?"


def _flag(option: str) -> str:
    return next(s.cli_flag for c in POLICIES.values() for s in c.specs() if s.name == option)


def test_gen_help_names_each_flag_and_value():
    gen = build_parser()._subparsers._group_actions[0].choices["gen"]
    text = " ".join(re.sub(r"-\n\s+", "-", gen.format_help()).split())  # argparse wraps at hyphens and spaces
    for _, option, value in CASES:
        assert re.search(rf"(?<![\w-]){re.escape(_flag(option))}(?![\w-])", text), option
        if isinstance(value, str):
            assert re.search(rf"one of [\w, ]*\b{value}\b", text), (option, value)


@pytest.mark.parametrize("model", sorted({m for m, _, _ in CASES}))
def test_show_lists_them_for_a_model_of_their_decoder(model, capsys):
    assert main(["show", model]) == 0
    lines = capsys.readouterr().out.splitlines()
    for m, option, value in CASES:
        if m == model:
            line = next((ln for ln in lines if ln.startswith(f"  {option} = ")), None)
            assert line is not None and _flag(option) in line, (model, option)
            if isinstance(value, str):
                assert re.search(rf"\b{value}\b", line.split(";", 1)[1]), (model, option, value)


@pytest.fixture(scope="module")
def server():
    s = Running(model="tiny-mdm")
    yield s
    s.stop()


@pytest.mark.parametrize("model,option,value", SDAR + DINFER + NOISE + [("tiny-mdm", None, None)])
def test_the_server_passes_them_to_the_models_decoder(server, model, option, value):
    ext = (
        {option: value}
        if option
        else {
            "parallel_decoding": "credit",
            "kv_cache": "vicinity",
            "prefix_look": 2,
            "after_look": 2,
            "warmup_steps": 1,
            "noise": "upstream",
            "temperature": 0.5,
        }
    )
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": model, "prompt": Q, "max_tokens": 8, "seed": 1, "localdiff": ext},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    used = r.json()["localdiff"]["sampler"]
    assert {k: used[k] for k in ext} == ext
    want = localdiff.load(model).generate(Q, max_new_tokens=8, seed=1, chat=False, **ext).text
    assert r.json()["choices"][0]["text"] == want
    assert "Traceback" not in server.logs.text()


def test_the_server_mapping_takes_fast_dllm_v2s_sub_block_cache():
    """No embedded Fast-dLLM v2 model exists (it would need a tokenizer to be asked over HTTP), so this one goes
    through the server's request mapping (``to_engine_options``) into the decoder's options as the engine builds them
    (the decoder runs with them in ``test_fastdllm_v2.py``)."""
    from localdiff.decoding.options import FastDLLMv2Options
    from localdiff.serve.options import to_engine_options

    for ext in ({"kv_cache": "dual", "small_block_size": 4}, {"use_block_cache": True}):
        req = to_engine_options({"sampler": ext, "max_tokens": 8})
        o = FastDLLMv2Options.build(req["sampler"])
        assert o.sub_block_cache and {k: getattr(o, k) for k in ext} == ext
