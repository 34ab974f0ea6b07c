"""``localdiff bench --only approx``: the opt-in top-k self-conditioning approximation
(:mod:`localdiff.arch.soft_embedding`) — its logit error on random models and its accuracy on the embedded eval,
per k, next to the exact path. Never on by default: this section is what would justify a default.

* logit error: a canvas's second denoising step (self-conditioning on the first step's temperature-scaled logits)
  with the exact soft embedding vs top-k, on the wider tiny-random DiffusionGemma (vocab 4096) and the embedded
  model; max |Δ logit| ÷ max |logit|, mean |Δ logit|, and the fraction of positions whose argmax is unchanged.
* accuracy: the embedded model's eval (``eval_tasks.evaluate``, default sampler, same seeds) per k.
"""
from __future__ import annotations

import torch

KS = (8, 32, 128, 512)


def _errors(m, ks, seed: int = 0) -> dict:
    v, c = m.config.vocab_size, m.config.canvas_length
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, v, (2, 24), generator=g)
    canvas = torch.randint(0, v, (2, c), generator=g)
    net = m.net
    cache = m.new_cache()
    m.prefill(ids, cache)
    sc = m.denoise(canvas, cache) / 0.8                       # the first step's logits at the schedule's t_max
    canvas2 = torch.randint(0, v, (2, c), generator=g)
    net.sc_topk = None
    exact = m.denoise(canvas2, cache, sc)
    out = {}
    try:
        for k in ks:
            net.sc_topk = k
            got = m.denoise(canvas2, cache, sc)
            d = (got - exact).abs()
            out[str(k)] = {"max_rel": float(d.max() / exact.abs().max()), "mean_abs": float(d.mean()),
                           "argmax_same": float((got.argmax(-1) == exact.argmax(-1)).float().mean())}
    finally:
        net.sc_topk = None
    return out


def run(ctx) -> dict:
    """The section as ``localdiff bench`` runs it (``--quick``: 3 eval items per family)."""
    import localdiff
    from localdiff.bench.eval_tasks import evaluate

    quick = ctx.args.quick
    ks = KS[:2] if quick else KS
    res = {"ks": list(ks), "errors": {}, "eval": {}}
    m = ctx.model()
    res["errors"]["embedded"] = _errors(m, ks)
    wide = localdiff.load(ctx.wide_path(), device="cpu", dtype="float32")
    res["errors"][ctx.wide_label()] = _errors(wide, ks)
    items = ctx.items(3 if quick else None)
    for k in (None, *ks):
        m.net.sc_topk = k
        try:
            r = evaluate(m, items, seed=0, batch_size=ctx.args.batch_size)
        finally:
            m.net.sc_topk = None
        res["eval"]["exact" if k is None else str(k)] = {x: r[x] for x in ("accuracy", "correct", "n", "tpf",
                                                                              "seconds")}
        ctx.log(f"approx: sc_topk={k}: accuracy {r['accuracy']:.1%} TPF {r['tpf']:.2f} ({r['seconds']:.1f} s)")
    return res


def render_md(sec: dict) -> list[str]:
    out = ["### Opt-in approximation: top-k self-conditioning (not the default; reference-exact runs never use it)",
           "", "| k | " + " | ".join(f"{name}: max rel. / mean abs. logit error, argmax same"
                                       for name in sec["errors"]) + " | embedded eval accuracy | TPF |",
           "|---:|" + "---|" * len(sec["errors"]) + "---:|---:|"]
    ex = sec["eval"]["exact"]
    out.append("| exact | " + " | ".join("0 / 0, 100%" for _ in sec["errors"])
               + f" | {ex['accuracy']:.1%} ({ex['correct']}/{ex['n']}) | {ex['tpf']:.2f} |")
    for k in sec["ks"]:
        cells = [f"{e[str(k)]['max_rel']:.2e} / {e[str(k)]['mean_abs']:.2e}, {e[str(k)]['argmax_same']:.1%}"
                 for e in sec["errors"].values()]
        r = sec["eval"][str(k)]
        out.append(f"| {k} | " + " | ".join(cells) + f" | {r['accuracy']:.1%} ({r['correct']}/{r['n']}) | "
                   f"{r['tpf']:.2f} |")
    return out
