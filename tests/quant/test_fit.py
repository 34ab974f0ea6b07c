"""The int4 memory plan (issue 42 item 3) and the precision chooser (bf16 → int8 → int4, the first that fits):
int4 bytes against a test-side build of the format, the same tensor set as int8, the DiffusionGemma-26B-A4B flagship
on 16 / 24 GiB GPUs and 32 GiB of RAM, plans for every catalog model, and ``show --plan --quant int4``."""

from __future__ import annotations

import json
import math

import pytest
import torch

from localdiff.hub import catalog
from localdiff.quantize.fit import choose_precision
from localdiff.quantize.plan import int4_bytes, plan_memory, tensor_bytes
from localdiff.quantize.recipe import recipe_for_model, table_precision

GIB = 1 << 30
FLAGSHIP = "diffusiongemma:26b-a4b"


def _cfg(name: str) -> dict:
    return json.loads(catalog.lookup(name).offline_config.read_text())


def _planned():
    """(alias, config) of every catalog model with a stand-in config (every model the planner can size pre-pull)."""
    return [
        (e.alias, json.loads(e.offline_config.read_text()))
        for e in catalog.entries()
        if e.offline_config is not None and e.offline_config.is_file()
    ]


def _packed(rows: int, cols: int) -> int:
    """Bytes of the fixed int4 format built with torch (test side): codes 0..15 two per byte, per row and per group
    of 64 input features (the last padded), one fp16 scale and one fp16 zero per group."""
    groups = math.ceil(cols / 64)
    codes = torch.randint(0, 16, (rows, groups * 64), dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale, zero = torch.rand(rows, groups, dtype=torch.float16), torch.rand(rows, groups, dtype=torch.float16)
    return sum(t.numel() * t.element_size() for t in (packed, scale, zero))


@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 130), (7, 1), (704, 2816), (3, 191)])
def test_int4_bytes_equal_the_packed_format(rows, cols):
    assert int4_bytes(rows, cols) == _packed(rows, cols)
    if cols % 64 == 0:
        assert int4_bytes(rows, cols) == rows * cols * 0.5625


@pytest.mark.parametrize("alias,cfg", _planned(), ids=[a for a, _ in _planned()])
def test_int4_quantizes_exactly_the_int8_set_and_plans_every_catalog_model(alias, cfg):
    recipe = recipe_for_model(alias)
    i8 = {r["name"]: r for r in tensor_bytes(cfg, "int8", recipe=recipe)}
    i4 = {r["name"]: r for r in tensor_bytes(cfg, "int4", recipe=recipe)}
    tables = table_precision(cfg, "int4", recipe)  # the recipe's int4_embeddings (block / canvas models)
    assert i8.keys() - {"head_int8.weight"} == i4.keys() - {"head_int8.weight"}
    q8 = {n for n, r in i8.items() if r["precision"] == "int8" and n != "head_int8.weight"}
    q4 = {n for n, r in i4.items() if r["precision"] == "int4"}
    t4 = {n for n, r in i4.items() if r["component"] in ("embeddings", "lm_head")}
    assert q4 == q8 | (t4 if tables == "int4" else set()) and q4  # the same tensors (+ the tables), and some
    assert ("head_int8.weight" in i4) == ("head_int8.weight" in i8 and not tables)  # tables: no head copy
    for n, r in i4.items():
        if r["component"] in ("router", "norms", "self_conditioning", "attention_norms") or (
            r["component"] == "embeddings" and not tables
        ):
            assert r["precision"] == "bfloat16", n  # stay 16-bit
        if r["precision"] == "int4":  # weights stored [out, in] / [E, out, in]
            rows = r["shape"][0] if len(r["shape"]) == 2 else r["shape"][0] * r["shape"][1]
            assert r["bytes"] == _packed_rows(rows, r["shape"][-1]), n
    gpu = plan_memory(cfg, 16 * GIB, "int4", recipe=recipe)
    cpu = plan_memory(cfg, 32 * GIB, "int4", recipe=recipe, device="cpu")
    assert cpu.device_total_bytes == gpu.resident_bytes and not cpu.host_expert_layers
    assert "RAM total" in cpu.to_text() and cpu.to_dict()["device"] == "cpu" and "int4 weights" in gpu.to_text()
    sizes = {q: sum(r["bytes"] for r in rows.values()) for q, rows in (("int8", i8), ("int4", i4))}
    assert gpu.weight_bytes == sizes["int4"] < sizes["int8"]


