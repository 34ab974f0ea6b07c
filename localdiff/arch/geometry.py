"""DiffusionGemma's configuration: per-layer attention geometry of a ``text_config`` and the parsed config dataclass
(torch-free, so ``show`` and the memory planner can use them without importing torch). Resolved as transformers
5.23.0 ``DiffusionGemmaTextConfig.__post_init__``."""
from __future__ import annotations

from dataclasses import dataclass, field

MODEL_TYPE = "diffusion_gemma"


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


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    """Text-model hyper-parameters read from a checkpoint's ``config.json`` (``text_config`` + ``canvas_length``).

    ``layer_heads[i]`` is (head_dim, num_kv_heads) of layer i: full-attention layers use ``per_layer_config``
    (or ``global_head_dim`` / ``num_global_key_value_heads``) overrides.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: tuple
    layer_heads: tuple
    sliding_window: int
    rope_parameters: dict
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    canvas_length: int
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = 30.0
    max_position_embeddings: int = 131072
    pad_token_id: int | None = 0
    eos_token_id: tuple = (1,)
    bos_token_id: int | None = 2
    tie_word_embeddings: bool = True
    model_type: str = MODEL_TYPE
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict) -> "DiffusionGemmaConfig":
        """Parse a ``config.json`` dict. Raises KeyError / ValueError on missing or inconsistent fields."""
        t = dict(cfg.get("text_config") or cfg)
        if t.get("use_bidirectional_attention") == "all":
            raise ValueError("use_bidirectional_attention='all' (bidirectional encoder) is not supported")
        types, dims = layer_geometry(t)
        n, heads = len(types), tuple(dims)
        rope = t.get("rope_parameters") or {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
        eos = t.get("eos_token_id", 1)
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        if not t.get("num_experts") or not t.get("top_k_experts") or not t.get("moe_intermediate_size"):
            raise ValueError("text_config lacks num_experts / top_k_experts / moe_intermediate_size")
        return cls(
            vocab_size=int(t["vocab_size"]), hidden_size=int(t["hidden_size"]),
            intermediate_size=int(t["intermediate_size"]), num_hidden_layers=n,
            num_attention_heads=int(t["num_attention_heads"]), layer_types=tuple(types), layer_heads=heads,
            sliding_window=int(t.get("sliding_window", 512)), rope_parameters=rope,
            num_experts=int(t["num_experts"]), top_k_experts=int(t["top_k_experts"]),
            moe_intermediate_size=int(t["moe_intermediate_size"]),
            canvas_length=int(cfg.get("canvas_length") or 256), rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            final_logit_softcapping=t.get("final_logit_softcapping", 30.0),
            max_position_embeddings=int(t.get("max_position_embeddings", 131072)),
            pad_token_id=t.get("pad_token_id", 0), eos_token_id=eos, bos_token_id=t.get("bos_token_id", 2),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", True))), raw=cfg)

    def window(self, i: int) -> int | None:
        """Sliding window (tokens) of layer i, None for full attention."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None
