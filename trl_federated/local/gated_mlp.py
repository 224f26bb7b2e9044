"""Gated MLPs that keep half of their activations for the backward, with the same gradients.

A Llama-style MLP computes `down_proj(silu(gate_proj(x)) * up_proj(x))`. For the backward, autograd keeps four
intermediate-size tensors per token: g = gate_proj(x) (for silu's derivative), silu(g) and u = up_proj(x) (for the
product's), and h = silu(g) * u (for the gradient of the LoRA matrices of `down_proj`). They are most of what a
training forward keeps alive (about 54% for SmolLM2-135M with LoRA on every projection): the intermediate size is
2.7 times the hidden size. silu(g) and h are cheap elementwise functions of g and u, so `recomputed_gated_mlp`
keeps g and u only and recomputes the other two in the backward:

- silu(g) * u is a `SiluMul` autograd function that saves (g, u); its backward applies the same ATen kernels as
  autograd's `MulBackward0` and `SiluBackward0` to the same operands;
- the tensors `down_proj` saves that are views of h are packed (`torch.autograd.graph.saved_tensors_hooks`) as
  "recompute silu(g) * u", and unpacked by recomputing it with the forward's kernels: the same values.

So the gradients are those of autograd's graph. They can differ from it in the last bits only where the BLAS gives
different roundings for operands at different memory addresses (the recomputed h is a new buffer), as it does
between two runs of the same graph.

Memory: two intermediate-size tensors fewer per token and layer; CPU: two elementwise passes more in the backward,
small next to the projections.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import LlamaMLP


class SiluMul(torch.autograd.Function):
    """silu(gate) * up, saving only its two inputs."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        # MulBackward0 gives grad * up to silu(gate) and grad * silu(gate) to up; SiluBackward0 is silu_backward.
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def _recomputed_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The forward of LlamaMLP and its copies, with h = silu(g) * u recomputed where `down_proj` needs it."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not torch.is_grad_enabled():
        return self.down_proj(F.silu(gate) * up)
    hidden = SiluMul.apply(gate, up)
    # Autograd keeps both hooks with every tensor they pack, so they must not hold h itself.
    hidden_address, hidden_dtype = hidden.untyped_storage().data_ptr(), hidden.dtype

    def pack(tensor: torch.Tensor):
        # A saved view of h (the LoRA A matrix's input, possibly flattened to 2-D) is kept as its geometry only.
        if tensor.untyped_storage().data_ptr() == hidden_address and tensor.dtype == hidden_dtype:
            return tensor.size(), tensor.stride(), tensor.storage_offset()
        return tensor

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        with torch.no_grad():
            return (F.silu(gate) * up).as_strided(*packed)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return self.down_proj(hidden)


def _is_silu_gated_mlp(module: nn.Module) -> bool:
    # Transformers' modular copies of LlamaMLP (Qwen2, Qwen3, Mistral, SmolLM3, Olmo2, ...) have its forward, byte code
    # and names alike; anything else (other activations, extra terms, fused projections) is left alone.
    forward = getattr(type(module).forward, "__code__", None)
    reference = LlamaMLP.forward.__code__
    return (
        forward is not None
        and forward.co_code == reference.co_code
        and forward.co_names == reference.co_names
        and isinstance(getattr(module, "act_fn", None), (SiLUActivation, nn.SiLU))
    )


@contextlib.contextmanager
def recomputed_gated_mlp(model: nn.Module) -> Iterator[None]:
    """While active, the SiLU-gated MLPs of `model` (LlamaMLP and its copies) keep only gate_proj(x) and up_proj(x)
    for the backward (see the module docstring); the gradients are autograd's. The backward may run after the
    context has closed. Nothing changes under gradient checkpointing, which keeps no MLP activation anyway."""
    modules = list(model.modules())
    if any(isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing for module in modules):
        yield
        return
    patched = [module for module in modules if _is_silu_gated_mlp(module) and "forward" not in vars(module)]
    for module in patched:
        module.forward = types.MethodType(_recomputed_forward, module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward
