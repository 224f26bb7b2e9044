"""Admission of client updates: the one guarded path by which every client reply enters the server.

Whatever the transport (the in-process runner's wire simulation, a Flower reply), a reply is decoded, checked
against what the server itself knows, and bounded before any server state sees it:

1. decoding, once, by whoever holds the bytes (`read_reply` around the transport's own decoder: the Flower
   strategy's `flower.records.content_to_update`, then the server's `WireFormat.decode` in `FederatedServer.admit`);
2. identity: the update must speak for the client the server asked (the server's map, not the reply's claim),
   and only once per round;
3. values: `validate_update` (the adapter's keys, shapes, dtypes and finite values, the sample count, R̄ in
   `reward_range`), what the client sends besides its adapter, which the aggregator checks and bounds
   (`Aggregator.check_extras`: SCAFFOLD's Δc_i), and its metrics (`bound_metrics`: typed, size-bounded, never
   named like the server's own log entries; R̄ the mean of its last W step rewards when it sends them);
4. sample count: the server's own count D_i where it has one, else the client's report capped at
   `max_client_samples` and, when the round ends, at the median count of the round's updates
   (`UpdateGate.bound_round_samples`);
5. size: ‖θ_i − θ‖ within `update_norm_bound` (see `update_norm_unit`); under SCAFFOLD the update less the
   correction the server prescribed, ‖(θ_i − θ) + E·η·(c − c_i)‖; else the update is rejected or clipped
   (`update_norm_action`).

Steps 2 to 5 are `UpdateGate.check`, which takes the decoded update and calls back into nothing. Anything that fails,
including an exception no check foresaw, is that client's `InvalidUpdateError` with a reason, never an exception out
of the server.
"""

from __future__ import annotations

import logging
import math
import re
import reprlib
import statistics
from collections.abc import Callable, Iterable, Mapping
from numbers import Real
from typing import Any, TypeVar

from ..adapters import (
    AdapterState,
    InvalidUpdateError,
    check_state,
    norm_scale,
    scaled_update,
    state_distance,
    state_norm,
    state_size,
)
from ..aggregation import STRATEGY_METRICS, Aggregator, ClientUpdate
from ..aggregation.privacy import RECORD_EPSILON
from ..aggregation.update import RoundMetric, refuse_extras
from ..choices import NORM_ACTIONS, check_choice
from .callbacks import is_reserved_metric, reserved_client_id_fault

logger = logging.getLogger(__name__)
T = TypeVar("T")

# A client id keys the server's per-client state and names checkpoint tensors, log entries (`<client_id>/weight`)
# and report rows: it must be safe as one path component, and short enough for a log line.
MAX_CLIENT_ID_LENGTH = 256
CLIENT_ID = re.compile(r"[A-Za-z0-9_.@+-]+")


def check_client_id(client_id) -> None:
    """`ValueError` unless `client_id` can name a client: a str of 1 to `MAX_CLIENT_ID_LENGTH` characters of
    `CLIENT_ID`'s alphabet (ASCII letters and digits, `_ . - @ +`), not '.' or '..': safe as a path component, a
    log entry's name, a plot's label (no `$` to open matplotlib's math text) and a line of the console; and not a
    name or prefix of the server's own log entries (`callbacks.reserved_client_id_fault`: `eval_...`, `dp_...`,
    `train`, `round`, `rewards`, ...), under which its own entries would forge them."""
    if not isinstance(client_id, str) or not 0 < len(client_id) <= MAX_CLIENT_ID_LENGTH:
        raise ValueError(f"a client id must be a str of 1 to {MAX_CLIENT_ID_LENGTH} characters, got "
                         f"{bounded_text(repr(client_id), 100)}")
    if client_id in (".", "..") or not CLIENT_ID.fullmatch(client_id):
        raise ValueError(f"client id {bounded_text(repr(client_id), 100)} is not a safe name: use ASCII letters, "
                         "digits and '_', '.', '-', '@', '+' (not '.' or '..')")
    # the round metrics of every built-in strategy and of DP (`dp_` is a reserved prefix already)
    if fault := reserved_client_id_fault(client_id, STRATEGY_METRICS):
        raise ValueError(f"client id {client_id!r} is reserved: {fault} (its entries, `{client_id}/<name>`, would "
                         "take their place)")


