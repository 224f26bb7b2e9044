"""`RoundRecord`: what happened in one round, as the server records it, the checkpoints keep it and the reports,
logs and callbacks read it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..adapters import state_nbytes
from ..aggregation.update import RoundMetric


@dataclass
class RoundRecord:
    """What happened in one round; `FederatedRunner.run()` returns one per round.

    `sampled` lists the indices of the clients the round trained (`sampling.sample_clients`; the order of the runner's
    `client_datasets`, a SuperNode's `partition-id`); None only in a record built by hand. Per-client dicts are
    keyed by client id and hold only the clients whose updates were aggregated this round; `dropped` holds the
    others (a client that raised, timed out or sent an invalid update) with the reason. A client that was not
    sampled sat the round out; a sampled one with neither weight nor drop had no SuperNode connected (Flower). A
    client's `client_metrics` hold the means over its local steps of TRL's step metrics, `frac_reward_zero_std`
    among them: the fraction of its GRPO groups whose K rewards were all equal, which carry no learning signal.

    `round_metrics` are what the aggregator reports about the round besides ω (`Aggregator.round_metrics`: RPG's
    gains h and temperature τ), each readable as `record.<name>` (`record.gains`, `record.temperature`).
    """

    round_idx: int
    sampled: list[int] | None = None
    rewards: dict[str, float] = field(default_factory=dict)  # R̄_i^{[t]}
    weights: dict[str, float] = field(default_factory=dict)  # ω_i^{[t]}
    num_samples: dict[str, int] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)  # global adapter sent to the client
    bytes_sent: dict[str, int] = field(default_factory=dict)  # client update sent to the server
    client_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    update_norms: dict[str, float] = field(default_factory=dict)  # ‖θ_i − θ^{[t]}‖
    update_cosines: dict[str, float | None] = field(default_factory=dict)  # cos(θ_i − θ^{[t]}, Δ)
    delta_norm: float | None = None  # ‖Δ‖, the clients' weighted mean change
    server_step_norm: float | None = None  # ‖θ^{[t+1]} − θ^{[t]}‖
    server_step_ratio: float | None = None  # ‖θ^{[t+1]} − θ^{[t]}‖ / ‖Δ‖
    server_step_cosine: float | None = None  # cos(s, Δ), s = θ^{[t+1]} − θ^{[t]}
    server_step_momentum_cosine: float | None = None  # cos(s, s^{[t-1]})
    server_step_norm_a: float | None = None  # ‖s‖ over the LoRA A factors
    server_step_norm_b: float | None = None  # ‖s‖ over the LoRA B factors
    dropped: dict[str, str] = field(default_factory=dict)
    evaluation: dict[str, Any] | None = None
    wall_time: float = 0.0
    round_metrics: list[RoundMetric] = field(default_factory=list)  # the aggregator's own (`RoundMetric`)

    def __getattr__(self, name: str):
        # Only for names that are no attribute: the aggregator's metrics, by name (`record.gains`).
        for metric in self.__dict__.get("round_metrics", ()):
            if metric.name == name:
                return metric.value
        raise AttributeError(f"{type(self).__name__!r} has no attribute or round metric {name!r}")

    def metric_values(self) -> dict[str, Any]:
        """The aggregator's metrics of the round, by name."""
        return {metric.name: metric.value for metric in self.round_metrics}

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready values (metrics.jsonl, checkpoints): its fields, each round metric's value under
        its name, and under "round_metrics" how to print them (`RoundMetric.spec`)."""
        data = asdict(self)
        del data["round_metrics"]
        data.update(self.metric_values())
        data["round_metrics"] = [metric.spec() for metric in self.round_metrics]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoundRecord:
        """The record `to_dict` wrote; `ValueError` for a record of another layout."""
        data = dict(data)
        if "round_metrics" not in data:
            raise ValueError("a round record without `round_metrics`, written before aggregators reported their own")
        specs = data.pop("round_metrics")
        metrics = [RoundMetric(**spec, value=data.pop(spec["name"], None)) for spec in specs]
        return cls(**data, round_metrics=metrics)

    @classmethod
    def from_aggregation(
        cls,
        round_idx: int,
        aggregator,
        updates: list,
        dropped: dict[str, str],
        bytes_received: dict[str, int],
        sampled: list[int],
    ) -> RoundRecord:
        """The record of round `round_idx` right after `aggregator` aggregated `updates` (`ClientUpdate`s) of the
        `sampled` clients; `bytes_received` is what each of their clients received. The aggregator's own metrics are
        its `round_metrics()`; the geometry of the step is its `last_step` (`ServerStep`)."""
        step = aggregator.last_step
        metrics = list(aggregator.round_metrics())
        if clashes := {metric.name for metric in metrics} & {f.name for f in fields(cls)}:
            raise ValueError(f"{type(aggregator).__name__}.round_metrics() names {sorted(clashes)}, fields of the "
                             "round record: give them other names.")
        return cls(
            round_idx=round_idx,
            sampled=list(sampled),
            rewards={update.client_id: update.reward for update in updates},
            weights=dict(aggregator.last_weights),
            num_samples={update.client_id: update.num_samples for update in updates},
            bytes_received=dict(bytes_received),
            bytes_sent={update.client_id: update.wire_bytes or state_nbytes(update.state) for update in updates},
            client_metrics={update.client_id: update.metrics for update in updates},
            update_norms=dict(step.update_norms),
            update_cosines=dict(step.cosines),
            delta_norm=step.delta_norm,
            server_step_norm=step.step_norm,
            server_step_ratio=step.ratio,
            server_step_cosine=step.step_delta_cosine,
            server_step_momentum_cosine=step.step_previous_cosine,
            server_step_norm_a=step.step_norm_a,
            server_step_norm_b=step.step_norm_b,
            dropped=dropped,
            round_metrics=metrics,
        )
