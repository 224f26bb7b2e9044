"""`ServerFedAdam` ("fedadam"): Adam with ε on the update's own scale (τ from each tensor's first Δ), v started at τ²,
m bias-corrected, as Reddi et al.'s FedAdam takes τ ≫ 1e-8; near FedAvg's step where Δ is typical."""

from __future__ import annotations

import math

import torch

from .base import ServerOptimizer


class ServerFedAdam(ServerOptimizer):
    """Adam with ε on the scale of the clients' update (Reddi et al.'s FedAdam, whose τ is tuned in [1e-5, 1e-1] and
    never 1e-8), per tensor T of the adapter:

        τ_T     = RMS(Δ_T) of the first round whose Δ_T is not zero (or `epsilon`, when given)
        m       = β1 m + (1 − β1) Δ,        m̂ = m / (1 − β1^{t+1})           (Eq. momentum, bias-corrected)
        v       = β2 v + (1 − β2) Δ²,       v^{[-1]} = τ_T²                    (v started at τ², so not corrected)
        θ^{[t+1]} = θ^{[t]} + η m̂ · 2 τ_T / (√v + τ_T)                       (Eq. model_update with α = 2 η τ_T)

    Where |Δ| is about τ (√v ≈ τ) the step is η m̂, FedAvg's step averaged over rounds; a coordinate whose Δ is far
    above the tensor's scale moves at most about 2 η τ, Adam's per-coordinate normalisation; one whose Δ is zero
    does not move beyond its momentum. So the step has the clients' own size, while the paper's literal step moves
    every coordinate by α whatever Δ.
    """

    default_learning_rate = 1.0
    default_epsilon = None  # the RMS of each tensor's first non-zero Δ, as FedAdam's τ
    takes_epsilon = True

    def __init__(self, learning_rate: float = 1.0, beta1: float = 0.9, beta2: float = 0.99,
                 epsilon: float | None = None):
        super().__init__(learning_rate)
        if epsilon is not None and not epsilon > 0:
            raise ValueError(f"FedAdam's τ (`server_epsilon`) must be > 0 or None (derived), got {epsilon}.")
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.tau: dict[str, float] = {}  # τ_T, fixed once set
        self.num_steps = 0

    @classmethod
    def from_config(cls, args):
        return cls(learning_rate=args.server_learning_rate, beta1=args.server_beta1, beta2=args.server_beta2,
                   epsilon=args.server_epsilon)

    def start_step(self):
        self.num_steps += 1

    def step_block(self, params, delta):
        new = {}
        correction = 1 - self.beta1**self.num_steps
        for key, value in params.items():
            d = delta[key]
            if key not in self.tau:
                rms = float(torch.linalg.vector_norm(d)) / math.sqrt(max(d.numel(), 1))
                tau = self.epsilon if self.epsilon is not None else rms
                if not tau > 0:  # nothing to scale by yet: Δ_T is zero, and so is the step
                    new[key] = value.clone()
                    continue
                self.tau[key] = tau
                self.m[key] = torch.zeros_like(d)
                self.v[key] = torch.full_like(d, tau * tau)
            tau, m, v = self.tau[key], self.m[key], self.v[key]
            m.lerp_(d, 1 - self.beta1)
            v.mul_(self.beta2).addcmul_(d, d, value=1 - self.beta2)
            step = (m / correction).mul_(2 * self.learning_rate * tau).div_(v.sqrt().add_(tau))
            new[key] = (value.float() + step).to(value.dtype)
        return new

    def block_state(self, keys):
        return {"m": {key: self.m[key] for key in keys if key in self.m},
                "v": {key: self.v[key] for key in keys if key in self.v}}

    def state_dict(self):
        return {"m": dict(self.m), "v": dict(self.v), "tau": dict(self.tau), "num_steps": self.num_steps}

    def load_state_dict(self, state):
        missing = sorted({"m", "v", "tau", "num_steps"} - set(state))
        if missing:
            raise ValueError(f"Server FedAdam state lacks {missing}: it was not saved by a server FedAdam.")
        self.m = {key: tensor.clone() for key, tensor in state["m"].items()}
        self.v = {key: tensor.clone() for key, tensor in state["v"].items()}
        self.tau = {key: float(value) for key, value in state["tau"].items()}
        self.num_steps = int(state["num_steps"])
