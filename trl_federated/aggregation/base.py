"""What every aggregation strategy shares (`Aggregator`): Δ = Σ_i ω_i (θ_i − θ), Eq. (model_diff), the server step's
geometry, and the hooks of a strategy that keeps state per client. What a client sends is `update`."""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..adapters import AdapterState, non_finite_entries, state_norm, tensor_norm
from .blocks import blocks
from .server_optim import ServerOptimizer, ServerSGD
from .update import (
    ClientHook,
    ClientUpdate,
    RoundMetric,
    cap_idle_weights,
    check_updates,
    data_shares,
    is_idle,
    refuse_extras,
    report_stderr,
    zero_signal_share,
)

if TYPE_CHECKING:
    from ..config import FedGRPOConfig

logger = logging.getLogger(__name__)


@dataclass
class ServerStep:
    """The geometry of one aggregation: ‖Δ‖, the size of the server's step s = θ^{[t+1]} − θ^{[t]}, and each
    client's update u_i = θ_i − θ^{[t]} against Δ (its norm and cos(u_i, Δ)), by client id; cos(s, Δ), whether the
    server moved where the clients did; cos(s, s^{[t-1]}), how far momentum lines successive steps up (None in a
    first round, or the first after a resume); and ‖s‖ split into the LoRA A and B factors (`step_norm_a`,
    `step_norm_b`; the two differ in scale, B starting at zero). A norm of 0 leaves a cosine and the ratio undefined
    (None)."""

    delta_norm: float
    step_norm: float
    update_norms: dict[str, float]
    cosines: dict[str, float | None]
    step_delta_cosine: float | None = None
    step_previous_cosine: float | None = None
    step_norm_a: float = 0.0
    step_norm_b: float = 0.0

    @property
    def ratio(self) -> float | None:
        """‖server step‖ / ‖Δ‖: 1 for FedAvg's step (SGD, learning rate 1); server Adam's first step is α per
        coordinate whatever Δ, so its ratio says how far it amplifies (or damps) the clients' mean change."""
        return self.step_norm / self.delta_norm if self.delta_norm > 0 else None


def _cosine(dot: float, norm: float, other_norm: float) -> float | None:
    return dot / (norm * other_norm) if norm > 0 and other_norm > 0 else None


class _StepGeometry:
    """Accumulates `ServerStep` one block of the adapter at a time (`Aggregator.aggregate`), while the block is in
    cache: per tensor in float32, as the aggregation computes, summed in float64. Each client's update θ_i − θ is
    formed tensor by tensor in one reused buffer: a fresh one per tensor would cost a page fault per page, several
    times the arithmetic. The server step of each tensor is kept (`steps`) for the next round's cos(s, s^{[t-1]})."""

    def __init__(self, num_clients: int, global_state: AdapterState, previous: ServerStep | None,
                 previous_steps: AdapterState | None):
        self.delta_sq = self.step_sq = self.step_delta_dot = self.step_previous_dot = 0.0
        self.factor_sq = {"lora_A": 0.0, "lora_B": 0.0}
        self.update_sq = [0.0] * num_clients
        self.dots = [0.0] * num_clients
        self.buffer = torch.empty(max((value.numel() for value in global_state.values()), default=0))
        # The last round's step, tensor by tensor, and its norm, which that round measured already
        self.previous_steps = previous_steps if previous is not None else None
        self.previous_norm = previous.step_norm if previous is not None else 0.0
        self.steps: AdapterState = {}

    def add(self, block: AdapterState, client_states: list[AdapterState], delta: AdapterState, new: AdapterState):
        self.delta_sq += state_norm(delta) ** 2
        for key, value in block.items():
            step = new[key].float() - value.float()
            self.steps[key] = step
            step_sq = tensor_norm(step) ** 2
            self.step_sq += step_sq
            self.step_delta_dot += torch.dot(step.view(-1), delta[key].view(-1)).item()
            factor = next((name for name in self.factor_sq if f".{name}." in f".{key}."), None)
            if factor is not None:
                self.factor_sq[factor] += step_sq
            if self.previous_steps is not None:
                self.step_previous_dot += torch.dot(step.view(-1), self.previous_steps[key].view(-1)).item()
        for index, state in enumerate(client_states):
            for key, value in block.items():
                update = self.buffer[: value.numel()]
                torch.sub(state[key].view(-1), value.view(-1), out=update)
                self.update_sq[index] += tensor_norm(update) ** 2
                self.dots[index] += torch.dot(update, delta[key].view(-1)).item()

    def result(self, client_ids: list[str]) -> ServerStep:
        delta_norm, step_norm = math.sqrt(self.delta_sq), math.sqrt(self.step_sq)
        norms = [math.sqrt(value) for value in self.update_sq]
        cosines = [_cosine(dot, norm, delta_norm) for dot, norm in zip(self.dots, norms)]
        previous = (None if self.previous_steps is None
                    else _cosine(self.step_previous_dot, step_norm, self.previous_norm))
        return ServerStep(
            delta_norm, step_norm, dict(zip(client_ids, norms)), dict(zip(client_ids, cosines)),
            step_delta_cosine=_cosine(self.step_delta_dot, step_norm, delta_norm), step_previous_cosine=previous,
            step_norm_a=math.sqrt(self.factor_sq["lora_A"]), step_norm_b=math.sqrt(self.factor_sq["lora_B"]),
        )


