"""DiffusionGemma's configuration: per-layer attention geometry of a ``text_config`` and the parsed config dataclass
(torch-free, so ``show`` and the memory planner can use them without importing torch). Resolved as transformers
5.23.0 ``DiffusionGemmaTextConfig.__post_init__``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from localdiff.arch.base import ROTARY_CACHES, CheckpointRules, LayerGeom, Tensorish
from localdiff.arch.base import parameter_counts as _counts
from localdiff.errors import CheckpointError

MODEL_TYPE = "diffusion_gemma"
FAMILY = "canvas"
ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"


def resolve_layers(t: dict) -> tuple[list[str], list[tuple[int, int]]]:
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
    if heads < 1:
        raise ValueError(f"num_attention_heads must be >= 1, got {heads}")
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
    dims = [
        (int(plc.get(i, {}).get("head_dim", head_dim)), int(plc.get(i, {}).get("num_key_value_heads", kv)))
        for i in range(n)
    ]
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
        types, dims = resolve_layers(t)
        n, heads = len(types), tuple(dims)
        rope = t.get("rope_parameters") or {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        }
        eos = t.get("eos_token_id", 1)
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        if not t.get("num_experts") or not t.get("top_k_experts") or not t.get("moe_intermediate_size"):
            raise ValueError("text_config lacks num_experts / top_k_experts / moe_intermediate_size")
        return cls(
            vocab_size=int(t["vocab_size"]),
            hidden_size=int(t["hidden_size"]),
            intermediate_size=int(t["intermediate_size"]),
            num_hidden_layers=n,
            num_attention_heads=int(t["num_attention_heads"]),
            layer_types=tuple(types),
            layer_heads=heads,
            sliding_window=int(t.get("sliding_window", 512)),
            rope_parameters=rope,
            num_experts=int(t["num_experts"]),
            top_k_experts=int(t["top_k_experts"]),
            moe_intermediate_size=int(t["moe_intermediate_size"]),
            canvas_length=int(cfg.get("canvas_length") or 256),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            final_logit_softcapping=t.get("final_logit_softcapping", 30.0),
            max_position_embeddings=int(t.get("max_position_embeddings", 131072)),
            pad_token_id=t.get("pad_token_id", 0),
            eos_token_id=eos,
            bos_token_id=t.get("bos_token_id", 2),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", True))),
            raw=cfg,
        )

    def window(self, i: int) -> int | None:
        """Sliding window (tokens) of layer i, None for full attention."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None


# -- the spec contract (localdiff.arch.base.ArchSpec) -------------------------------------------------------
def text_config(config: dict) -> dict:
    """The text part of a config.json dict (``text_config`` when present, else the dict itself)."""
    return dict(config.get("text_config") or config)


def layer_geometry(config: dict) -> list[LayerGeom]:
    """Per-layer attention geometry, resolved as the reference does (``per_layer_config`` for full-attention layers,
    else ``global_head_dim`` / ``num_global_key_value_heads``; the last layer is always full attention).

    Raises:
        CheckpointError: required fields are missing or ``layer_types`` has the wrong length.
    """
    t = text_config(config)
    try:
        types, dims = resolve_layers(t)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"config.json: invalid text_config ({e})") from None
    window = int(t.get("sliding_window", 512))
    out = []
    for ty, (head_dim, kv) in zip(types, dims):
        sliding = ty == "sliding_attention"
        out.append(LayerGeom(ty, head_dim, kv, sliding, window if sliding else None))
    return out


def _req(t: dict, key: str) -> int:
    v = t.get(key)
    if v is None:
        raise CheckpointError(f"config.json: text_config lacks '{key}'")
    return int(v)


def tensor_shapes(config: dict, include_buffers: bool = True) -> list[Tensorish]:
    """Every text-model weight tensor implied by ``config`` (one copy of shared weights).

    Components: ``embeddings`` (tied LM head counted here once; an untied ``lm_head`` is its own component),
    ``attention``, ``attention_norms``, ``dense_mlp``, ``router``, ``experts``, ``norms`` (layer norms, the final
    norm and — with ``include_buffers`` — the decoder and encoder ``layer_scalar`` buffers), ``self_conditioning``.
    Names are ours (as ``named_parameters`` / ``named_buffers`` give them; the contract test checks it).
    """
    t = text_config(config)
    h, v = _req(t, "hidden_size"), _req(t, "vocab_size")
    inter, heads = _req(t, "intermediate_size"), _req(t, "num_attention_heads")
    e, im = _req(t, "num_experts"), _req(t, "moe_intermediate_size")
    bias = bool(t.get("attention_bias", False))
    tied = bool(config.get("tie_word_embeddings", t.get("tie_word_embeddings", True)))
    out = [Tensorish("embeddings", None, "embed_tokens.weight", (v, h))]
    if not tied:
        out.append(Tensorish("lm_head", None, "lm_head.weight", (v, h)))
    for i, g in enumerate(layer_geometry(config)):
        p = f"layers.{i}."
        projs = [("q_proj", heads * g.head_dim, h), ("k_proj", g.kv_heads * g.head_dim, h)]
        if g.has_v:
            projs.append(("v_proj", g.kv_heads * g.head_dim, h))
        projs.append(("o_proj", h, heads * g.head_dim))
        for name, o, k in projs:
            out.append(Tensorish("attention", i, f"{p}self_attn.{name}.weight", (o, k)))
            if bias:
                out.append(Tensorish("attention", i, f"{p}self_attn.{name}.bias", (o,)))
        for name in ("q_norm", "k_norm"):
            out.append(Tensorish("attention_norms", i, f"{p}self_attn.{name}.weight", (g.head_dim,)))
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            out.append(Tensorish("dense_mlp", i, f"{p}mlp.{name}.weight", shape))
        out += [
            Tensorish("router", i, f"{p}router.proj.weight", (e, h)),
            Tensorish("router", i, f"{p}router.scale", (h,)),
            Tensorish("router", i, f"{p}router.per_expert_scale", (e,)),
            Tensorish("experts", i, f"{p}experts.gate_up_proj", (e, 2 * im, h)),
            Tensorish("experts", i, f"{p}experts.down_proj", (e, h, im)),
        ]
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
            "pre_feedforward_layernorm_2",
        ):
            out.append(Tensorish("norms", i, f"{p}{name}.weight", (h,)))
        if include_buffers:
            out.append(Tensorish("norms", i, f"{p}layer_scalar", (1,), buffer=True))
            out.append(Tensorish("norms", i, f"{p}enc_layer_scalar", (1,), buffer=True))
    out.append(Tensorish("norms", None, "norm.weight", (h,)))
    out += [
        Tensorish("self_conditioning", None, "self_conditioning.pre_norm.weight", (h,)),
        Tensorish("self_conditioning", None, "self_conditioning.mlp.gate_proj.weight", (inter, h)),
        Tensorish("self_conditioning", None, "self_conditioning.mlp.up_proj.weight", (inter, h)),
        Tensorish("self_conditioning", None, "self_conditioning.mlp.down_proj.weight", (h, inter)),
    ]
    return out


