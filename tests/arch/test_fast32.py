"""The fast sampler in float32 where bf16 would be the default but the CPU lacks fast bf16 (AVX2-only machines): the
precision rule picks it only for large or 16-bit-stored models chosen by default; an asked dtype and small fp32
checkpoints keep the reference-exact sampler; the engine hands the choice to the canvas policy."""

import torch

import localdiff
from localdiff import capability
from localdiff.engine import canvas as engine_canvas


def test_rule(monkeypatch):
    monkeypatch.setattr(capability, "bf16_instructions", lambda flags=None: [])
    big = capability.choose_cpu_dtype("float32", 10**9)
    assert (big.dtype, big.sampler_path()) == ("float32", "fast") and "fast sampler" in big.line()
    assert capability.choose_cpu_dtype("bfloat16", 3_000_000).sampler_path() == "fast"  # stored in 16 bits
    small = capability.choose_cpu_dtype("float32", 3_400_000)
    assert (small.dtype, small.sampler_path()) == ("float32", "exact")
    monkeypatch.setattr(capability, "bf16_instructions", lambda flags=None: ["amx_bf16"])
    monkeypatch.setattr(capability, "matmul_rates", lambda refresh=False: {"float32": 100.0, "bfloat16": 110.0})
    assert capability.choose_cpu_dtype("bfloat16", 10**9).sampler_path() == "fast"  # bf16 measured slow
    monkeypatch.setattr(capability, "matmul_rates", lambda refresh=False: {"float32": 100.0, "bfloat16": 600.0})
    assert capability.choose_cpu_dtype("float32", 10**9).sampler_path() == "fast"  # bf16 itself


def _policies(monkeypatch):
    seen = []
    orig = engine_canvas.policy_class

    def spy(options):
        cls = orig(options)

        def make(*a, **k):
            seen.append(cls(*a, **k))
            return seen[-1]

        return make

    monkeypatch.setattr(engine_canvas, "policy_class", spy)
    return seen


def test_engine_passes_the_choice(monkeypatch):
    seen = _policies(monkeypatch)
    monkeypatch.setattr(capability, "bf16_instructions", lambda flags=None: [])
    monkeypatch.setattr(capability, "LARGE_MODEL_PARAMS", 1)  # tiny counts as large here
    fast = localdiff.load("tiny", device="cpu")
    assert fast.dtype == torch.float32 and fast.precision.sampler_path() == "fast"
    assert fast.kernels()["sampler"].startswith("vocab pass")
    g = fast.generate("What is 27 + 58?", seed=0, max_new_tokens=32)
    assert seen[-1].vocab_pass is not None and g.stats.new_tokens > 0
    asked = localdiff.load("tiny", device="cpu", dtype="float32")
    assert asked.precision.sampler_path() == "exact" and "reference" in asked.kernels()["sampler"]
    asked.generate("What is 27 + 58?", seed=0, max_new_tokens=32)
    assert seen[-1].vocab_pass is None
