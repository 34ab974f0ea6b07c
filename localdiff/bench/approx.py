"""``localdiff bench --only approx``: the opt-in approximations of the canvas decoder — top-k self-conditioning
(:mod:`localdiff.arch.soft_embedding`) and reuse of a locked position's distribution
(:mod:`localdiff.decoding.canvas_reuse`) — their logit error on random models and their accuracy on the embedded
eval, next to the exact path; and the bf16 fast path (the default on a bf16-native CPU for large models). Never on
by default: this section is what would justify a default.

* logit error: a canvas's second denoising step (self-conditioning on the first step's temperature-scaled logits)
  with the exact soft embedding vs top-k, on the wider tiny-random DiffusionGemma (vocab 4096) and the embedded
  model; max |Δ logit| ÷ max |logit|, mean |Δ logit|, and the fraction of positions whose argmax is unchanged.
* reuse: over a canvas decoded with locking (τ = :data:`TAU`), at every step each locked position's fresh logits
  vs those of the step that locked it (what ``reuse_locked`` uses instead), same three measures.
* accuracy: the embedded model's eval (``eval_tasks.evaluate``, default sampler, same seeds) per k; with locking
  at τ without and with reuse; and with the model in bf16 (the fast vocabulary pass).
"""

from __future__ import annotations

import torch

KS = (8, 32, 128, 512)
TAU = 0.9


def _measures(got: torch.Tensor, exact: torch.Tensor) -> dict:
    d = (got - exact).abs()
    return {
        "max_rel": float(d.max() / exact.abs().max()),
        "mean_abs": float(d.mean()),
        "argmax_same": float((got.argmax(-1) == exact.argmax(-1)).float().mean()),
    }


def _reuse_errors(m, steps: int = 8, seed: int = 0) -> dict:
    """Fresh vs reused (lock-time) logits of locked positions over one canvas decoded with locking at TAU."""
    from localdiff.decoding.canvas_eb import CanvasEB

    v, c = m.config.vocab_size, m.config.canvas_length
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, v, (2, 24), generator=g)
    opts = m.sampler_options(threshold=TAU, max_denoising_steps=steps)
    pol = CanvasEB(_canvas_options(opts), 2, c, v, "cpu", g, torch.float32, fast=True)
    cache = m.new_cache()
    m.prefill(ids, cache)
    pol.begin_block()
    at_lock = torch.zeros(2, c, v)
    got, fresh = [], []
    for step in range(1, steps + 1):
        canvas, sc = pol.model_inputs()
        logits = m.denoise(canvas, cache, sc)
        locked = pol.locked.clone()
        if bool(locked.any()):
            got.append(at_lock[locked])
            fresh.append(logits[locked])
        pol.advance(pol.assess(logits.clone(), step))
        new = pol.locked & ~locked
        at_lock[new] = logits[new]
        if pol.all_done():
            break
    if not got:
        return {"max_rel": 0.0, "mean_abs": 0.0, "argmax_same": 1.0, "positions": 0}
    return {**_measures(torch.cat(got), torch.cat(fresh)), "positions": int(sum(x.shape[0] for x in got))}


def _canvas_options(opts: dict):
    from localdiff.decoding.options import CanvasEBOptions

    names = set(CanvasEBOptions.__dataclass_fields__)
    return CanvasEBOptions(**{k: v for k, v in opts.items() if k in names})


def _errors(m, ks, seed: int = 0) -> dict:
    v, c = m.config.vocab_size, m.config.canvas_length
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, v, (2, 24), generator=g)
    canvas = torch.randint(0, v, (2, c), generator=g)
    net = m.net
    cache = m.new_cache()
    m.prefill(ids, cache)
    sc = m.denoise(canvas, cache) / 0.8  # the first step's logits at the schedule's t_max
    canvas2 = torch.randint(0, v, (2, c), generator=g)
    net.sc_topk = None
    exact = m.denoise(canvas2, cache, sc)
    out = {}
    try:
        for k in ks:
            net.sc_topk = k
            out[str(k)] = _measures(m.denoise(canvas2, cache, sc), exact)
    finally:
        net.sc_topk = None
    return out