def parameter_counts(config: dict) -> dict:
    """Parameters (not buffers) of the text model: ``total``, ``active_per_token`` (total minus the experts a token
    does not use: ``layers × (E − k) × 3·H·I_moe``) and ``by_component``."""
    t = text_config(config)
    e, k = _req(t, "num_experts"), _req(t, "top_k_experts")
    per_expert = 3 * _req(t, "hidden_size") * _req(t, "moe_intermediate_size")
    return _counts(tensor_shapes(config, include_buffers=False), _req(t, "num_hidden_layers") * (e - k) * per_expert)


def parse_config(raw: dict) -> "DiffusionGemmaConfig":
    """The args dataclass of a config.json dict (contract name for :meth:`DiffusionGemmaConfig.from_dict`)."""
    return DiffusionGemmaConfig.from_dict(raw)


def summary_fields(config: dict) -> dict:
    """Family-specific fields of ``localdiff show``: experts and canvas length."""
    t = text_config(config)
    return {
        "experts": {
            "total": _req(t, "num_experts"),
            "top_k": _req(t, "top_k_experts"),
            "moe_intermediate_size": _req(t, "moe_intermediate_size"),
            "dense_mlp_intermediate_size": _req(t, "intermediate_size"),
        },
        "canvas_length": int(config.get("canvas_length") or 256),
    }


# -- checkpoint names ---------------------------------------------------------------------------------------------
_DEC = "model.decoder."
_ENC = "model.encoder.language_model."


def checkpoint_names(local: str) -> list[str]:
    """Candidate checkpoint tensor names for our parameter / buffer ``local`` (first found wins).

    The decoder holds the shared weights (``model.decoder.*``); the encoder's tied copies
    (``model.encoder.language_model.*``) are accepted as aliases. The encoder keeps its own ``layer_scalar``.
    """
    if local.endswith("enc_layer_scalar"):
        return [_ENC + local.replace("enc_layer_scalar", "layer_scalar")]
    if local.startswith("self_conditioning.mlp."):
        return [_DEC + local.replace("self_conditioning.mlp.", "self_conditioning.")]
    if local.startswith("lm_head."):
        return [local]
    return [_DEC + local, _ENC + local]


def keeps_checkpoint_dtype(local: str) -> bool:
    """True for tensors loaded in the checkpoint's dtype whatever ``dtype=`` asks (the per-layer ``layer_scalar``
    buffers are cast only after all tensors are read, as the reference does)."""
    return local.endswith("layer_scalar")


def is_skipped_checkpoint_tensor(name: str) -> bool:
    """True for checkpoint tensors the text runtime never reads (vision tower, vision embedder)."""
    return any(re.search(p, name) for p in _VISION)


_VISION = (r"\.vision_tower\.", r"\.embed_vision\.", r"^model\.vision")

#: what a DiffusionGemma checkpoint may hold unread (:class:`localdiff.arch.base.CheckpointRules`): rotary caches,
#: the vision tower and embedder (text-only runtime); the encoder's copies of decoder weights (transformers ties them
#: to the decoder's: ``DiffusionGemmaModel._tied_weights_keys``) and the other way round, and ``lm_head.weight``
#: tied to the embeddings, each only when equal to the tensor read; an untied head would be read
CHECKPOINT_RULES = CheckpointRules(
    ignored=(ROTARY_CACHES,) + _VISION,
    tied=(
        (r"model\.encoder\.language_model\.(?!layers\.\d+\.layer_scalar$)(.+)", r"model.decoder.\1"),
        (r"model\.decoder\.(?!layers\.\d+\.layer_scalar$)(.+)", r"model.encoder.language_model.\1"),
        (r"lm_head\.weight", "model.decoder.embed_tokens.weight"),
    ),
    switches=(("tie_word_embeddings", False), ("attention_bias", True)),
)
