"""`ServerSGD` ("sgd"): θ + α Δ; with α = 1, FedAvg's weighted average."""

from __future__ import annotations

import torch

from .base import ServerOptimizer


class ServerSGD(ServerOptimizer):
    """θ^{[t+1]} = θ^{[t]} + α Δ^{[t]}. With α = 1 the new global model is the ω-weighted average of the clients."""

    default_learning_rate = 1.0  # the weighted mean of the client models

    def __init__(self, learning_rate: float = 1.0):
        super().__init__(learning_rate)

    @classmethod
    def from_config(cls, args):
        return cls(learning_rate=args.server_learning_rate)

    def step_block(self, params, delta):
        keys = list(params)
        new = torch._foreach_add(
            [params[key].float() for key in keys], [delta[key] for key in keys], alpha=self.learning_rate
        )
        return {key: value.to(params[key].dtype) for key, value in zip(keys, new)}
