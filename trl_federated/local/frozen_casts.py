"""The frozen base model's projections cast to the autocast dtype once, not at every call, with the same products.

Under `torch.autocast` (the loss with `bf16`), a linear projection casts its float32 operands to the autocast dtype
at every call. Autocast keeps a cast only for leaf tensors that require grad (the LoRA matrices), and only until its
context exits, so each frozen weight of the base model is cast again at every forward: in a local step of the
quickstart, each weight four times (two micro-batches, each a prompt and a completion pass of the shared prefix), and
TRL's fused LM head casts the output embedding chunk by chunk in its forward and again in its backward.

While `cast_once(model, casts, head_dtype)` is active, every frozen `torch.nn.Linear` of `model` multiplies, where
autocast is on, by its weight cast once into `casts` (`FrozenCasts`), and the output embedding's weight is that cast
in `head_dtype` (the fused head's compute dtype) for the head to read. Autocast's own cast, and the head's, is
`weight.to(dtype)`, so the products are the same bit for bit. A weight changed in place (its version counter) or
replaced is cast again; outside autocast a projection multiplies by its own weight.

Each projection also multiplies its input's rows flattened to a matrix, as `torch.nn.functional.linear` does for a
contiguous input: for a non-contiguous one, such as the last position's hidden state that the shared prefix's prompt
pass projects onto the vocabulary (`logits_to_keep=1`), `linear` falls back to a batched product over a copy of the
whole weight (28M entries for SmolLM2's LM head, ~0.3 s a call measured).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F


class FrozenCasts:
    """Frozen weights cast to an autocast dtype, by module: each cast made once while the weight stays as it is."""

    def __init__(self):
        self._casts: dict[torch.nn.Module, tuple[tuple, torch.Tensor]] = {}

    def weight(self, module: torch.nn.Linear, dtype: torch.dtype) -> torch.Tensor:
        weight = module.weight
        key = (dtype, weight.data_ptr(), weight._version)
        cached = self._casts.get(module)
        if cached is None or cached[0] != key:
            cached = self._casts[module] = (key, weight.detach().to(dtype))
        return cached[1]


def _forward(casts: FrozenCasts, self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if torch.is_autocast_enabled(weight.device.type) and weight.dtype != torch.get_autocast_dtype(weight.device.type):
        weight = casts.weight(self, torch.get_autocast_dtype(weight.device.type))
    rows = input.reshape(-1, self.in_features)
    return F.linear(rows, weight, self.bias).view(*input.shape[:-1], self.out_features)


@contextlib.contextmanager
def cast_once(model: torch.nn.Module, casts: FrozenCasts, head_dtype: torch.dtype | None = None) -> Iterator[None]:
    """While active, the frozen float32 `torch.nn.Linear`s of `model` (exactly that class: a quantized subclass has its
    own forward) multiply under autocast by their weights cast once into `casts`, and, with `head_dtype`, the output
    embedding's weight is its cast to `head_dtype` (only while the head computes in that dtype: under autocast to it).
    The backward may run after the context has closed: autograd keeps the cast it multiplied by, as it keeps
    autocast's."""
    patched = [
        module for module in model.modules()
        if type(module) is torch.nn.Linear and not module.weight.requires_grad
        and module.weight.dtype == torch.float32 and "forward" not in vars(module)
    ]  # fmt: skip
    head = model.get_output_embeddings() if head_dtype is not None else None
    if head not in patched:
        head = None
    for module in patched:
        module.forward = types.MethodType(functools.partial(_forward, casts), module)
    if head is not None:
        weight = head.weight
        head.weight = torch.nn.Parameter(casts.weight(head, head_dtype), requires_grad=False)
    try:
        yield
    finally:
        for module in patched:
            del module.forward
        if head is not None:
            head.weight = weight


def autocast_dtype(autocast: Callable[[], contextlib.AbstractContextManager], device_type: str) -> torch.dtype | None:
    """The dtype `autocast()` (a trainer's `accelerator.autocast`) casts to on `device_type`, None where it does not."""
    with autocast():
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
