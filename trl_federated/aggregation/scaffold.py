"""SCAFFOLD's server (Karimireddy et al., ICML 2020, Algorithm 1 lines 16-17) over LoRA adapters."""

from __future__ import annotations

from typing import Any

import torch

from .base import AggregationError, ClientUpdate, check_state, non_finite_entries
from .fedavg import FedAvgAggregator
from .server_optim import ServerOptimizer


class ScaffoldAggregator(FedAvgAggregator):
    """FedAvg on the adapters plus a server control variate c:

        θ^{[t+1]} = θ^{[t]} + η_g Σ_i ω_i (θ_i − θ^{[t]})     (ω_i = D_i / ΣD, as the paper's baselines weigh)
        c^{[t+1]} = c^{[t]} + (1 / N) Σ_{i reported} Δc_i

    with N the number of clients in the federation (SCAFFOLD's |S|/N scaling under partial participation). The
    clients' own control variates c_i stay with the clients (see `local_trainer.ScaffoldCorrection`); each update
    carries its Δc_i in `ClientUpdate.control_delta`.
    """

    def __init__(self, num_clients: int, server_optimizer: ServerOptimizer | None = None, combiner=None):
        super().__init__(server_optimizer, combiner)
        if num_clients < 1:
            raise ValueError(f"`num_clients` must be >= 1, got {num_clients}.")
        self.num_clients = num_clients
        self.control: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, args, num_clients, server_optimizer, combiner=None) -> ScaffoldAggregator:
        """SCAFFOLD for a federation of `num_clients`, whose server step scales the controls by 1/N."""
        return cls(num_clients=num_clients, server_optimizer=server_optimizer, combiner=combiner)

    def server_control(self, global_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """c, created as zeros shaped like the adapter on first use."""
        if not self.control:
            self.control = {key: torch.zeros_like(value, dtype=torch.float32) for key, value in global_state.items()}
        return self.control

    def check_updates(self, global_state, updates: list[ClientUpdate], check_finite: bool = True) -> None:
        super().check_updates(global_state, updates, check_finite)
        missing = [update.client_id for update in updates if update.control_delta is None]
        if missing:
            raise ValueError(f"SCAFFOLD updates need `control_delta`; missing for clients {missing}.")
        for update in updates:
            name = f"SCAFFOLD: client {update.client_id!r}'s control_delta"
            check_state(update.control_delta, global_state, name, check_finite)

    def aggregate(self, global_state, updates: list[ClientUpdate], round_idx: int, check_finite: bool = True):
        new_state = super().aggregate(global_state, updates, round_idx, check_finite)
        control = self.server_control(global_state)
        keys = list(control)
        for update in updates:  # one fused in-place pass per client, promoting bfloat16 deltas on the fly
            deltas = [update.control_delta[key] for key in keys]
            torch._foreach_add_([control[key] for key in keys], deltas, alpha=1.0 / self.num_clients)
        if non_finite := non_finite_entries(control, "server control"):
            raise AggregationError(f"Round {round_idx}: SCAFFOLD's {non_finite[0]} is not finite; the round is refused.")
        return new_state

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "control": dict(self.control)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.control = {key: tensor.clone() for key, tensor in state["control"].items()}
