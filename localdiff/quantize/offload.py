"""Follow a memory plan: experts of the plan's host layers stay in host memory and run on the CPU (llama.cpp's
``--n-cpu-moe``); everything else lives on the device.

Module and tensor names are unchanged (forward hooks move the experts' inputs to the CPU and their output back), so
state dicts, saving and quantization work the same on a placed model. A loader can also put each tensor where the
plan wants it while reading (:func:`device_for`), so the host-layer experts never touch device memory.
"""

from __future__ import annotations

import re

import torch
from torch import nn

_EXPERTS = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:mlp\.)?experts(?:\.|$)")
_ONE_EXPERT = re.compile(r"\.experts\.\d+$")


def host_layer_of(name: str) -> int | None:
    """Layer index when ``name`` (module or tensor) belongs to a layer's routed experts — stacked
    (``layers.N.experts``, DiffusionGemma) or one module per expert (``layers.N.mlp.experts.E``, LLaDA-MoE /
    LLaDA2) — else None."""
    m = _EXPERTS.match(name)
    return int(m.group(1)) if m else None


def device_for(name: str, host_layers, device) -> torch.device:
    """Where tensor / module ``name`` lives under a plan: the CPU for experts of ``host_layers``, else ``device``."""
    i = host_layer_of(name)
    return torch.device("cpu") if i is not None and i in set(host_layers) else torch.device(device)


def _to_cpu_hook(module, args, kwargs):
    dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    module._offload_return_device = dev
    args = tuple(a.to("cpu") if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: (v.to("cpu") if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    return args, kwargs


def _back_hook(module, args, kwargs, output):
    dev = getattr(module, "_offload_return_device", None)
    return output.to(dev, non_blocking=True) if dev is not None and isinstance(output, torch.Tensor) else output


def _move_own(module: nn.Module, device) -> None:
    """Move the parameters and buffers a module owns directly (not its children's)."""
    for name, p in list(module._parameters.items()):
        if p is not None and p.device != torch.device(device):
            module._parameters[name] = nn.Parameter(p.data.to(device), requires_grad=p.requires_grad)
    for name, b in list(module._buffers.items()):
        if b is not None:
            module._buffers[name] = b.to(device)


def place_model(net: nn.Module, host_layers, device) -> list[str]:
    """Move ``net`` to ``device`` except the experts of ``host_layers``, which go to (or stay on) the CPU with hooks
    that run them there. Modules are moved one at a time (never the whole model at once), so the device never holds
    more than the plan's device weights.

    Args:
        net: a model with ``layers[i].experts`` (DiffusionGemma) or ``layers[i].mlp.experts[e]`` (LLaDA2), float or
            int8.
        host_layers: layer indices whose experts stay on the host (``Plan.host_expert_layers``).
        device: the compute device.
    Returns:
        names of the experts modules placed on the host.
    """
    host = set(host_layers)
    placed = []
    for name, mod in net.named_modules():
        i = host_layer_of(name)
        if i is not None and i in host:
            _move_own(mod, "cpu")
            # stacked experts run as one module; a ModuleList of experts is never called: hook each expert
            hook = name.endswith(".experts") and not isinstance(mod, nn.ModuleList) or _ONE_EXPERT.search(name)
            if hook:
                if not getattr(mod, "_offload_hooked", False):
                    mod.register_forward_pre_hook(_to_cpu_hook, with_kwargs=True)
                    mod.register_forward_hook(_back_hook, with_kwargs=True)
                    mod._offload_hooked = True
                placed.append(name)
            continue
        _move_own(mod, device)
    return placed


def placement_bytes(net: nn.Module) -> dict[str, int]:
    """Bytes of parameters + buffers per device type ("cpu", "cuda", ...)."""
    out: dict[str, int] = {}
    for t in list(net.parameters()) + list(net.buffers()):
        out[t.device.type] = out.get(t.device.type, 0) + t.numel() * t.element_size()
    return out
