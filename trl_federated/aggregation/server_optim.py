"""Server optimizers: how the pseudo-gradient Δ moves the global adapter (Eqs. momentum, model_update).

Like Flower's FedOpt family (Reddi et al., "Adaptive Federated Optimization", ICLR 2021), the server treats Δ
as a gradient-ascent direction: SGD with learning rate 1 is FedAvg, Adam is FedAdam and the paper's update.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import torch

from .blocks import blocks

# The values of `FedGRPOConfig.server_optimizer` (`aggregation.server_optimizer_from_config`).
SERVER_OPTIMIZERS = ("adam", "sgd")


class ServerOptimizer(ABC):
    """Applies Δ to θ; subclasses keep their state explicit and serialisable.

    A step is `start_step()` followed by `step_block()` on every part of the adapter exactly once, so that the
    aggregator can compute Δ and apply it one cache-sized block at a time (see `blocks`); `step()` does all of it
    for a whole Δ.
    """

    def __init__(self, learning_rate: float):
        if not learning_rate > 0:
            raise ValueError(f"Server `learning_rate` must be > 0, got {learning_rate}.")
        self.learning_rate = learning_rate

    def step(self, params: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return the new parameters (same keys and dtypes as `params`); `params` is left untouched."""
        self.start_step()
        new = {}
        for keys in blocks(params):
            new.update(self.step_block({key: params[key] for key in keys}, {key: delta[key] for key in keys}))
        return new

    def start_step(self) -> None:
        """Open a server step; its `step_block` calls follow."""

    @abstractmethod
    def step_block(self, params: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new values of the part `params` of the adapter, given its part of Δ; `params` is left untouched."""

    def block_state(self, keys: list[str]) -> dict[str, Any]:
        """The state of the part `keys` of the adapter, as the last `step_block` left it (nested dicts of tensors, as
        `state_dict`), for the aggregator's checks."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class ServerSGD(ServerOptimizer):
    """θ^{[t+1]} = θ^{[t]} + α Δ^{[t]}. With α = 1 the new global model is the ω-weighted average of the clients."""

    def __init__(self, learning_rate: float = 1.0):
        super().__init__(learning_rate)

    def step_block(self, params, delta):
        keys = list(params)
        new = torch._foreach_add(
            [params[key].float() for key in keys], [delta[key] for key in keys], alpha=self.learning_rate
        )
        return {key: value.to(params[key].dtype) for key, value in zip(keys, new)}


class ServerAdam(ServerOptimizer):
    """The paper's server update (Algorithm 1, lines 22-23), element-wise:

        m^{[t]} = β1 m^{[t-1]} + (1 − β1) Δ^{[t]}              (Eq. momentum)
        v^{[t]} = β2 v^{[t-1]} + (1 − β2) (Δ^{[t]})²
        θ^{[t+1]} = θ^{[t]} + α m^{[t]} / (√v^{[t]} + ε)        (Eq. model_update)

    m and v start at 0 (m^{[-1]} = v^{[-1]} = 0) and, as in the paper, are not bias-corrected; with
    `bias_correction=True` they are divided by (1 − β^{t+1}) as in Kingma & Ba's Adam.
    """

    def __init__(
        self,
        learning_rate: float = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.99,
        epsilon: float = 1e-8,
        bias_correction: bool = False,
    ):
        super().__init__(learning_rate)
        self.beta1, self.beta2, self.epsilon, self.bias_correction = beta1, beta2, epsilon, bias_correction
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.num_steps = 0

    def start_step(self):
        self.num_steps += 1

    def step_block(self, params, delta):
        keys = list(params)
        for key in keys:
            if key not in self.m:  # m^{[-1]} = v^{[-1]} = 0
                self.m[key] = torch.zeros_like(delta[key])
                self.v[key] = torch.zeros_like(delta[key])
        m, v, d = [self.m[k] for k in keys], [self.v[k] for k in keys], [delta[k] for k in keys]
        torch._foreach_lerp_(m, d, 1 - self.beta1)  # m ← β1 m + (1 − β1) Δ
        torch._foreach_mul_(v, self.beta2)
        torch._foreach_addcmul_(v, d, d, value=1 - self.beta2)  # v ← β2 v + (1 − β2) Δ²

        step_size = self.learning_rate
        denominator = torch._foreach_sqrt(v)
        if self.bias_correction:
            step_size /= 1 - self.beta1**self.num_steps
            torch._foreach_div_(denominator, math.sqrt(1 - self.beta2**self.num_steps))
        torch._foreach_add_(denominator, self.epsilon)
        new = torch._foreach_addcdiv([params[k].float() for k in keys], m, denominator, value=step_size)
        return {key: value.to(params[key].dtype) for key, value in zip(keys, new)}

    def block_state(self, keys):
        return {"m": {key: self.m[key] for key in keys}, "v": {key: self.v[key] for key in keys}}

    def state_dict(self):
        return {"m": dict(self.m), "v": dict(self.v), "num_steps": self.num_steps}

    def load_state_dict(self, state):
        missing = sorted({"m", "v", "num_steps"} - set(state))
        if missing:
            raise ValueError(f"Server Adam state lacks {missing}: it was not saved by a server Adam.")
        # Copies: `step` updates m and v in place, and the source (a checkpoint, another server) must not move.
        self.m = {key: tensor.clone() for key, tensor in state["m"].items()}
        self.v = {key: tensor.clone() for key, tensor in state["v"].items()}
        self.num_steps = int(state["num_steps"])
