"""A server optimizer and an aggregation of one's own, each with a hyperparameter of its own, in one file: each is a
class and one registration line. Importing this module makes `--server_optimizer half-step` and `--aggregation leader`
choices of `trl-federated run` (tests/test_registry.py)."""

from trl_federated.aggregation import Aggregator, ServerOptimizer, register_aggregation, register_server_optimizer


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


register_server_optimizer("half-step", HalfStep)
register_aggregation("leader", Leader)

__all__ = ["HalfStep", "Leader"]