def bounded_text(text: str, limit: int = 500) -> str:
    """`text` (chosen by a client: an error message, a reason) as one line for logs and records: every character
    that is not printable (newlines, carriage returns, line and paragraph separators, escape sequences, other control
    characters) written as its escape (`\\n`), so that it cannot forge a line of the server's log, and cut to
    `limit` characters."""
    text = "".join(char if char.isprintable() else repr(char)[1:-1] for char in str(text))
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters in all)"


def plain_number(value: Any) -> float | None:
    """`value`, a real number a client sent (an int, a float or a subclass, a `Fraction`, a NumPy scalar), as a
    plain Python float, which every check and the JSON log then read; None for anything else (a bool, a string, a
    number too large for a float). A float subclass cannot then answer a range check with comparisons of its own."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    try:
        return float(value)  # always a plain float, even from a float subclass's own __float__
    except (TypeError, ValueError, OverflowError):
        return None


# What a client's metrics may hold (`bound_metrics`). They are logged, averaged into the round log and kept in every
# checkpoint's history, so their number and size are bounded. TRL logs about 25 metrics a step plus 2 per reward
# function and the client adds 4: 128 leaves room for 50 reward functions.
MAX_CLIENT_METRICS = 128
# Long enough for TRL's longest names (`rewards/<reward model's name>/mean`), short enough for a log line.
MAX_METRIC_NAME_LENGTH = 128
METRIC_NAME = re.compile(r"[A-Za-z0-9_.:@+-]+(/[A-Za-z0-9_.:@+-]+)*")
# The lists a client sends (`client.train_local_round`), by name, with their largest length: R̄ of each local step
# (one per step: `local_steps`, known to the server) and the round's start and end in Unix seconds.
STEP_REWARDS, WALL_CLOCK = "step_rewards", "wall_clock"


def bound_metrics(
    metrics: dict, client_id: str, local_steps: int | None = None, round_metrics: Iterable[RoundMetric] = (),
    client_ids: Iterable[str] = (),
) -> dict:
    """The metrics of client `client_id` the server keeps: finite numbers (as floats), under names of at most
    `MAX_METRIC_NAME_LENGTH` characters of `METRIC_NAME`'s alphabet that are not the round log's own
    (`callbacks.is_reserved_metric`, with the aggregator's `round_metrics`) nor under another client's name
    (`<client>/...` for any of the federation's `client_ids` but its own: the round log would show it on that
    client's curve while it sits a round out), and the two lists a client sends:
    `step_rewards`, at most `local_steps` numbers (NaN marks a step whose rewards scored nothing; no ±Inf), and
    `wall_clock`, two finite numbers. Anything else is dropped, with one warning naming each and why; more than
    `MAX_CLIENT_METRICS` metrics is a `ValueError`."""
    if len(metrics) > MAX_CLIENT_METRICS:
        raise ValueError(f"it sends {len(metrics)} metrics, more than the {MAX_CLIENT_METRICS} a client may send")
    lengths = {STEP_REWARDS: local_steps, WALL_CLOCK: 2}
    others = set(client_ids) - {client_id}
    kept, dropped = {}, []
    for name, value in metrics.items():
        if len(name) > MAX_METRIC_NAME_LENGTH or not METRIC_NAME.fullmatch(name):
            dropped.append(f"{bounded_text(repr(name), 60)} (not a metric name)")
        elif is_reserved_metric(name, round_metrics):
            dropped.append(f"{name!r} (a name of the server's round log)")
        elif "/" in name and name.split("/", 1)[0] in others:
            dropped.append(f"{name!r} (under another client's name)")
        elif name in lengths:
            limit = lengths[name]
            items = [plain_number(item) for item in value] if isinstance(value, (list, tuple)) else None
            if items is None or (limit is not None and len(items) > limit) or not all(
                item is not None and not math.isinf(item) and (name == STEP_REWARDS or math.isfinite(item))
                for item in items
            ):
                dropped.append(f"{name!r} (not a list of at most {limit} numbers)")
            else:
                kept[name] = items
        elif (number := plain_number(value)) is not None and math.isfinite(number):
            kept[name] = number
        else:
            dropped.append(f"{name!r} (a {type(value).__name__}, not a finite number)")
    if dropped:
        logger.warning("Client %r: metrics dropped: %s.", client_id, bounded_text(", ".join(dropped)))
    return kept


def check_window_reward(update: ClientUpdate, reward_window: int) -> None:
    """`ValueError` unless R̄ is the mean of the last `reward_window` (W) step rewards the client sends with it, as
    `LocalGRPOMixin.window_reward` computes it (float32 step means: within 1e-6 relative). This checks that a
    report is self-consistent, not that it is true: a client can send step rewards made up to match its R̄. Without
    `step_rewards` there is nothing to check against."""
    window = update.metrics.get(STEP_REWARDS, [])[-reward_window:]
    if not window:
        return
    mean = math.fsum(window) / len(window)
    if not math.isclose(mean, update.reward, rel_tol=1e-6, abs_tol=1e-6):
        raise ValueError(f"R̄ = {update.reward:.6g} is not the mean of its last {len(window)} step rewards "
                         f"({mean:.6g})")


def check_record_epsilon(update: ClientUpdate, sent: Any) -> None:
    """`ValueError` unless, under record-level DP, `update` (its metrics bounded) reports ε of its records as a finite
    number ≥ 0 (`record_epsilon`; `sent` is the value as it came). The run reports the worst ε its clients reported:
    an update left out of it, or one whose ε is negative, would be aggregated under a guarantee nobody stated."""
    epsilon = update.metrics.get(RECORD_EPSILON)  # a finite float, or absent (`bound_metrics` drops the rest)
    if epsilon is None or not epsilon >= 0:
        found = "missing" if sent is None else bounded_text(repr(sent), 60)
        raise ValueError(f"under record-level DP (`dp_record_noise_multiplier`) it reports no finite ε ≥ 0 for its "
                         f"records (`{RECORD_EPSILON}`: {found})")


def update_norm_unit(local_steps: int, learning_rate: float, global_state: AdapterState) -> float:
    """U = E · η · √d, the unit of `update_norm_bound`: the norm of E local steps that each move every one of the
    adapter's d coordinates by the learning rate η.

    An Adam-family optimizer (TRL's default AdamW) moves a coordinate by η·|m̂/√v̂| per step, and |m̂/√v̂| is 1 at
    the first step and about 1 or less after it (Kingma & Ba, 2015, §2.1), so an honest client's ‖θ_i − θ‖ is at
    most about U, whatever the model, the rank or the data; a learning-rate schedule only lowers it. Under SCAFFOLD
    the gate measures the update less the decoupled correction E·η·(c − c_i) the server prescribed, which leaves
    the client's Adam steps (and, under a decaying schedule, at most E·η·‖c − c_i‖ ≈ 2U of correction not applied).
    """
    return local_steps * learning_rate * math.sqrt(state_size(global_state))


# A count the server cannot check (a training sample count it does not know, an evaluation's row count) weighs at
# most this many times the median count of the replies of its round or label, with at least MIN_MEDIAN_CLIENTS
# replies: one reply then weighs as much as a median client, never most of a mean.
SAMPLES_MEDIAN_SPREAD = 1
MIN_MEDIAN_CLIENTS = 3


class UpdateGate:
    """Decodes, checks and bounds each client's reply before aggregation (see the module docstring).

    Args:
        reward_range: The interval R̄ must lie in (`rewards.combined_reward_range`), or None when not known.
        max_update_norm: Bound on ‖θ_i − θ‖₂ (None: no bound).
        norm_action: "reject" drops an update over a bound; "clip" scales it back onto the bound.
        num_samples: D_i of the clients whose data volume the server knows; it replaces their report.
        client_ids: The federation's clients the server knows (those of `num_samples` too; `FederatedServer` adds
            each client it learns of): no client's metric is kept under another's name (`bound_metrics`).
        max_client_samples: Cap on a self-reported D_i (None: no cap).
        aggregator: The federation's aggregator, which checks and bounds what a client sends besides its adapter
            (`Aggregator.check_extras`); None: a client sends nothing else.
        extras_norm_bound: `update_norm_bound`, which the aggregator applies to those extras in its own unit (None:
            no bound).
        local_steps: E, the local steps of a round: the most step rewards a client reports (None: not bounded).
        learning_rate: η, the local learning rate (its peak, under a schedule): with a strategy whose extras
            prescribe a correction (`Aggregator.correction`, SCAFFOLD's c − c_i), `max_update_norm` bounds the
            update less E · η times it, ‖(θ_i − θ) + E·η·(c − c_i)‖.
        reward_window: W: R̄ must be the mean of the last W step rewards a client reports (None: not checked).
    """

    def __init__(
        self,
        reward_range: tuple[float, float] | None = None,
        max_update_norm: float | None = None,
        norm_action: str = "reject",
        num_samples: Mapping[str, int] | None = None,
        max_client_samples: int | None = None,
        aggregator: Aggregator | None = None,
        extras_norm_bound: float | None = None,
        local_steps: int | None = None,
        reward_window: int | None = None,
        learning_rate: float | None = None,
        client_ids: Iterable[str] = (),
    ):
        check_choice("update_norm_action", norm_action, NORM_ACTIONS)
        self.reward_range = reward_range
        self.max_update_norm, self.norm_action = max_update_norm, norm_action
        self.num_samples = dict(num_samples or {})
        self.client_ids = {*client_ids, *self.num_samples}
        self.max_client_samples = max_client_samples
        self.aggregator, self.extras_norm_bound = aggregator, extras_norm_bound
        self.local_steps, self.reward_window, self.learning_rate = local_steps, reward_window, learning_rate
        self.global_state: AdapterState = {}
        self.admitted: set[str] = set()

    @classmethod
    def from_config(
        cls,
        args,
        global_state: AdapterState,
        reward_range: tuple[float, float] | None = None,
        num_samples: Mapping[str, int] | None = None,
        aggregator: Aggregator | None = None,
        client_ids: Iterable[str] = (),
    ) -> UpdateGate:
        """The gate a `FedGRPOConfig` describes (its "Robustness" fields) for a federation whose global adapter is
        shaped like `global_state`, aggregated by `aggregator`, of the clients `client_ids` (as far as known)."""
        bound = args.update_norm_bound
        unit = update_norm_unit(args.local_steps, args.learning_rate, global_state)
        return cls(
            reward_range=reward_range,
            max_update_norm=None if bound is None else bound * unit,
            norm_action=args.update_norm_action,
            num_samples=num_samples,
            max_client_samples=args.max_client_samples,
            aggregator=aggregator,
            extras_norm_bound=bound,
            local_steps=args.local_steps,
            # R̄ measured on held-out items is no mean of the step rewards sent with it
            reward_window=None if args.rpg_signal == "held-out" else args.reward_window,
            learning_rate=args.learning_rate,
            client_ids=client_ids,
        )

    def open_round(self, global_state: AdapterState) -> None:
        """Start admitting the updates of a round that started from `global_state`."""
        self.global_state = global_state
        self.admitted = set()

    def check(self, client_id: str, update: ClientUpdate) -> ClientUpdate:
        """`update`, decoded from client `client_id`'s reply (`read_reply`), checked and bounded;
        `InvalidUpdateError` (naming the client and the fault) for anything else."""
        try:
            return self._check(client_id, update)
        except InvalidUpdateError:
            raise
        except Exception as error:  # a value no check foresaw: still the client's fault, not a server crash
            raise InvalidUpdateError(
                f"Update of client {client_id!r} rejected: it could not be checked ({type(error).__name__}: "
                f"{bounded_text(error)})."
            ) from error

    def _check(self, client_id: str, update: ClientUpdate) -> ClientUpdate:
        def reject(fault: str):
            raise InvalidUpdateError(f"Update of client {client_id!r} rejected: {fault}.")

        if not isinstance(update, ClientUpdate):
            reject(f"the reply decodes to a {type(update).__name__}, not a ClientUpdate")
        if update.client_id != client_id:
            reject(f"it speaks for client {bounded_text(repr(update.client_id), 100)}")
        if client_id in self.admitted:
            reject("the client already had an update accepted this round")
        # Whatever transport delivered it (the records check ids in full, `check_client_id`; the core itself takes
        # any id, the checkpoint escapes it): an id that names the server's own log entries would forge them.
        if isinstance(client_id, str) and (fault := reserved_client_id_fault(client_id, STRATEGY_METRICS)):
            reject(f"client id {bounded_text(repr(client_id), 100)} is reserved: {fault}")
        if not isinstance(update.state, dict) or not isinstance(update.extras, dict):
            reject("its adapter and extras must be dicts of tensors")
        if not isinstance(update.metrics, dict) or not all(isinstance(key, str) for key in update.metrics):
            reject("its metrics must be a dict keyed by strings")
        validate_update(update, self.global_state, self.reward_range)
        record_epsilon = update.metrics.get(RECORD_EPSILON)  # as sent, for the refusal's message
        try:
            round_metrics = [*STRATEGY_METRICS, *(() if self.aggregator is None else self.aggregator.round_metrics())]
            update.metrics = bound_metrics(update.metrics, client_id, self.local_steps, round_metrics,
                                           self.client_ids)
            if self.reward_window is not None:
                check_window_reward(update, self.reward_window)
            if self.aggregator is not None and self.aggregator.record_privacy is not None:
                check_record_epsilon(update, record_epsilon)
            if self.aggregator is None:
                refuse_extras(update)
            else:
                self.aggregator.check_extras(update, self.global_state, self.extras_norm_bound, self.norm_action)
        except ValueError as error:
            reject(bounded_text(str(error).rstrip(".")))
        self._bound_samples(update)
        self._bound_norm(update, reject)
        self.admitted.add(client_id)
        return update

    def _bound_samples(self, update: ClientUpdate) -> None:
        if update.client_id in self.num_samples:
            update.num_samples = self.num_samples[update.client_id]  # the server's count, not the client's
        elif self.max_client_samples is not None and update.num_samples > self.max_client_samples:
            logger.warning(
                "Client %r reports %d training rows; counted as max_client_samples=%d.",
                update.client_id, update.num_samples, self.max_client_samples,
            )
            update.num_samples = self.max_client_samples

    def bound_round_samples(self, updates: list[ClientUpdate]) -> None:
        """Bound each self-reported sample count of a round (a client whose count the server does not know) by
        `SAMPLES_MEDIAN_SPREAD` times the median count of the round's updates, with `MIN_MEDIAN_CLIENTS` or more: a
        client claiming 2^63 rows then weighs in FedAvg's mean as a median client does, not 0.9996 of it. With
        fewer updates there is no median a single claim cannot move (`max_client_samples` alone bounds it)."""
        if len(updates) < MIN_MEDIAN_CLIENTS:
            return
        cap = max(1, math.floor(SAMPLES_MEDIAN_SPREAD * statistics.median(update.num_samples for update in updates)))
        for update in updates:
            if update.client_id not in self.num_samples and update.num_samples > cap:
                logger.warning(
                    "Client %r reports %d training rows; counted as %d, the round's median (the server knows no "
                    "count of its own for it: register num-samples to weigh clients by their true data).",
                    update.client_id, update.num_samples, cap,
                )
                update.num_samples = cap

    def _bound_norm(self, update: ClientUpdate, reject: Callable[[str], None]) -> None:
        if self.max_update_norm is None:
            return
        correction = None
        if self.aggregator is not None and self.local_steps is not None and self.learning_rate is not None:
            correction = self.aggregator.correction(update.client_id, self.global_state)
        if correction is None:
            norm, measured = state_distance(update.state, self.global_state), "‖θ_i − θ‖"
        else:
            # The correction the server's extras prescribe, E·η·(c − c_i), is the server's doing: what the client
            # controls is the update less it, bounded like any other method's update (see `Aggregator.correction`).
            # Allowing E·η·‖c − c_i‖ on top instead let a client that parked c_i on the control bound double its own
            # bound, in any direction.
            step = self.local_steps * self.learning_rate
            prescribed = {key: -step * value.double() for key, value in correction.items()}
            residual = {
                key: update.state[key].double() - value.double() - prescribed[key]
                for key, value in self.global_state.items()
            }
            norm = state_norm(residual)
            measured = "‖(θ_i − θ) + E·η·(c − c_i)‖ (the update less its prescribed correction)"
        try:
            scale = norm_scale(norm, self.max_update_norm, self.norm_action, measured, "update_norm_bound",
                               update.client_id)
        except ValueError as error:
            reject(str(error))
        if scale == 1.0:
            return
        if correction is None:
            update.state = scaled_update(update.state, self.global_state, scale)
        else:  # the client's own part scaled onto the bound, the prescribed correction kept
            update.state = {
                key: (value.double() + prescribed[key] + scale * residual[key]).to(value.dtype)
                for key, value in self.global_state.items()
            }


def read_reply(client_id: str, decode: Callable[[], T]) -> T:
    """What `decode()` reads from client `client_id`'s reply; any fault in it (a malformed record, a payload that
    does not decode, a `MemoryError`) is that client's `InvalidUpdateError`, never the server's exception."""
    try:
        return decode()
    except InvalidUpdateError:
        raise
    except Exception as error:
        raise InvalidUpdateError(
            f"Update of client {client_id!r} rejected: unreadable reply ({type(error).__name__}: "
            f"{bounded_text(error)})."
        ) from error


def validate_update(
    update: ClientUpdate, global_state: AdapterState, reward_range: tuple[float, float] | None = None
) -> None:
    """Raise `InvalidUpdateError` unless `update`'s adapter, D_i and R̄ can enter aggregation without corrupting the
    server.

    The server state (global adapter, Adam moments, RPG baselines, SCAFFOLD control) is a running sum over
    rounds: one NaN, one mis-shaped tensor or one absurd reward would poison every later round. So the adapter
    must have exactly the global adapter's keys, shapes and dtypes and only finite values (`check_state`); D_i must
    be positive; and R̄ must be a finite number inside `reward_range` (the interval the reward functions declare,
    see `rewards.combined_reward_range`), which bounds how far a client can inflate the reward that RPG weighs it by.
    """

    def reject(fault: str):
        raise InvalidUpdateError(f"Update of client {update.client_id!r} rejected: {fault}.")

    try:
        check_state(update.state, global_state, "adapter", same_dtype=True)
    except ValueError as error:
        reject(str(error).rstrip("."))
    if isinstance(update.num_samples, bool) or not isinstance(update.num_samples, int) or update.num_samples < 1:
        reject(f"num_samples must be a positive integer, got {reprlib.repr(update.num_samples)}")
    reward = plain_number(update.reward)
    if reward is None or not math.isfinite(reward):
        reject(f"reward R̄ must be a finite number, got {bounded_text(reprlib.repr(update.reward), 100)}")
    update.reward = reward
    if reward_range is not None:
        low, high = reward_range
        tolerance = 1e-6 * max(1.0, high - low)  # step rewards are float32 means
        if not low - tolerance <= reward <= high + tolerance:
            reject(f"reward R̄ = {reward} lies outside the reward functions' range [{low}, {high}]")
