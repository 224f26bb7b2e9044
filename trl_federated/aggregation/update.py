"""What a client sends (`ClientUpdate`), what a strategy reports and hooks per client (`RoundMetric`,
`ClientHook`), and what every strategy reads off a round's updates: their checks, the data shares, idleness and the
reward signal they carry."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, NamedTuple

import torch

from ..adapters import AdapterState, check_state, state_distance


@dataclass
class ClientUpdate:
    """One client's report at the end of a round (Algorithm 1, line 17).

    Args:
        client_id: Stable name of the client; the server keys its per-client state (RPG baselines, SCAFFOLD's c_i)
            by it.
        state: The client's adapter θ_i^{[t]}, as `peft.get_peft_model_state_dict` returns it.
        num_samples: D_i, the size of the client's training set (FedAvg weights).
        reward: R̄_i^{[t]}, the mean step reward over the client's last W local steps.
        metrics: Anything else worth logging (step rewards, loss, wall time).
        extras: What a strategy with per-client state takes back from the client besides its adapter
            (`Aggregator.check_extras`), by name, each keyed like `state` (SCAFFOLD: Δc_i as "control_delta").
        wire_bytes: What the update took on the wire (see `wire.WireFormat`); None until it was sent.
    """

    client_id: str
    state: dict[str, torch.Tensor]
    num_samples: int
    reward: float
    metrics: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, AdapterState] = field(default_factory=dict)
    wire_bytes: int | None = None


@dataclass(frozen=True)
class RoundMetric:
    """A value an aggregator reports for a round (`Aggregator.round_metrics`), with how to print it. The round record
    keeps it (`RoundRecord.round_metrics`; `record.<name>` reads its value), metrics.jsonl and result.json under
    `name`, the round log (`callbacks.round_logs`) as `<log_name>`, per client `<client_id>/<log_name>`, and the
    console line (`round_log.format_round_log`) and summary.md (`summary.format_round_table`) as
    `<label> = <value>`, the value printed with `format`.

    Args:
        name: Its key in the record, metrics.jsonl and result.json (not one of `RoundRecord`'s own fields).
        label: Its name where it is printed: a symbol such as "τ".
        value: This round's value: a number (None: none this round); with `per_client`, a number per aggregated
            client, by client id.
        per_client: Whether `value` holds one number per client.
        format: The format spec of one value (`format(value, spec)`).
        log_name: Its entry in the round log (default: `name`).
        legend: What it means, in a sentence, for the legend under summary.md's round table (None: none).
    """

    name: str
    label: str
    value: Any = None
    per_client: bool = False
    format: str = ".4g"
    log_name: str | None = None
    legend: str | None = None

    @property
    def log_entry(self) -> str:
        return self.log_name or self.name

    def show(self, value) -> str:
        """`value` (one of this metric's numbers) as printed: "τ = 2.500"."""
        return f"{self.label} = {format(value, self.format)}"

    def spec(self) -> dict[str, Any]:
        """What a record keeps besides the value: how to name and print it."""
        return {"name": self.name, "label": self.label, "per_client": self.per_client, "format": self.format,
                "log_name": self.log_name, "legend": self.legend}


class ClientHook(NamedTuple):
    """A strategy's part of one client round (`Aggregator.client_hook`): `callback`, a `transformers.TrainerCallback`,
    joins the client's trainer; after training, `reply()` gives what the client sends back besides its adapter
    (`ClientUpdate.extras`)."""

    callback: Any
    reply: Callable[[], dict[str, AdapterState]]


def window_stderr(step_rewards, window: int | None) -> float | None:
    """sd / √n of the last `window` (all with None) finite numbers of `step_rewards`; None with fewer than two."""
    values = [float(value) for value in list(step_rewards)[-window if window else 0:] if math.isfinite(value)]
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) >= 2 else None


def report_stderr(update: ClientUpdate, window: int | None, items: int | None,
                  reward_range: tuple[float, float] | None) -> float | None:
    """The standard error of a client's R̄: with `items` (R̄ a greedy mean over that many held-out items,
    `rpg_signal="held-out"`) `held_out_stderr` of R̄ itself in `reward_range`, which under DP reads the released R̃
    only; else that of the last `window` step rewards it sent (`window_stderr`)."""
    if items is not None:
        return held_out_stderr(update.reward, items, reward_range)
    return window_stderr(update.metrics.get("step_rewards", ()), window)


def held_out_stderr(reward: float, items: int, reward_range: tuple[float, float] | None = (0.0, 1.0)) -> float | None:
    """√((M − μ)(μ − m)/n): the standard error of μ, a mean over n items of a reward in [m, M] = `reward_range`
    (`rpg_signal="held-out"`), with μ held to [m, M] (a noised R̃ may lie outside). By the Bhatia-Davis inequality
    (M − μ)(μ − m) bounds the variance of any reward in [m, M] with mean μ, with equality for a reward that takes only
    the values m and M, so it is exact for a binary reward (√(p(1 − p)/n) for accuracy) and an upper bound for one
    that takes values between (accuracy + format). None when the range is not known (a reward model): nothing then
    bounds the variance that R̄ alone could tell."""
    if reward_range is None:
        return None
    low, high = reward_range
    mean = min(max(float(reward), low), high)
    return math.sqrt((high - mean) * (mean - low) / items)


def zero_signal_share(update: ClientUpdate) -> float | None:
    """The share of the client's GRPO groups whose completions all scored alike (TRL's `frac_reward_zero_std`, its
    mean over the local steps), which carry no advantage and so no policy gradient; None when not sent or outside
    [0, 1]."""
    value = update.metrics.get("frac_reward_zero_std")
    return float(value) if isinstance(value, Real) and 0 <= value <= 1 else None


# An update shorter than this share of U = E·η·√d (`admission.update_norm_unit`, the scale honest updates reach:
# 0.3-0.6 U measured) is idle: a client that moves its adapter by 1e-6 U to escape the rule gains nothing by it.
IDLE_UPDATE_SHARE = 1e-3


def is_idle(update: ClientUpdate, global_state: AdapterState, idle_norm: float = 0.0) -> bool:
    """Whether a client had no learning signal this round: its update is no longer than `idle_norm` (the server's
    IDLE_UPDATE_SHARE · U; with 0, its adapter came back exactly as sent: the wire carries θ_i − θ, so an unchanged
    adapter decodes to θ bit for bit), or every GRPO group of every local step scored alike (`zero_signal_share` 1)."""
    if zero_signal_share(update) == 1.0:
        return True
    if idle_norm > 0:
        return state_distance(update.state, global_state) <= idle_norm
    return all(torch.equal(update.state[key], value) for key, value in global_state.items())


def data_shares(updates: list[ClientUpdate]) -> list[float]:
    """p_i = D_i / Σ D_i over the reporting clients: FedAvg's weights; equal shares when a count is not a positive
    integer (a strategy that does not weigh by data leaves `num_samples` unchecked)."""
    sizes = [update.num_samples for update in updates]
    if not all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in sizes):
        return [1 / len(updates)] * len(updates)
    total = sum(sizes)
    return [size / total for size in sizes]


def cap_idle_weights(weights: list[float], shares: list[float], idle: list[bool]) -> list[float]:
    """ω_i held at most at p_i for every idle client (no learning signal: its θ_i − θ is zero, or carries no reward
    signal), the weight cut from it given to the clients that learned in proportion to their own weights. An idle
    client's zero update only shrinks Δ by its weight: a strategy that weighs by reward (RPG) could hand it most of
    the round on a lucky R̄, while FedAvg gives it its data share, which this leaves as it is. Unchanged when no client
    is idle, when all are (Δ is zero either way), or when the others have no weight to scale."""
    capped = [min(weight, share) if flag else weight for weight, share, flag in zip(weights, shares, idle)]
    excess = math.fsum(weights) - math.fsum(capped)
    active = math.fsum(weight for weight, flag in zip(capped, idle) if not flag)
    if not excess > 0 or not active > 0:
        return weights
    return [weight if flag else weight * (1 + excess / active) for weight, flag in zip(capped, idle)]


def refuse_extras(update: ClientUpdate) -> None:
    """`ValueError` if `update` carries extras: what a strategy without per-client state takes back from a client."""
    if update.extras:
        raise ValueError(
            f"it sends {sorted(map(str, update.extras))[:3]}, but the aggregation takes nothing but the adapter"
        )


def check_updates(
    global_state: dict[str, torch.Tensor], updates: list[ClientUpdate], check_finite: bool = True
) -> None:
    """Raise `ValueError`, naming the client and the fault, unless `updates` can be combined over `global_state`:
    at least one, distinct string client ids, and adapters with exactly the global adapter's keys and shapes,
    floating-point values, all finite (unless `check_finite=False`)."""
    if not updates:
        raise ValueError("aggregate() needs at least one client update.")
    seen = set()
    for update in updates:
        if not isinstance(update, ClientUpdate) or not isinstance(update.client_id, str):
            raise ValueError(f"aggregate() takes ClientUpdates with a string client_id, got {update!r:.200}.")
        if update.client_id in seen:
            raise ValueError(f"Client {update.client_id!r} has two updates in one aggregation.")
        seen.add(update.client_id)
        check_state(update.state, global_state, f"client {update.client_id!r}'s adapter", check_finite)


def check_number(value: Any, name: str, positive_int: bool = False) -> None:
    """Raise `ValueError` unless `value` is a finite real number (a positive int with `positive_int`)."""
    if positive_int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r:.100}.")
    elif isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r:.100}.")
