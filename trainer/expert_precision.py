"""Mixed precision for MoE experts in one process.

torch's grouped matrix product is not autocast-enabled (pytorch/pytorch#174763). Under autocast a Qwen3-MoE's
experts therefore see fp32 activations (the residual stream is fp32) and their fp32 weights, and torch runs
an fp32 grouped product as one matrix product per expert, several times slower than bf16 on a GPU. FSDP2's
mixed-precision policy hands every layer bf16 weights, so only one process needs this: it casts the experts'
weights itself, as autocast casts a linear's, with a differentiable cast inside the forward, so gradients
still reach the fp32 weights and AdamW updates them in fp32. Only public API is used
(``torch.func.functional_call``); should torch make the product autocast-enabled, the cast stays correct.
Forward hooks on an experts module run twice per call (outer call, then the reparametrised one).
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch
from torch.func import functional_call

_inside = contextvars.ContextVar("rollbus_expert_cast", default=False)


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules holding every expert's weights as one 3-D parameter each (transformers' fused experts)."""
    return [
        module
        for module in model.modules()
        if (own := list(module.parameters(recurse=False))) and all(p.dim() == 3 for p in own)
    ]


def cast_experts_under_autocast(model: torch.nn.Module) -> int:
    """Make each experts module of ``model`` compute in the autocast dtype while autocast is on (and as
    before when it is off); how many modules it changed."""
    modules = expert_modules(model)
    for module in modules:
        module.forward = _casting(module, module.forward)
    return len(modules)


def _casting(module: torch.nn.Module, forward: Any) -> Any:
    def cast_forward(*args: Any, **kwargs: Any) -> Any:
        device = next(module.parameters()).device.type
        if _inside.get() or not torch.is_autocast_enabled(device):
            return forward(*args, **kwargs)
        dtype = torch.get_autocast_dtype(device)
        weights = {name: p.to(dtype) for name, p in module.named_parameters(recurse=False)}
        token = _inside.set(True)  # functional_call calls this forward again: the second time, run it
        try:
            return functional_call(module, weights, args, kwargs)
        finally:
            _inside.reset(token)

    return cast_forward
