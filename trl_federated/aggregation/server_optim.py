"""Server optimizers: how the pseudo-gradient Δ moves the global adapter (Eqs. momentum, model_update).

Like Flower's FedOpt family (Reddi et al., "Adaptive Federated Optimization", ICLR 2021), the server treats Δ
as a gradient-ascent direction: SGD with learning rate 1 is FedAvg, Adam is FedAdam and the paper's update.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class ServerOptimizer(ABC):
    """Applies Δ to θ; subclasses keep their state explicit and serialisable."""

    def __init__(self, learning_rate: float):
        if not learning_rate > 0:
            raise ValueError(f"Server `learning_rate` must be > 0, got {learning_rate}.")
        self.learning_rate = learning_rate

    @abstractmethod
    def step(self, params: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return the new parameters (same keys and dtypes as `params`); `params` is left untouched."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class ServerSGD(ServerOptimizer):
    """θ^{[t+1]} = θ^{[t]} + α Δ^{[t]}. With α = 1 the new global model is the ω-weighted average of the clients."""

    def __init__(self, learning_rate: float = 1.0):
        super().__init__(learning_rate)

    def step(self, params, delta):
        return {
            key: (params[key].float() + self.learning_rate * delta[key]).to(params[key].dtype) for key in params
        }


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

    def step(self, params, delta):
        keys = list(params)
        if not self.m:
            self.m = {key: torch.zeros_like(delta[key]) for key in keys}
            self.v = {key: torch.zeros_like(delta[key]) for key in keys}
        m, v, d = [self.m[k] for k in keys], [self.v[k] for k in keys], [delta[k] for k in keys]
        torch._foreach_lerp_(m, d, 1 - self.beta1)  # m ← β1 m + (1 − β1) Δ
        torch._foreach_mul_(v, self.beta2)
        torch._foreach_addcmul_(v, d, d, value=1 - self.beta2)  # v ← β2 v + (1 − β2) Δ²
        self.num_steps += 1

        step_size, v_scale = self.learning_rate, 1.0
        if self.bias_correction:
            step_size /= 1 - self.beta1**self.num_steps
            v_scale = 1 - self.beta2**self.num_steps
        denominator = torch._foreach_div(v, v_scale) if v_scale != 1.0 else v
        denominator = torch._foreach_sqrt(denominator)
        torch._foreach_add_(denominator, self.epsilon)
        updates = torch._foreach_div(m, denominator)
        return {
            key: (params[key].float() + step_size * update).to(params[key].dtype) for key, update in zip(keys, updates)
        }

    def state_dict(self):
        return {"m": dict(self.m), "v": dict(self.v), "num_steps": self.num_steps}

    def load_state_dict(self, state):
        # Copies: `step` updates m and v in place, and the source (a checkpoint, another server) must not move.
        self.m = {key: tensor.clone() for key, tensor in state["m"].items()}
        self.v = {key: tensor.clone() for key, tensor in state["v"].items()}
        self.num_steps = int(state["num_steps"])