def run(ctx) -> dict:
    """The section as ``localdiff bench`` runs it (``--quick``: 3 eval items per family)."""
    import localdiff
    from localdiff.bench.eval_tasks import evaluate

    quick = ctx.args.quick
    ks = KS[:2] if quick else KS
    res = {"ks": list(ks), "errors": {}, "eval": {}, "tau": TAU, "reuse_errors": {}}
    m = ctx.model()
    res["errors"]["embedded"] = _errors(m, ks)
    res["reuse_errors"]["embedded"] = _reuse_errors(m)
    wide = localdiff.load(ctx.wide_path(), device="cpu", dtype="float32")
    res["errors"][ctx.wide_label()] = _errors(wide, ks)
    res["reuse_errors"][ctx.wide_label()] = _reuse_errors(wide)
    items = ctx.items(3 if quick else None)
    for k in (None, *ks):
        m.net.sc_topk = k
        try:
            r = evaluate(m, items, seed=0, batch_size=ctx.args.batch_size)
        finally:
            m.net.sc_topk = None
        res["eval"]["exact" if k is None else str(k)] = {
            x: r[x] for x in ("accuracy", "correct", "n", "tpf", "seconds")
        }
        ctx.log(f"approx: sc_topk={k}: accuracy {r['accuracy']:.1%} TPF {r['tpf']:.2f} ({r['seconds']:.1f} s)")
    runs = {
        f"lock τ={TAU}": (m, {"threshold": TAU}),
        f"lock τ={TAU} + reuse": (m, {"threshold": TAU, "reuse_locked": True}),
    }
    runs["bfloat16 fast path"] = (localdiff.load(ctx.args.model, device="cpu", dtype="bfloat16"), {})
    for name, (mm, kw) in runs.items():
        r = evaluate(mm, items, seed=0, batch_size=ctx.args.batch_size, **kw)
        res["eval"][name] = {x: r[x] for x in ("accuracy", "correct", "n", "tpf", "seconds")}
        ctx.log(f"approx: {name}: accuracy {r['accuracy']:.1%} TPF {r['tpf']:.2f} ({r['seconds']:.1f} s)")
    return res


def render_md(sec: dict) -> list[str]:
    out = [
        "### Opt-in approximation: top-k self-conditioning (not the default; reference-exact runs never use it)",
        "",
        "| k | "
        + " | ".join(f"{name}: max rel. / mean abs. logit error, argmax same" for name in sec["errors"])
        + " | embedded eval accuracy | TPF |",
        "|---:|" + "---|" * len(sec["errors"]) + "---:|---:|",
    ]
    ex = sec["eval"]["exact"]
    out.append(
        "| exact | "
        + " | ".join("0 / 0, 100%" for _ in sec["errors"])
        + f" | {ex['accuracy']:.1%} ({ex['correct']}/{ex['n']}) | {ex['tpf']:.2f} |"
    )
    for k in sec["ks"]:
        cells = [
            f"{e[str(k)]['max_rel']:.2e} / {e[str(k)]['mean_abs']:.2e}, {e[str(k)]['argmax_same']:.1%}"
            for e in sec["errors"].values()
        ]
        r = sec["eval"][str(k)]
        out.append(
            f"| {k} | " + " | ".join(cells) + f" | {r['accuracy']:.1%} ({r['correct']}/{r['n']}) | {r['tpf']:.2f} |"
        )
    if sec.get("reuse_errors"):
        out += [
            "",
            f"Reuse of a locked position's distribution (``reuse_locked``, locking at τ = {sec['tau']}): "
            "fresh vs reused logits of the locked positions over one canvas — "
            + "; ".join(
                f"{name}: max rel. {e['max_rel']:.2e}, mean abs. {e['mean_abs']:.2e}, argmax same "
                f"{e['argmax_same']:.1%} ({e['positions']} position-steps)"
                for name, e in sec["reuse_errors"].items()
            ),
            "",
            "| embedded eval | accuracy | TPF | seconds |",
            "|---|---:|---:|---:|",
        ]
        for name, r in sec["eval"].items():
            if name == "exact" or not name[0].isdigit():
                out.append(
                    f"| {name} | {r['accuracy']:.1%} ({r['correct']}/{r['n']}) | {r['tpf']:.2f} | {r['seconds']:.1f} |"
                )
    return out