def _packed_rows(rows: int, cols: int) -> int:
    return rows * math.ceil(cols / 64) * (32 + 2 + 2)


def test_flagship_int4_plans_16_24_gib_gpu_and_32_gib_ram():
    cfg, recipe = _cfg(FLAGSHIP), recipe_for_model(FLAGSHIP)
    comp = {c["component"]: c for c in plan_memory(cfg, 16 * GIB, "int4", recipe=recipe).components}
    assert comp["experts"]["bytes"] == comp["experts"]["params"] * 0.5625 == 12_846_366_720
    # the recipe's int4_embeddings: the tied embedding / LM head in int4 (396 MiB instead of 1.38 GiB in bf16)
    assert comp["embeddings"]["precision"] == "int4" and comp["embeddings"]["bytes"] == 262144 * 44 * 36
    p16 = plan_memory(cfg, 16 * GIB, "int4", recipe=recipe)
    # with the default KV budget (32,768 tokens) and the 1 GiB runtime reserve int4 needs 15.98 GiB: resident
    assert 15.9 * GIB < p16.resident_bytes < 16 * GIB
    assert p16.fits and p16.resident and p16.host_expert_layers == []
    assert "host: no expert layers" in p16.to_text()
    # a 256 MiB KV budget (1,191 tokens) leaves 0.64 GiB free
    small = plan_memory(cfg, 16 * GIB, "int4", 256 << 20, recipe=recipe)
    assert small.resident and small.free_bytes > 0.6 * GIB
    p24 = plan_memory(cfg, 24 * GIB, "int4", recipe=recipe)
    assert p24.resident and p24.free_bytes > 6 * GIB  # int8 at 24 GiB kept 5 layers on the host
    assert plan_memory(cfg, 24 * GIB, "int8", recipe=recipe).n_cpu_moe == 5
    cpu = plan_memory(cfg, 32 * GIB, "int4", recipe=recipe, device="cpu")
    assert cpu.fits and cpu.device_total_bytes == p16.resident_bytes
    assert plan_memory(cfg, 32 * GIB, "int8", recipe=recipe, device="cpu").fits
    assert not plan_memory(cfg, 32 * GIB, "bf16", recipe=recipe, device="cpu").fits


def test_host_ram_is_checked_when_given():
    cfg, recipe = _cfg(FLAGSHIP), recipe_for_model(FLAGSHIP)
    p = plan_memory(cfg, 16 * GIB, "int8", recipe=recipe, ram_bytes=4 * GIB)
    assert p.free_bytes >= 0 and not p.host_fits and not p.fits
    assert "host RAM" in p.to_text() and "does NOT fit" in p.to_text()


@pytest.mark.parametrize(
    "name,gpu,ram,want,device,words",
    [
        (FLAGSHIP, 80, 128, "bf16", "cuda", "everything on the GPU"),
        (FLAGSHIP, 24, 64, "int4", "cuda", "not in bf16 or int8"),
        (FLAGSHIP, 16, 64, "int4", "cuda", "in int4, everything on the GPU"),
        (FLAGSHIP, 0, 32, "int8", "cpu", "fits 32.00 GiB of RAM in int8 on the CPU, not in bf16"),
        (FLAGSHIP, 0, 24, "int4", "cpu", "not in bf16 or int8"),
        (FLAGSHIP, 0, 8, None, "cpu", "int4 needs 15.98 GiB of RAM"),
        ("llada2:mini", 24, 64, "int8", "cuda", "in int8, everything on the GPU, not in bf16"),
        ("llada2:mini", 0, 24, "int8", "cpu", "not in bf16"),
        ("sdar:8b", 12, 16, "int4", "cuda", "fits this 12.00 GiB GPU in int4, everything on the GPU"),  # int4 tables
        ("sdar:8b", 8, 16, "int8", "cpu", "no precision fits this 8.00 GiB GPU"),
        ("qwen3-mdm:0.6b", 0, 8, "bf16", "cpu", "in bf16 on the CPU"),
    ],
)
def test_chooser_takes_the_first_precision_that_fits(name, gpu, ram, want, device, words):
    cfg, recipe = _cfg(name), recipe_for_model(name)
    c = choose_precision(cfg, gpu * GIB, ram * GIB, recipe=recipe)
    assert (c.precision, c.device) == (want, device) and words in c.reason
    assert c.quant == (None if want in (None, "bf16") else want)
    ladder = ["bf16", "int8", "int4"]
    for q in ladder[: ladder.index(want) if want else 3]:  # every wider precision really does not fit
        if device == "cpu":
            assert not plan_memory(cfg, ram * GIB, q, recipe=recipe, device="cpu").fits
        else:
            assert not plan_memory(cfg, gpu * GIB, q, recipe=recipe).resident
    if want is None:
        assert c.need_line() == "about 15.98 GiB of RAM in int4"


