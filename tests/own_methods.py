"""A server optimizer, an aggregation, a robust combiner and a wire format of one's own, in one file: each is a class
and one registration line. Importing this module makes `--server_optimizer half-step`, `--aggregation leader`,
`--robust_aggregation drop_farthest` and `--transfer_dtype float16` choices of `trl-federated run`
(tests/test_registry.py)."""

import torch

from trl_federated.aggregation import (
    Aggregator,
    RobustCombiner,
    ServerOptimizer,
    pseudo_gradient,
    register_aggregation,
    register_robust_aggregation,
    register_server_optimizer,
)
from trl_federated.wire import Cast, register_wire_format


class HalfStep(ServerOptimizer):
    """θ + α · scale · Δ, its `scale` (in (0, 1]) from `server_optimizer_args`."""

    default_learning_rate = 1.0

    def __init__(self, learning_rate: float = 1.0, scale: float = 0.5):
        super().__init__(learning_rate)
        self.scale = scale

    @classmethod
    def from_config(cls, args):
        return cls(args.server_learning_rate, (args.server_optimizer_args or {}).get("scale", 0.5))

    @classmethod
    def config_errors(cls, args):
        scale = (args.server_optimizer_args or {}).get("scale", 0.5)
        if not 0 < scale <= 1:
            yield f"`server_optimizer_args` scale must lie in (0, 1], got {scale}."

    def step_block(self, params, delta):
        return {key: (params[key].float() + self.learning_rate * self.scale * delta[key]).to(params[key].dtype)
                for key in params}


class Leader(Aggregator):
    """The first client by id weighs `leader_weight` (from `aggregation_args`), the others share the rest."""

    def __init__(self, leader_weight: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.leader_weight = leader_weight

    @classmethod
    def from_config(cls, args, num_clients, server_optimizer, combiner=None):
        weight = (args.aggregation_args or {}).get("leader_weight", 0.5)
        return cls(weight, server_optimizer=server_optimizer, combiner=combiner)

    @classmethod
    def config_errors(cls, args):
        weight = (args.aggregation_args or {}).get("leader_weight", 0.5)
        if not 0 < weight < 1:
            yield f"`aggregation_args` leader_weight must lie in (0, 1), got {weight}."

    def client_weights(self, updates, round_idx):
        leader = min(update.client_id for update in updates)
        if len(updates) == 1:
            return [1.0]
        rest = (1 - self.leader_weight) / (len(updates) - 1)
        return [self.leader_weight if update.client_id == leader else rest for update in updates]


class DropFarthest(RobustCombiner):
    """The weighted mean of the clients left after dropping the f = `robust_num_malicious` farthest from the plain
    mean over the whole adapter; it needs f + 1 clients a round (`min_clients`, checked by the config)."""

    name = "drop_farthest"

    def __init__(self, num_malicious: int = 1):
        self.num_malicious = num_malicious
        self.selected: list[int] = []

    @classmethod
    def from_config(cls, args):
        return cls(args.robust_num_malicious)

    @classmethod
    def min_clients(cls, num_malicious):
        return num_malicious + 1

    def prepare(self, global_state, client_states):
        mean = {key: sum(state[key].float() for state in client_states) / len(client_states) for key in global_state}
        distances = [sum(float((state[key].float() - mean[key]).square().sum()) for key in mean)
                     for state in client_states]
        kept = sorted(range(len(client_states)), key=distances.__getitem__)[: len(client_states) - self.num_malicious]
        self.selected = sorted(kept)

    def applied_weights(self, weights):
        """The weights renormalised over the clients kept, 0 for the others: ω as the combination applies it."""
        total = sum(weights[i] for i in self.selected)
        return [weights[i] / total if i in self.selected else 0.0 for i in range(len(weights))]

    def pseudo_gradient(self, global_state, client_states, weights):
        omega = self.applied_weights(weights)
        kept = self.selected
        return pseudo_gradient(global_state, [client_states[i] for i in kept], [omega[i] for i in kept])


register_server_optimizer("half-step", HalfStep)
register_aggregation("leader", Leader)
register_robust_aggregation("drop_farthest", DropFarthest)
register_wire_format("float16", Cast(torch.float16, "float16"))  # the round's change in IEEE half precision

__all__ = ["DropFarthest", "HalfStep", "Leader"]
