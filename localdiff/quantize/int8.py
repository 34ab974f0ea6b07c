"""int8 weight-only quantization: per-output-channel absmax scales, int8 linear layers and stacked int8 experts.

A float weight W[out, in] becomes ``q = round(W / s)`` (int8 in [-127, 127]) with ``s = max|W[o, :]| / 127`` (stored as
bf16, rounded up; one per output channel, per expert and channel for stacked experts). ``y = x @ (q · s)ᵀ``.
Resident bytes: ``out · (in + 2)``, i.e. ``0.5 + 1/in`` of bf16.

Which kernel runs (measured on this project's 2-core AVX-512 CPU, torch 2.13; numbers in docs of
:func:`int8_matmul`):

* CPU, up to 16 rows (block steps, 1-token steps, the experts' rows): the native kernel of
  :mod:`localdiff.kernels.int8` (AMX-INT8 where the CPU has it, else fp32 FMAs; built on first use) when it
  measures fastest for the shape (:func:`cpu_kernel`); on this project's AMX CPU it reads the weights at ~9 GB/s
  for 1–16 rows where ``torch._weight_int8pack_mm`` falls from ~7 GB/s (1 row) to 1.6 GB/s (16 rows).
* CPU, bf16 activations: whichever of the two below measures faster for the shape on this machine
  (:func:`cpu_kernel`); on the AVX-512 machine of these numbers: ``torch._weight_int8pack_mm`` for small batches (≈ 300–345 GFLOP/s from 8 rows up; needs
  ``in_features % 16 == 0``), dequantize-to-bf16-then-GEMM from 48 rows up (≈ 420–720 GFLOP/s at 64–256 rows).
* CPU, fp32 activations: ``x @ q.float()ᵀ · s`` (exact fp32 compute, ≈ 100–180 GFLOP/s at 64–256 rows).
  ``torch._weight_int8pack_mm`` with fp32 activations runs at ≈ 6 GFLOP/s and bitsandbytes' CPU int8 path at
  ≈ 105–180 (fp32) / 120–445 (bf16) GFLOP/s, so neither is used on CPU.
* Opt-in (a recipe's ``int8_activations = "int8"``: ``act_int8`` on :class:`Int8Linear`, the fused q/k/v and
  gate/up, :class:`Int8Head` and an int8 table's head): on CPUs with AVX512-VNNI, calls of at most
  :data:`VNNI_ROWS` rows quantize each activation row to int8 per group of 64 and run
  :func:`localdiff.kernels.int8_vnni.matmul` (``vpdpbusd``, twice ``vdpbf16ps``'s multiply rate; block steps of
  several requests are compute-bound) — not exact in the activations (docs/ARCHITECTURE.md).
* CUDA: bitsandbytes' int8 kernels (``int8_vectorwise_quant`` + ``int8_scaled_mm``: activations quantized per row
  to int8, int8 GEMM, fp16 output scaling) when bitsandbytes is installed; otherwise dequantize and GEMM.

Saving / loading pre-quantized checkpoints and ``quantize_checkpoint`` live in :mod:`localdiff.quantize.io`.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from localdiff.arch.layers import MoEExperts, gelu_tanh
from localdiff.quantize.choose import cpu_kernel
from localdiff.quantize.recipe import DEFAULT_RECIPE, Recipe, RecipeError

_BNB: object | None = None  # False = not available, module = available
#: ``act_int8`` calls of at most this many rows run the int8 × int8 VNNI kernel (:func:`vnni_runs`)
VNNI_ROWS = 64


def bitsandbytes_available() -> bool:
    """True when bitsandbytes imports and registers its int8 ops (its import-time log noise is silenced)."""
    global _BNB
    if _BNB is None:
        if os.environ.get("LOCALDIFF_NO_BNB", "").strip().lower() in ("1", "on", "true", "yes"):  # "0": bnb
            _BNB = False
            return False
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.CRITICAL)
        try:
            import bitsandbytes  # noqa: F401

            _BNB = bitsandbytes if hasattr(torch.ops.bitsandbytes, "int8_scaled_mm") else False
        except Exception:  # any import failure (missing CUDA libs, ...) means "not available"
            _BNB = False
        finally:
            root.setLevel(level)
    return bool(_BNB)


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel absmax int8 quantization of the last dimension.

    The scale is ``max|W[o, :]| / 127`` rounded *up* to bf16, and q = round(W / scale) uses that stored scale, so
    |q| ≤ 127 and ``q · scale`` carries no extra error from storing the scale in 2 bytes (the step grows by
    < 0.8 %). All-zero rows get scale 1 (q = 0).

    Args:
        w: float Tensor[..., out, in] (2-D linear weight or 3-D stacked experts); computed in fp32 one leading slice
            at a time, so the fp32 temporary is at most one expert's weight.
    Returns:
        (q: int8 Tensor of w's shape, scale: bf16 Tensor[..., out]).
    """
    if w.dim() > 2:
        qs, ss = zip(*(quantize_tensor(w[i]) for i in range(w.shape[0])))
        return torch.stack(qs), torch.stack(ss)
    wf = w.detach().float()
    exact = wf.abs().amax(dim=-1) / 127.0
    exact = torch.where(exact > 0, exact, torch.ones_like(exact))
    scale = exact.to(torch.bfloat16)
    scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    q = torch.round(wf / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q · scale`` in ``dtype``: q int8 Tensor[..., out, in], scale Tensor[..., out] (bf16 or fp32)."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def _bnb_matmul(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bitsandbytes LLM.int8 (threshold 0): rows of x quantized to int8, int8 GEMM, rescale. x2: [M, K]."""
    ca, sca, _ = torch.ops.bitsandbytes.int8_vectorwise_quant.default(x2.to(torch.float16), 0.0)
    return torch.ops.bitsandbytes.int8_scaled_mm.default(ca, q, sca, scale.float() * 127.0, bias=None, dtype=x2.dtype)


def vnni_runs(x: torch.Tensor, m: int, act_int8: bool) -> bool:
    """Whether :func:`int8_matmul` runs ``m`` rows of x on the int8-activation VNNI kernel: ``act_int8`` (the
    recipe opt-in), m ≤ :data:`VNNI_ROWS`, CPU, fp32 / bf16, no autograd, the library loaded (else the status line of
    :func:`localdiff.kernels.int8_vnni.status` says why)."""
    if (
        not act_int8
        or not 0 < m <= VNNI_ROWS
        or x.device.type != "cpu"
        or x.dtype not in (torch.float32, torch.bfloat16)
    ):
        return False
    from localdiff.kernels import int8_vnni

    return not (x.requires_grad and torch.is_grad_enabled()) and int8_vnni.library() is not None


def int8_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, use_bnb: bool | None = None, act_int8: bool = False
) -> torch.Tensor:
    """``x @ (q · scale)ᵀ`` with the fastest measured kernel for x's device and dtype (see the module docstring).

    Args:
        x: Tensor[..., in] (fp32, bf16 or fp16) on q's device.
        q: int8 Tensor[out, in]; scale: bf16 (or fp32) Tensor[out].
        use_bnb: force (True) / forbid (False) bitsandbytes; None = on CUDA when available. bitsandbytes also runs
            on CPU (used by tests to check the CUDA code path's numerics without a GPU).
        act_int8: the opt-in int8-activation kernel for at most :data:`VNNI_ROWS` rows (:func:`vnni_runs`).
    Returns:
        Tensor[..., out] in x's dtype.

    Measured on the 2-core CPU (GFLOP/s, bf16 act: int8pack / dequant-bf16; fp32 act: dequant-fp32), [out, in] =
    [1408, 2816]: 1 row 111 / 9 / 7; 8 rows 304 / 90 / 27; 32 rows 343 / 269 / 71; 64 rows 348 / 429 / 106;
    256 rows 349 / 720 / 167. bf16 dense GEMM: 880, fp32 dense GEMM: 190.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m, k = x2.shape
    if m == 0:
        return x.new_zeros(*shape[:-1], q.shape[0])
    if not use_bnb and vnni_runs(x, m, act_int8):
        from localdiff.kernels import int8_vnni

        y = int8_vnni.matmul(x2 if x2.stride(-1) == 1 else x2.contiguous(), q, scale)
    elif use_bnb or (use_bnb is None and x.is_cuda and bitsandbytes_available()):
        if not bitsandbytes_available():
            raise RecipeError("bitsandbytes is not installed (pip install bitsandbytes)")
        y = _bnb_matmul(x2, q, scale)
    elif (
        x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and q.dtype == torch.int8
        and (kind := cpu_kernel(m, k, q.shape[0], x.dtype)) != "dequant"
    ):
        if kind == "native":
            from localdiff.kernels import int8 as native

            y = native.matmul(x2 if x2.stride(-1) == 1 else x2.contiguous(), q.contiguous(), scale.contiguous())
        else:
            y = torch._weight_int8pack_mm(x2.contiguous(), q.contiguous(), scale.to(torch.bfloat16))
    elif x.device.type == "cpu" and x.dtype == torch.bfloat16:
        y = (F.linear(x2, q.to(torch.bfloat16)) * scale.float()).to(torch.bfloat16)
    elif x.dtype == torch.float16:
        y = F.linear(x2, (q.float() * scale.float()[:, None]).to(torch.float16))
    else:
        y = (F.linear(x2, q.to(x.dtype)) * scale.to(x.dtype)).to(x.dtype)  # fp32: exact dequantized GEMM
    return y.reshape(*shape[:-1], q.shape[0])


class Int8Linear(nn.Module):
    """Bias-optional linear layer with an int8 weight and per-output-channel bf16 scales.

    State (names match checkpoints: ``<module>.weight``, ``<module>.weight_scale``):
        weight: int8 Tensor[out, in]; weight_scale: bf16 Tensor[out]; bias: Tensor[out] or None (float).
    forward(x: Tensor[..., in]) -> Tensor[..., out] in x's dtype (kernel per :func:`int8_matmul`). ``act_int8``
    (set from a recipe's ``int8_activations = "int8"``): few-row calls on int8 activations by AVX512-VNNI.
    """

    act_int8 = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.bfloat16, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None
        self.use_bnb: bool | None = None

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "Int8Linear":
        """Quantize a float nn.Linear (its weight is read once; the new module holds only int8 + scales)."""
        m = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        q, s = quantize_tensor(lin.weight)
        m.weight, m.weight_scale = q, s
        if lin.bias is not None:
            m.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_matmul(x, self.weight, self.weight_scale, self.use_bnb, self.act_int8)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Int8Experts(MoEExperts):
    """Stacked int8 experts; the grouped forward of :class:`localdiff.arch.layers.MoEExperts` (tokens sorted by
    expert, one call per active expert) runs :meth:`expert_ffn` on int8 weights.

    State (checkpoint names): gate_up_proj int8 Tensor[E, 2I, H], gate_up_proj_scale bf16 Tensor[E, 2I],
    down_proj int8 Tensor[E, H, I], down_proj_scale bf16 Tensor[E, H].
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, device=None):
        nn.Module.__init__(self)  # no float Parameters: only int8 weights and scales
        self.num_experts = num_experts
        kw = dict(device=device)
        self.register_buffer("gate_up_proj", torch.zeros(num_experts, 2 * inter, hidden, dtype=torch.int8, **kw))
        self.register_buffer("gate_up_proj_scale", torch.ones(num_experts, 2 * inter, dtype=torch.bfloat16, **kw))
        self.register_buffer("down_proj", torch.zeros(num_experts, hidden, inter, dtype=torch.int8, **kw))
        self.register_buffer("down_proj_scale", torch.ones(num_experts, hidden, dtype=torch.bfloat16, **kw))
        self.use_bnb: bool | None = None

    @classmethod
    def from_experts(cls, ex: MoEExperts) -> "Int8Experts":
        """Quantize float stacked experts expert by expert (fp32 temporaries of one expert only)."""
        e, two_i, h = ex.gate_up_proj.shape
        m = cls(e, h, two_i // 2, device="meta")
        m.gate_up_proj, m.gate_up_proj_scale = quantize_tensor(ex.gate_up_proj)
        m.down_proj, m.down_proj_scale = quantize_tensor(ex.down_proj)
        return m

    def expert_ffn(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on x: Tensor[N, H] → Tensor[N, H] (gelu-tanh gated FFN on int8 weights)."""
        gate, up = int8_matmul(x, self.gate_up_proj[e], self.gate_up_proj_scale[e], self.use_bnb).chunk(2, dim=-1)
        return int8_matmul(gelu_tanh(gate) * up, self.down_proj[e], self.down_proj_scale[e], self.use_bnb)


QUANT_TYPES = (Int8Linear, Int8Experts)


class Int8Head:
    """An int8 copy of a model's LM head for its logits (a recipe's ``head = "int8"``), kept outside the state
    dict: the float head / tied embedding stays for the token lookup, so this adds ``rows · (H + 2)`` bytes
    (SDAR-1.7B: 311 MB beside the 622 MB bf16 embedding) and halves the bytes the logits read per step.

    Attributes: weight int8 Tensor[rows, H], weight_scale bf16 Tensor[rows].
    ``__call__(h: Tensor[..., H]) -> Tensor[..., rows]`` in h's dtype (:func:`int8_matmul`; ``act_int8`` as
    :class:`Int8Linear`'s).
    """

    act_int8 = False

    def __init__(self, w: torch.Tensor):
        self.weight, self.weight_scale = quantize_tensor(w)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return int8_matmul(h, self.weight, self.weight_scale, act_int8=self.act_int8)


def quantize_head(model: nn.Module) -> bool:
    """Give ``model`` an :class:`Int8Head` (attribute ``head_int8``) of its ``head_weight()`` when its class reads
    one (``supports_int8_head``, e.g. :class:`localdiff.arch.block.BlockLM`); returns whether it did."""
    if not getattr(type(model), "supports_int8_head", False):
        return False
    model.head_int8 = Int8Head(model.head_weight().detach())
    return True


def _targets(model: nn.Module, recipe: Recipe):
    """(name, module) pairs the recipe marks int8 among linear layers and float stacked experts.

    Raises RecipeError when a rule asks int8 for an embedding (embeddings / tied LM head stay float).
    """
    out = []
    for name, mod in model.named_modules():
        if not name or recipe.precision_for(name) != "int8":
            continue
        if isinstance(mod, nn.Embedding) or name == "lm_head" or name.endswith(".lm_head"):
            raise RecipeError(f"recipe {recipe.name!r} asks int8 for {name!r}: embeddings and the LM head stay float")
        if isinstance(mod, nn.Linear) or (isinstance(mod, MoEExperts) and not isinstance(mod, Int8Experts)):
            out.append((name, mod))
    return out


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def quantize_model(model: nn.Module, recipe: Recipe | None = None) -> nn.Module:
    """Quantize ``model`` in place, module by module (each float weight is dropped as soon as its int8 copy exists,
    so peak memory is the remaining float weights + int8 weights + one module's fp32 temporary).

    Args:
        model: a model with nn.Linear layers and :class:`MoEExperts` (e.g. ``localdiff.arch`` DiffusionGemma) whose
            weights are materialised (not on the meta device).
        recipe: which modules become int8 (default: attention, dense MLP, experts; see ``quant/*.toml``).
    Returns:
        the same model; ``model.quant_recipe`` records the recipe.
    Raises:
        RecipeError: the recipe asks int8 for an embedding / LM head.
    """
    recipe = recipe or DEFAULT_RECIPE
    for name, mod in _targets(model, recipe):
        new = Int8Linear.from_linear(mod) if isinstance(mod, nn.Linear) else Int8Experts.from_experts(mod)
        _replace(model, name, new)
        del mod
    if recipe.head == "int8":
        quantize_head(model)
    model.quant_recipe = recipe
    return model


def convert_modules(model: nn.Module, recipe: Recipe | None = None, device=None) -> list[str]:
    """Swap the modules ``recipe`` marks int8 for *empty* int8 modules (no quantization), e.g. on a model built on
    the meta device before loading a pre-quantized checkpoint. Returns the converted module names."""
    recipe = recipe or DEFAULT_RECIPE
    names = []
    for name, mod in _targets(model, recipe):
        if isinstance(mod, nn.Linear):
            dev = device or mod.weight.device
            new = Int8Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device=dev)
        else:
            e, two_i, h = mod.gate_up_proj.shape
            new = Int8Experts(e, h, two_i // 2, device=device or mod.gate_up_proj.device)
        _replace(model, name, new)
        names.append(name)
    model.quant_recipe = recipe
    return names


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name → int8 module of a (partly) quantized model."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QUANT_TYPES)}


def set_backend(model: nn.Module, use_bnb: bool | None) -> None:
    """Force (True) / forbid (False) bitsandbytes in every int8 module; None = automatic (CUDA + installed)."""
    for m in quantized_modules(model).values():
        m.use_bnb = use_bnb


def int8_entries(local: str, t: torch.Tensor, device=None) -> dict[str, torch.Tensor]:
    """Quantize one float tensor while loading: ``{local: int8, local + "_scale": bf16 scales}`` on ``device``.

    For a loader that reads a float checkpoint tensor by tensor into a model whose int8 modules were created with
    :func:`convert_modules` (so peak memory is the int8 model plus one float tensor).
    """
    q, s = quantize_tensor(t.to(device) if device is not None else t)
    return {
        local: q.to(device) if device is not None else q,
        local + "_scale": s.to(device) if device is not None else s,
    }


#: name endings of the scale tensors of int8 modules
SCALE_SUFFIXES = (".weight_scale", ".gate_up_proj_scale", ".down_proj_scale")


def is_quant_state(local: str) -> bool:
    """True for the scale tensors of int8 modules, which a loader must not cast to the float dtype (they are bf16
    by construction; note the router's float ``per_expert_scale`` is not one of them)."""
    return local.endswith(SCALE_SUFFIXES)


def resident_bytes(module: nn.Module) -> int:
    """Bytes of all parameters and buffers of ``module`` (what it keeps in memory)."""
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
