"""`ServerNormMatchedAdam` ("adam-norm"): Adam's direction, scaled per tensor to the norm of that tensor's Δ."""

from __future__ import annotations

import torch

from .adam import ServerAdam


class ServerNormMatchedAdam(ServerAdam):
    """Adam's direction at the clients' step length, per tensor T of the adapter:

        m, v as Eq. momentum, bias-corrected;  d_T = m̂_T / (√v̂_T + ε)
        θ_T^{[t+1]} = θ_T^{[t]} + η ‖Δ_T‖ d_T / ‖d_T‖

    With η = 1 no tensor moves farther than FedAvg would move it this round, and a round whose Δ is zero moves
    nothing, however long the momentum; Adam decides only the direction within each tensor (a trust ratio, as LAMB's
    per layer, taken against the update instead of the weights)."""

    default_learning_rate = 1.0

    def __init__(self, learning_rate: float = 1.0, beta1: float = 0.9, beta2: float = 0.99, epsilon: float = 1e-8):
        super().__init__(learning_rate, beta1, beta2, epsilon, bias_correction=True)

    @classmethod
    def from_config(cls, args):
        return cls(learning_rate=args.server_learning_rate, beta1=args.server_beta1, beta2=args.server_beta2,
                   epsilon=args.server_epsilon)

    def step_block(self, params, delta):
        keys = list(params)
        m, denominator, _ = self.update_moments(keys, delta)  # m̂'s factor cancels in d / ‖d‖
        new = {}
        for key, direction in zip(keys, torch._foreach_div(m, denominator)):
            direction_norm = float(torch.linalg.vector_norm(direction))
            scale = self.learning_rate * float(torch.linalg.vector_norm(delta[key])) / direction_norm \
                if direction_norm > 0 else 0.0
            new[key] = (params[key].float() + direction * scale).to(params[key].dtype)
        return new
