"""What a client sends, and what every aggregation strategy shares: Δ = Σ_i ω_i (θ_i − θ), Eq. (model_diff)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from .blocks import blocks
from .server_optim import ServerOptimizer, ServerSGD


@dataclass
class ClientUpdate:
    """One client's report at the end of a round (Algorithm 1, line 17).

    Args:
        client_id: Stable name of the client; the server keys its per-client state (RPG baselines) by it.
        state: The client's adapter θ_i^{[t]}, as `peft.get_peft_model_state_dict` returns it.
        num_samples: D_i, the size of the client's training set (FedAvg weights).
        reward: R̄_i^{[t]}, the mean step reward over the client's last W local steps.
        metrics: Anything else worth logging (step rewards, loss, wall time).
        control_delta: SCAFFOLD only: Δc_i, the change of the client's control variate, keyed like `state`.
        wire_bytes: What the update took on the wire (see `transport.WireFormat`); None until it was sent.
    """

    client_id: str
    state: dict[str, torch.Tensor]
    num_samples: int
    reward: float
    metrics: dict[str, Any] = field(default_factory=dict)
    control_delta: dict[str, torch.Tensor] | None = None
    wire_bytes: int | None = None


class Aggregator(ABC):
    """Turns the global adapter and the clients' updates into the next global adapter.

    A strategy only decides the client weights ω (`client_weights`); the pseudo-gradient
    Δ^{[t]} = Σ_i ω_i (θ_i^{[t]} − θ^{[t]}) (Eq. model_diff) and the server step are shared, so FedAvg, FGRPO and
    the paper's "w/o RPG" ablation differ in exactly one place. Everything a strategy keeps between rounds is
    returned by `state_dict()` and restored by `load_state_dict()`.
    """

    def __init__(self, server_optimizer: ServerOptimizer | None = None):
        self.server_optimizer = server_optimizer if server_optimizer is not None else ServerSGD(learning_rate=1.0)
        self.last_weights: dict[str, float] = {}

    @abstractmethod
    def client_weights(self, updates: list[ClientUpdate], round_idx: int) -> list[float]:
        """Aggregation weights ω_i of the clients that reported this round, in their order; they sum to 1."""

    def aggregate(
        self, global_state: dict[str, torch.Tensor], updates: list[ClientUpdate], round_idx: int
    ) -> dict[str, torch.Tensor]:
        """θ^{[t+1]} from θ^{[t]} and the clients that reported in round `round_idx` (0-based)."""
        if not updates:
            raise ValueError("aggregate() needs at least one client update.")
        weights = self.client_weights(updates, round_idx)
        self.last_weights = {update.client_id: weight for update, weight in zip(updates, weights)}
        # Δ is computed and applied one cache-sized block at a time (see `blocks`): the block of Δ is still in
        # cache when the server optimizer reads it, and the only full-size buffer is the new adapter.
        client_states = [update.state for update in updates]
        self.server_optimizer.start_step()
        new_state = {}
        for keys in blocks(global_state):
            block = {key: global_state[key] for key in keys}
            new_state.update(self.server_optimizer.step_block(block, pseudo_gradient(block, client_states, weights)))
        return new_state

    def state_dict(self) -> dict[str, Any]:
        return {"server_optimizer": self.server_optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server_optimizer.load_state_dict(state["server_optimizer"])


def pseudo_gradient(
    global_state: dict[str, torch.Tensor], client_states: list[dict[str, torch.Tensor]], weights: list[float]
) -> dict[str, torch.Tensor]:
    """Δ = Σ_i ω_i (θ_i − θ) in float32, over the keys of `global_state` (the whole adapter or a block of it),
    computed as −θ + Σ_i ω_i θ_i (the weights sum to 1).

    One fused in-place addition per client (`torch._foreach_add_`, as torch's own optimizers do) into the one new
    buffer; client tensors in another dtype (bfloat16 transfers) are promoted inside the addition rather than
    copied to float32 first.
    """
    keys = list(global_state)
    delta = torch._foreach_mul([global_state[key].float() for key in keys], -1.0)
    for state, weight in zip(client_states, weights):
        torch._foreach_add_(delta, [state[key] for key in keys], alpha=float(weight))
    return dict(zip(keys, delta))
