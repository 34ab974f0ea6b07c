"""The "Memory plans (computed)" section of docs/BENCHMARKS.md: the DiffusionGemma-26B-A4B flagship's plans (bytes of
every component) on a 16 GiB and a 24 GiB GPU and in 32 GiB of RAM, bf16 / int8 / int4, and the precision the
chooser picks for every catalog model on those three machines. Computed from the catalog's stand-in config.json
files alone (``localdiff.quantize.plan``, ``localdiff.quantize.fit``): no weights, no device.

Run from the repository root: ``python docs/tools/memory_plans.py`` (prints Markdown)."""
import json

from localdiff.hub import catalog
from localdiff.quantize.fit import choose_precision
from localdiff.quantize.plan import plan_memory
from localdiff.quantize.recipe import format_bytes, recipe_for_model

GIB = 1 << 30
MACHINES = (("16 GiB GPU", 16 * GIB, 64 * GIB, "cuda"), ("24 GiB GPU", 24 * GIB, 64 * GIB, "cuda"),
            ("32 GiB RAM, no GPU", 0, 32 * GIB, "cpu"))


def _plan(cfg, recipe, q, gpu, ram, device):
    if device == "cpu":
        return plan_memory(cfg, ram, q, recipe=recipe, device="cpu")
    return plan_memory(cfg, gpu, q, recipe=recipe)


def flagship() -> list[str]:
    name = "diffusiongemma:26b-a4b"
    cfg, recipe = json.loads(catalog.lookup(name).offline_config.read_text()), recipe_for_model(name)
    out = []
    for title, gpu, ram, device in MACHINES:
        plans = {q: _plan(cfg, recipe, q, gpu, ram, device) for q in ("bf16", "int8", "int4")}
        out += [f"### {name}, {title}", "", "| component | params | bf16 | int8 | int4 |", "|---|---:|---:|---:|---:|"]
        rows = {}
        for q, p in plans.items():
            for c in p.components:
                rows.setdefault(c["label"], {"params": c["params"]})[q] = format_bytes(c["bytes"])
        for label, r in rows.items():
            cells = " | ".join(r.get(q, "") for q in ("bf16", "int8", "int4"))
            out.append(f"| {label} | {r['params']:,} | {cells} |")
        p4 = plans["int4"]
        kv = f"KV cache budget ({p4.kv_tokens:,} tokens)"
        extra = [("weights, total", lambda p: p.weight_bytes), (kv, lambda p: p.kv_budget_bytes),
                 ("self-conditioning buffers", lambda p: p.sc_buffer_bytes),
                 ("activation workspace", lambda p: p.activation_bytes),
                 ("runtime reserve", lambda p: p.reserve_bytes),
                 ("whole model + buffers (resident need)", lambda p: p.resident_bytes)]
        for label, f in extra:
            out.append(f"| {label} | | " + " | ".join(format_bytes(f(p)) for p in plans.values()) + " |")
        out.append("| **fits** | | " + " | ".join(_verdict(p) for p in plans.values()) + " |")
        out.append("")
    return out


def _verdict(p) -> str:
    if not p.fits:
        over = p.device_total_bytes - p.gpu_mem_bytes
        return f"no ({format_bytes(over)} over" + (" with every expert layer on the host)" if p.device == "cuda"
                                                   else ")")
    if p.host_expert_layers:
        return (f"with experts of {p.n_cpu_moe} layers on the host ({format_bytes(p.host_weight_bytes)}); "
                f"{format_bytes(p.resident_bytes - p.gpu_mem_bytes)} over to be resident")
    return f"yes, resident ({format_bytes(p.free_bytes)} free)"


def every_model() -> list[str]:
    out = ["| model | bf16 / int8 / int4 weights | " + " | ".join(m[0] for m in MACHINES) + " |",
           "|---|---|" + "---|" * len(MACHINES)]
    for e in catalog.entries():
        if e.offline_config is None or not e.offline_config.is_file():
            continue
        cfg, recipe = json.loads(e.offline_config.read_text()), recipe_for_model(e.alias)
        w = " / ".join(format_bytes(plan_memory(cfg, GIB, q, recipe=recipe).weight_bytes)
                       for q in ("bf16", "int8", "int4"))
        picks = []
        for _, gpu, ram, device in MACHINES:
            c = choose_precision(cfg, gpu, ram, recipe=recipe, cpu_fallback=device == "cpu")
            where = "" if c.precision is None or c.device == "cpu" else (
                " resident" if c.plan.resident else f", {c.plan.n_cpu_moe} expert layers on host")
            picks.append(f"{c.precision}{where}" if c.fits
                         else f"none (int4 needs {format_bytes(c.plan.resident_bytes)})")
        out.append(f"| {e.alias} | {w} | " + " | ".join(picks) + " |")
    return out


if __name__ == "__main__":
    print("\n".join(flagship() + ["### Every catalog model: the precision the chooser picks", ""] + every_model()))