def test_chooser_on_a_gpu_load_does_not_fall_back_to_the_cpu():
    c = choose_precision(_cfg("sdar:8b"), 8 * GIB, 16 * GIB, recipe=recipe_for_model("sdar:8b"), cpu_fallback=False)
    assert c.precision is None and c.device == "cuda" and "no precision fits this 8.00 GiB GPU" in c.reason


def test_show_plans_int4_on_a_gpu_and_on_the_cpu(capsys):
    from localdiff.cli import main

    assert main(["show", FLAGSHIP, "--plan", "--quant", "int4", "--gpu-mem", "16GiB"]) == 0
    out = capsys.readouterr().out
    assert "int4 weights" in out and "0.5625 bytes per weight" in out
    assert "experts                     22,837,985,280  int4         11.96 GiB" in out
    assert "host: no expert layers" in out and "fits (19.61 MiB free)" in out
    assert "precision (what pull and gen pick): int4" in out
    assert main(["show", FLAGSHIP, "--quant", "int4", "--gpu-mem", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "host: no expert layers" in out and "fits" in out
    assert main(["show", FLAGSHIP, "--quant", "int4", "--device", "cpu", "--ram", "32GiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["plan"]["device"] == "cpu" and d["plan"]["fits"] and d["plan"]["gpu_mem_bytes"] == 32 * GIB
    assert d["precision_choice"]["precision"] == "int8"  # the chooser: int8 fits 32 GiB, bf16 does not
    assert main(["show", FLAGSHIP, "--device", "cpu", "--gpu-mem", "16GiB"]) == 2
    assert "--ram" in capsys.readouterr().err
    assert main(["show", FLAGSHIP, "--device", "cpu", "--ram", "lots"]) == 2
    assert "--ram" in capsys.readouterr().err


def test_benchmarks_doc_holds_the_computed_flagship_tables():
    """docs/BENCHMARKS.md's "Memory plans (computed)" tables are what docs/tools/memory_plans.py computes now."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("memory_plans", root / "docs" / "tools" / "memory_plans.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    doc = (root / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert "## Memory plans (computed)" in doc and "\n".join(tool.flagship()) in doc


def test_show_quant_alone_plans_this_machine(monkeypatch, capsys):
    """--quant implies --plan (it was ignored without it); no GPU found and no --gpu-mem: the CPU plan of the RAM."""
    import localdiff.hub.fit as machine
    from localdiff.cli import main

    monkeypatch.setattr(machine, "gpu_mem_bytes", lambda: 0)
    monkeypatch.setattr(machine, "ram_bytes", lambda: 32 * GIB)
    assert main(["show", FLAGSHIP, "--quant", "int4"]) == 0
    out = capsys.readouterr().out
    assert "Memory plan for 32.00 GiB of RAM (CPU, no GPU): int4 weights" in out and "RAM total 15.98 GiB" in out
    monkeypatch.setattr(machine, "gpu_mem_bytes", lambda: 24 * GIB)
    assert main(["show", FLAGSHIP, "--quant", "int4"]) == 0
    assert "Memory plan for a 24.00 GiB device: int4 weights" in capsys.readouterr().out