class AggregationError(ArithmeticError):
    """The aggregation produced a non-finite global adapter, server optimizer state or client weights. The round's
    result is refused; the aggregator's state is then no longer that of a finished round: restore it from the last
    checkpoint (the runner and the Flower strategy stop the run, their last checkpoint intact)."""


class Aggregator(ABC):
    """Turns the global adapter and the clients' updates into the next global adapter.

    A strategy only decides the client weights ω (`client_weights`); the pseudo-gradient
    Δ^{[t]} = Σ_i ω_i (θ_i^{[t]} − θ^{[t]}) (Eq. model_diff) and the server step are shared, so FedAvg, FGRPO and
    the paper's "w/o RPG" ablation differ in exactly one place. Everything a strategy keeps between rounds, its
    per-client state included, is returned by `state_dict()` and restored by `load_state_dict()`.

    A strategy that keeps state per client (SCAFFOLD's c_i) exchanges "extras" with each client besides the adapter,
    named adapter-shaped states: `client_extras` is what the server sends a client, `client_hook` what the client
    trains with them and sends back, `check_extras` how the admission gate checks and bounds that reply (and the
    per-client state it would commit), `correction` how the extras sent move the client's adapter, and
    `accept` commits an admitted update's per-client state. By default a strategy exchanges nothing else.

    `round_metrics` is what a strategy reports about each aggregation besides ω (RPG: its gains h and temperature τ):
    the round record, the round log, the reports and result.json show whatever it returns.

    `combiner` (see `robust`) replaces the weighted mean in Δ by a coordinate-wise trimmed mean or median.
    `privacy` (`privacy.ClientLevelPrivacy`, which the server sets under `dp_noise_multiplier`) clips each update,
    releases R̄ through its own mechanism to a strategy that `weighs_by_reward`, and noises Δ before the server step.
    `aggregate` checks its own inputs (`check_updates`: distinct client ids, the global adapter's keys and shapes,
    finite floating-point values; each strategy checks the fields it weighs by) before it changes any state, and
    its result (`AggregationError`), whoever calls it.
    """

    # Whether `client_weights` reads the clients' R̄, which differential privacy then releases through its own
    # mechanism (`privacy.ClientLevelPrivacy.released_rewards`).
    weighs_by_reward = False
    # ‖θ_i − θ‖ at or below which an update is idle (`is_idle`): the server sets IDLE_UPDATE_SHARE · U; 0 (an adapter
    # back bit for bit) for an aggregator used without one.
    idle_norm = 0.0

    def __init__(self, server_optimizer: ServerOptimizer | None = None, combiner=None):
        self.server_optimizer = server_optimizer if server_optimizer is not None else ServerSGD(learning_rate=1.0)
        self.combiner = combiner  # None: the weighted mean of Eq. model_diff
        self.privacy = None  # a `privacy.ClientLevelPrivacy` under differential privacy
        self.record_privacy = None  # a `privacy.RecordPrivacyReports` under record-level DP
        # W, the local steps R̄ averages (`reward_window`; None: all the step rewards sent), or n, the held-out items
        # R̄ is a greedy mean of (`rpg_signal_items` under `rpg_signal: held-out`; None: R̄ is the window's), both set
        # by `aggregator_from_config`; [m, M], the rewards' range, which bounds a held-out R̄'s variance, by the server
        self.reward_window: int | None = None
        self.signal_items: int | None = None
        self.reward_range: tuple[float, float] | None = (0.0, 1.0)  # None: not known
        self.last_weights: dict[str, float] = {}
        self.last_reward_stderr: dict[str, float | None] = {}
        self.last_zero_signal: dict[str, float | None] = {}
        self.last_idle: dict[str, bool] = {}
        # Under a combiner that selects whole clients (Krum, Multi-Krum, Bulyan): 1 for each client it kept, else 0
        self.last_selected: dict[str, int] = {}
        self.last_step: ServerStep | None = None  # the geometry of the last aggregation
        self.last_server_steps: AdapterState | None = None  # its θ^{[t+1]} − θ^{[t]}, for the next cos(s, s^{[t-1]})

    @classmethod
    def from_config(
        cls, args: FedGRPOConfig, num_clients: int, server_optimizer: ServerOptimizer, combiner=None
    ) -> Aggregator:
        """The aggregator a `FedGRPOConfig` describes for a federation of `num_clients`, around the server optimizer
        and combiner built from it (`aggregation.aggregator_from_config`); a strategy with settings of its own reads
        its fields here."""
        return cls(server_optimizer=server_optimizer, combiner=combiner)

    @classmethod
    def config_errors(cls, args: FedGRPOConfig) -> Iterable[str]:
        """One message per field of `args` this aggregation reads that is out of its range (the config raises the
        first): an aggregation with hyperparameters of its own (`aggregation_args`) checks them here."""
        return ()

    @abstractmethod
    def client_weights(self, updates: list[ClientUpdate], round_idx: int) -> list[float]:
        """Aggregation weights ω_i of the clients that reported this round, in their order; they sum to 1."""

    def aggregate(
        self,
        global_state: dict[str, torch.Tensor],
        updates: list[ClientUpdate],
        round_idx: int,
        check_finite: bool = True,
    ) -> dict[str, torch.Tensor]:
        """θ^{[t+1]} from θ^{[t]} and the clients that reported in round `round_idx` (0-based); `ValueError`, with
        no state changed, for updates that cannot be aggregated; `AggregationError` for a non-finite result.

        `last_weights` and `last_step` (`ServerStep`: ‖Δ‖, the server step's size, each client's update norm and
        its cosine with Δ) describe the aggregation after it.

        `check_finite=False` skips the one pass over every client's values that finds NaN and Inf (as
        `scipy.linalg` offers), for a caller that checked them already: the runner and the Flower strategy admit
        only updates `admission.UpdateGate` checked. Everything else is checked either way.
        """
        self.check_updates(global_state, updates, check_finite)
        privacy = self.privacy
        weights = self.client_weights(updates if privacy is None else privacy.released_rewards(updates, round_idx),
                                      round_idx)
        if len(weights) != len(updates) or not all(math.isfinite(w) and w >= 0 for w in weights) or not math.isclose(
            sum(weights), 1.0, rel_tol=1e-6
        ):
            raise AggregationError(f"Round {round_idx}: client weights {weights} are not finite, non-negative and "
                                   "summing to 1; the round is refused.")
        ids = [update.client_id for update in updates]
        self.last_reward_stderr = {update.client_id: self.reward_stderr(update) for update in updates}
        self.last_zero_signal = {update.client_id: zero_signal_share(update) for update in updates}
        # Under DP the weights follow released values only: which client was idle is read from its raw update.
        self.last_idle = dict.fromkeys(ids, False) if privacy is not None else {
            update.client_id: is_idle(update, global_state, self.idle_norm) for update in updates
        }
        weights = cap_idle_weights(weights, data_shares(updates), [self.last_idle[key] for key in ids])
        # Δ is computed and applied one cache-sized block at a time (see `blocks`): the block of Δ is still in
        # cache when the server optimizer reads it, and the only full-size buffer is the new adapter.
        client_states = [update.state for update in updates]
        combine = pseudo_gradient if self.combiner is None else self.combiner.pseudo_gradient
        # A robust combiner averages what it keeps with equal weights, never the method's: RPG's follow each client's
        # own R̄ (and FedAvg's its claimed rows), and a liar within the allowed range would take most of the average.
        combine_weights = weights if self.combiner is None else [1 / len(updates)] * len(updates)
        applied = combine_weights
        if hasattr(self.combiner, "prepare"):  # a combiner that selects whole clients, over every entry (Krum)
            self.combiner.prepare(global_state, client_states)
            self.last_selected = {key: int(index in self.combiner.selected) for index, key in enumerate(ids)}
            if hasattr(self.combiner, "applied_weights"):  # the weights it combines the clients it kept with
                applied = self.combiner.applied_weights(combine_weights)
        # ω as the combination applied it (Krum's: renormalised over the clients kept, 0 for the others)
        self.last_weights = dict(zip(ids, applied))
        if privacy is not None:
            client_states = privacy.clipped(global_state, client_states)
            noise_std = privacy.noise_std(weights)
        self.server_optimizer.start_step()
        geometry = _StepGeometry(len(updates), global_state, self.last_step, self.last_server_steps)
        new_state = {}
        for keys in blocks(global_state):
            block = {key: global_state[key] for key in keys}
            delta = combine(block, client_states, combine_weights)
            if privacy is not None:  # Δ̃ = Δ + N(0, (σ S)²): the server step is post-processing of it
                privacy.add_noise(delta, noise_std, round_idx)
            new_block = self.server_optimizer.step_block(block, delta)
            # Checked while the block is in cache: the new adapter and the optimizer state it moved.
            non_finite = non_finite_entries(new_block, "global adapter") + non_finite_entries(
                self.server_optimizer.block_state(keys), "server optimizer"
            )
            if non_finite:
                raise AggregationError(
                    f"Round {round_idx}: the aggregation produced non-finite values in {', '.join(non_finite[:3])}; "
                    "the round is refused."
                )
            geometry.add(block, client_states, delta, new_block)
            new_state.update(new_block)
        self.last_step = geometry.result([update.client_id for update in updates])
        self.last_server_steps = geometry.steps
        if privacy is not None:
            privacy.compose_round(noise_std, round_idx)
        if self.record_privacy is not None:
            self.record_privacy.observe(updates)
        return new_state

    def check_updates(
        self, global_state: dict[str, torch.Tensor], updates: list[ClientUpdate], check_finite: bool = True
    ) -> None:
        """`ValueError` unless `updates` can be aggregated (see the function `check_updates`); a strategy extends
        it with the fields it needs beyond the weights (which `client_weights` checks)."""
        check_updates(global_state, updates, check_finite)

    def round_metrics(self) -> list[RoundMetric]:
        """What this strategy reports about its last aggregation besides ω and the step's geometry, each with how to
        print it (`RoundMetric`): the round record, the round log, summary.md and result.json show them, and a
        client metric never takes one of their log names. The same metrics, in the same order, whether or not a
        round has been aggregated yet (then without values). Every strategy reports each client's standard error
        of R̄ (`reward_stderr`), its share of zero-signal groups (`zero_signal_share`) and whether it was idle
        (`idle`, 1: its weight held at its data share, `cap_idle_weights`); under differential privacy its ε, noise
        and released R̄ (`privacy.ClientLevelPrivacy.round_metrics`), under record-level DP the worst ε a client
        reported (`privacy.RecordPrivacyReports`); RPG reports its gains h and τ first."""
        diagnostics = [
            RoundMetric("reward_stderr", "se(R̄)", dict(self.last_reward_stderr), per_client=True, format=".4f",
                        legend="the standard error of the client's R̄: its step rewards' spread over the root of "
                        "their number, or sqrt(p(1 - p)/n) on n held-out items (`reward_stderr`; '-' with < 2 steps)"),
            RoundMetric("zero_signal_share", "zero-signal", dict(self.last_zero_signal), per_client=True,
                        format=".2f", legend="the share of the client's GRPO groups whose completions all scored "
                        "alike, which carry no gradient (`zero_signal_share`)"),
            RoundMetric("idle", "idle", {key: int(value) for key, value in self.last_idle.items()}, per_client=True,
                        format="d", legend="1: the client had no learning signal (an unchanged adapter, or every "
                        "group scored alike), its ω held at its data share (`idle`)"),
        ]
        if hasattr(self.combiner, "prepare"):
            name = self.combiner.name
            diagnostics.append(RoundMetric(
                "robust_selected", f"kept by {name}", dict(self.last_selected), per_client=True, format="d",
                legend=f"1: the robust combiner `{name}` (`robust_aggregation`) kept the client's adapter in the "
                "round's combination, 0: it left it out (`robust_selected`)",
            ))
        for mechanism in (self.privacy, self.record_privacy):
            if mechanism is not None:
                diagnostics += mechanism.round_metrics()
        return diagnostics

    def reward_stderr(self, update: ClientUpdate) -> float | None:
        """The standard error of the client's R̄ (`update.report_stderr`, None where it cannot be known): of its last
        `reward_window` step rewards, or of R̄ measured on `signal_items` held-out items in `reward_range`."""
        return report_stderr(update, self.reward_window, self.signal_items, self.reward_range)

    # Per-client state ----------------------------------------------------------------------------------------

    def client_extras(self, client_id: str, global_state: AdapterState) -> dict[str, AdapterState]:
        """What the server sends `client_id` this round besides the global adapter (SCAFFOLD: c and its c_i)."""
        return {}

    def check_extras(
        self,
        update: ClientUpdate,
        global_state: AdapterState,
        norm_bound: float | None = None,
        norm_action: str = "reject",
    ) -> None:
        """`ValueError` unless `update.extras`, what the client sent back besides its adapter, is what this strategy
        takes: their names, the global adapter's keys and shapes, finite floating-point values; `norm_bound`
        (`update_norm_bound`, in the strategy's own unit; None: no bound) bounds their size, and an extra over it is
        refused or, with `norm_action="clip"`, scaled back onto it. The admission gate calls it on every reply."""
        refuse_extras(update)

    def correction_norm(self, client_id: str, global_state: AdapterState) -> float:
        """The norm of the change per unit of learning rate that the extras the server sends `client_id` make each of
        its local steps add (SCAFFOLD's decoupled correction c − c_i; 0 for a strategy without extras): the norm of
        `correction`, which the admission gate takes off the update before bounding it."""
        return 0.0

    def correction(self, client_id: str, global_state: AdapterState) -> AdapterState | None:
        """The change per unit of learning rate that the extras the server sends `client_id` make each of its local
        steps add, as tensors (SCAFFOLD's decoupled correction, applied as θ ← θ − η (c − c_i): this returns c − c_i);
        None for a strategy without extras. The admission gate bounds the update less what the server prescribed,
        ‖(θ_i − θ) + E · η · (c − c_i)‖, by `update_norm_bound`: the prescribed part is the server's doing, and the
        rest is bounded like any other method's update, whatever controls the client has built up."""
        return None

    def forget(self, client_id: str) -> None:
        """A client the admission gate refused this round: per-client state that acts on the other clients (SCAFFOLD's
        c_i in c) stops acting; a strategy without such state keeps what it has."""

    def accept(self, update: ClientUpdate) -> None:
        """Commit the per-client state of an admitted update that joins the round (SCAFFOLD: c_i ← c_i + Δc_i); an
        update that is dropped never reaches it."""

    @classmethod
    def client_hook(cls, extras: dict[str, AdapterState], args) -> ClientHook | None:
        """On the client: how a local round trains with the `extras` the server sent (`client_extras`) and what it
        sends back (`ClientHook`); `args` is the client's `FedGRPOConfig`. None when there is nothing to exchange."""
        if extras:
            raise ValueError(
                f"The server sends {sorted(extras)[:3]}, which the aggregation {cls.__name__} does not take: give the "
                "client the server's `aggregation`."
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        state = {"server_optimizer": self.server_optimizer.state_dict()}
        if self.privacy is not None:  # the noise seed and the accountant's ledger
            state["privacy"] = self.privacy.state_dict()
        if self.record_privacy is not None:
            state["record_privacy"] = self.record_privacy.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server_optimizer.load_state_dict(state["server_optimizer"])
        if self.privacy is not None:
            self.privacy.load_state_dict(state["privacy"])
        if self.record_privacy is not None and "record_privacy" in state:
            self.record_privacy.load_state_dict(state["record_privacy"])


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
