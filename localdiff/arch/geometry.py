"""Per-layer attention geometry of a DiffusionGemma ``text_config`` (torch-free, so ``show`` and the memory planner
can use it without importing torch). Resolved as transformers 5.23.0 ``DiffusionGemmaTextConfig.__post_init__``."""
from __future__ import annotations


def layer_geometry(t: dict) -> tuple[list[str], list[tuple[int, int]]]:
    """(layer types, [(head_dim, num_kv_heads)] per layer) of a text config dict.

    Full-attention layers take ``per_layer_config`` overrides, or — when that key is absent — ``global_head_dim``
    (default 512) and ``num_global_key_value_heads``; an explicit empty ``per_layer_config`` (written when the
    overrides equal the defaults) means none. The last layer is always full attention; the default pattern is five
    sliding layers then one full.

    Raises:
        KeyError / TypeError / ValueError: missing or malformed fields, or ``layer_types`` of the wrong length.
    """
    n = int(t["num_hidden_layers"])
    heads = int(t["num_attention_heads"])
    head_dim = int(t.get("head_dim") or int(t["hidden_size"]) // heads)
    kv = int(t.get("num_key_value_heads") or heads)
    types = list(t.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers is {n}")
    types[-1] = "full_attention"
    plc = {int(k): v for k, v in (t.get("per_layer_config") or {}).items()}
    if t.get("per_layer_config") is None:
        g = {"head_dim": int(t.get("global_head_dim", 512))}
        if t.get("num_global_key_value_heads") is not None and t.get("attention_k_eq_v", True):
            g["num_key_value_heads"] = int(t["num_global_key_value_heads"])
        plc = {i: g for i, ty in enumerate(types) if ty == "full_attention"}
    dims = [(int(plc.get(i, {}).get("head_dim", head_dim)), int(plc.get(i, {}).get("num_key_value_heads", kv)))
            for i in range(n)]
    return types, dims
