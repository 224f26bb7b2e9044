"""`ServerNesterov` ("nesterov"): Nesterov outer momentum, DiLoCo's outer step (Douillard et al., 2023)."""

from __future__ import annotations

import torch

from .base import ServerOptimizer


class ServerNesterov(ServerOptimizer):
    """Nesterov outer momentum, DiLoCo's outer step (Douillard et al., 2023: η = 0.7, μ = 0.9), on the same
    pseudo-gradient:

        m^{[t]} = μ m^{[t-1]} + Δ^{[t]},   m^{[-1]} = 0
        θ^{[t+1]} = θ^{[t]} + η (Δ^{[t]} + μ m^{[t]})

    Every step lies in the span of the clients' changes; a direction that persists over rounds grows up to
    η (1 + μ / (1 − μ)) times Δ, one that cancels does not."""

    default_learning_rate = 0.7  # DiLoCo's outer learning rate

    def __init__(self, learning_rate: float = 0.7, momentum: float = 0.9):
        super().__init__(learning_rate)
        if not 0 <= momentum < 1:
            raise ValueError(f"Nesterov momentum (`server_beta1`) must lie in [0, 1), got {momentum}.")
        self.momentum = momentum
        self.m: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, args):
        return cls(learning_rate=args.server_learning_rate, momentum=args.server_beta1)

    def step_block(self, params, delta):
        keys = list(params)
        for key in keys:
            if key not in self.m:
                self.m[key] = torch.zeros_like(delta[key])
        m, d = [self.m[key] for key in keys], [delta[key] for key in keys]
        torch._foreach_mul_(m, self.momentum)
        torch._foreach_add_(m, d)  # m ← μ m + Δ
        look_ahead = torch._foreach_add(d, m, alpha=self.momentum)  # Δ + μ m
        new = torch._foreach_add([params[key].float() for key in keys], look_ahead, alpha=self.learning_rate)
        return {key: value.to(params[key].dtype) for key, value in zip(keys, new)}

    def block_state(self, keys):
        return {"m": {key: self.m[key] for key in keys}}

    def state_dict(self):
        return {"m": dict(self.m)}

    def load_state_dict(self, state):
        if "m" not in state:
            raise ValueError("Server Nesterov state lacks 'm': it was not saved by a server Nesterov momentum.")
        self.m = {key: tensor.clone() for key, tensor in state["m"].items()}
