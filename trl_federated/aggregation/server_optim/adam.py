"""`ServerAdam` ("adam"): the paper's literal step (Eqs. momentum, model_update: ε = 1e-8, no bias correction), which
moves every coordinate by about α whatever Δ's size."""

from __future__ import annotations

import math

import torch

from .base import ServerOptimizer


class ServerAdam(ServerOptimizer):
    """The paper's server update (Algorithm 1, lines 22-23), element-wise:

        m^{[t]} = β1 m^{[t-1]} + (1 − β1) Δ^{[t]}              (Eq. momentum)
        v^{[t]} = β2 v^{[t-1]} + (1 − β2) (Δ^{[t]})²
        θ^{[t+1]} = θ^{[t]} + α m^{[t]} / (√v^{[t]} + ε)        (Eq. model_update)

    m and v start at 0 (m^{[-1]} = v^{[-1]} = 0) and, as in the paper, are not bias-corrected; with
    `bias_correction=True` they are divided by (1 − β^{t+1}) as in Kingma & Ba's Adam.
    """

    default_learning_rate = None  # SERVER_ADAM_SCALE × E × the local rate (`FedGRPOConfig`)
    default_epsilon = 1e-8  # the paper's (Algorithm 1)
    takes_epsilon = True

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

    @classmethod
    def from_config(cls, args):
        return cls(learning_rate=args.server_learning_rate, beta1=args.server_beta1, beta2=args.server_beta2,
                   epsilon=args.server_epsilon, bias_correction=args.server_bias_correction)

    def start_step(self):
        self.num_steps += 1

    def step_block(self, params, delta):
        keys = list(params)
        m, denominator, scale = self.update_moments(keys, delta)
        new = torch._foreach_addcdiv([params[k].float() for k in keys], m, denominator,
                                     value=self.learning_rate * scale)
        return {key: value.to(params[key].dtype) for key, value in zip(keys, new)}

    def update_moments(self, keys: list[str], delta: dict[str, torch.Tensor]) -> tuple[list, list, float]:
        """Eq. momentum for the tensors `keys`: m and v updated in place; returns m, the denominator √v + ε (√v̂ + ε
        with bias correction) and the factor on m per unit learning rate (1 / (1 − β1^t) with bias correction)."""
        for key in keys:
            if key not in self.m:  # m^{[-1]} = v^{[-1]} = 0
                self.m[key] = torch.zeros_like(delta[key])
                self.v[key] = torch.zeros_like(delta[key])
        m, v, d = [self.m[k] for k in keys], [self.v[k] for k in keys], [delta[k] for k in keys]
        torch._foreach_lerp_(m, d, 1 - self.beta1)  # m ← β1 m + (1 − β1) Δ
        torch._foreach_mul_(v, self.beta2)
        torch._foreach_addcmul_(v, d, d, value=1 - self.beta2)  # v ← β2 v + (1 − β2) Δ²

        scale = 1.0
        denominator = torch._foreach_sqrt(v)
        if self.bias_correction:
            scale /= 1 - self.beta1**self.num_steps
            torch._foreach_div_(denominator, math.sqrt(1 - self.beta2**self.num_steps))
        torch._foreach_add_(denominator, self.epsilon)
        return m, denominator, scale

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
