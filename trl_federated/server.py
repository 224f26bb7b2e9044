"""`FederatedServer`: the server of a federated run (Algorithm 1, lines 19-22), whatever carries the messages.

The in-process `FederatedRunner` and the Flower `FederatedStrategy` are drivers: they train or reach the clients,
and deliver every client's reply, or the reason it has none, to this one object. Everything a round does on the
server happens here, once:

    begin_round(t)          the round opens: callbacks, the admission gate, and the clients it samples
                            (`sampling.sample_clients`: `fraction_train`, `min_train_clients`, from seed and t)
    broadcast(client_id)    what the server sends a client: the global adapter as the wire format sends it and the
                            aggregator's extras for that client (`Aggregator.client_extras`: SCAFFOLD's c and c_i)
    admit(client_id, ...)   a reply, as it came off the wire, decoded once (`adapters.WireFormat`), its bytes
                            counted, then checked and bounded (`admission.UpdateGate.check`)
    accept(update)          an admitted update joins the round
    drop(client_id, ...)    a client leaves the round, with the kind of fault and the reason
    end_round()             min_clients_per_round, the self-reported sample counts bounded by the round's median
                            (`UpdateGate.bound_round_samples`), the aggregator's per-client state committed
                            (`Aggregator.accept`: SCAFFOLD's c_i ← c_i + Δc_i), aggregation, the round record,
                            evaluation, callbacks, the atomic checkpoint, and the round's summary in the log

and, for a Flower evaluate round after a round, `evaluation_clients(t)` (the clients sampled to evaluate the global
adapter on their own held-out data), `record_client_evaluation` (their results and row-weighted mean, logged) and
`client_evaluation_recorded(t)` (whether metrics.jsonl holds them: a resumed run redoes the checkpointed round's
evaluate round otherwise); plus `start_run` (output folder, which this process then writes alone, resume or the
evaluation before training, and `num_rounds`, fewer than configured when the privacy budget `dp_max_epsilon` ends
the run), `finish_run` (the final adapter, its model card, `result.json`, the Hub) and `close` (the output folder's
lock, however the run ended). Under differential privacy (`dp_noise_multiplier`) the aggregator clips, noises and
accounts (`aggregation.privacy`, set up here for the federation's clients and sampling). The per-client state of an
aggregation is the aggregator's own (see `aggregation.Aggregator`): this module names no method. Traffic is counted
per client and round in both directions, everything that crosses the wire: the adapter entries the wire format sends,
and the extras (SCAFFOLD's c and c_i down, Δc_i up).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datasets import Dataset
from peft import PeftModel

from .adapters import (
    AdapterState,
    WireFormat,
    check_state,
    get_adapter_state,
    save_adapter,
    set_adapter_state,
    state_nbytes,
    state_norm,
    state_size,
)
from .admission import (
    MIN_MEDIAN_CLIENTS,
    SAMPLES_MEDIAN_SPREAD,
    UpdateGate,
    bounded_text,
    check_client_id,
    plain_number,
    read_reply,
    update_norm_unit,
)
from .aggregation import SERVER_OPTIMIZER_CLASSES, Aggregator, ClientUpdate, server_optimizer_from_config
from .aggregation.privacy import ClientLevelPrivacy, privacy_from_config
from .callbacks import MetricsLoggerCallback, fire_round_callbacks
from .checkpoint import (
    Checkpoint,
    CorruptCheckpointError,
    list_checkpoints,
    prepare_output_dir,
    read_checkpoint,
    unlock_output_dir,
    write_checkpoint,
)
from .config import SERVER_STEP_FIELDS, FedGRPOConfig
from .distributed import from_main_process, wait_for_everyone
from .evaluation import TOTAL, check_eval_reward_funcs, evaluate_adapter, merge_evaluations
from .hub import federated_model_card, push_to_hub
from .reporting import ReportCallback, round_label
from .rewards import combined_reward_range
from .round_record import RoundRecord
from .run_identity import allowed_changes, check_identity, run_identity
from .sampling import clients_per_round, participation_errors, sample_clients

logger = logging.getLogger(__name__)

# A round whose server step moves the adapter more than this many times the clients' mean change Δ is warned about.
SERVER_STEP_RATIO_WARNING = 5.0
# ‖Δ‖ at most this fraction of ‖θ‖ is float32 rounding of the adapter: the clients did not move it.
ZERO_DELTA_RELATIVE = 1e-6
# What the large-ratio warning advises, per `server_optimizer`: what makes that step outgrow Δ.
SERVER_STEP_ADVICE = {
    "adam": "The paper's server Adam moves every coordinate by about the server learning rate whatever Δ's size: "
    "lower `server_learning_rate`, or take a step on Δ's own scale (`server_optimizer` 'adam-norm' or 'fedadam').",
    "fedadam": "FedAdam's momentum outlasts a Δ that shrank: lower `server_beta1` or `server_learning_rate`.",
    "adam-norm": "Its momentum points where Δ no longer does: lower `server_beta1`.",
    "nesterov": "Nesterov momentum grows a persistent direction up to η (1 + μ / (1 − μ)) times Δ: lower "
    "`server_beta1` (μ) or `server_learning_rate` (η).",
    "sgd": "Server SGD moves the adapter by `server_learning_rate` times Δ: lower it (1 is model averaging).",
}


class NotEnoughClientsError(RuntimeError):
    """Fewer than `min_clients_per_round` clients had their update accepted in a round; the run stops."""


@dataclass
class _Round:
    """The round in progress: when it began, the indices of the clients it samples, what each client received (the
    adapter's bytes, and those of its extras), the accepted updates, the drops."""

    round_idx: int
    started: float
    sampled: list[int]
    broadcast_bytes: int
    extras_bytes: dict[str, int] = field(default_factory=dict)
    updates: list[ClientUpdate] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)


class FederatedServer:
    """The server state of a federation and every step a round takes on it (see the module docstring).

    Args:
        model: The `PeftModel` whose active adapter is federated (`adapters.with_federated_adapter`); the server
            keeps the global adapter as tensors and loads it into the model only to evaluate and save.
        args: The federation's `FedGRPOConfig`.
        aggregator: The server strategy (`aggregation.aggregator_from_config`).
        client_datasets: The clients' data where the server holds it (the in-process runner): a checkpoint then
            pins them, and their sizes replace the clients' reported D_i. Empty for a server that holds none.
        num_samples: D_i the server knows without the data (a Flower `ClientRegistry`); it replaces the report.
        reward_funcs: The clients' reward functions (loaded; None when unknown): their declared ranges bound R̄
            (`rewards.combined_reward_range`), and they score `eval_dataset` unless `eval_reward_funcs` is given.
        callbacks: `RoundCallback`s (after the `metrics.jsonl` logger, which always comes first).
        processing_class, eval_dataset: The evaluation of the global adapter before training, every `eval_every`
            rounds and after the last (none without `eval_dataset`); the tokenizer or processor is loaded from
            the model's path when not given.
        eval_reward_funcs: The reward function(s) that score `eval_dataset`, summed with weight 1 each (default:
            `reward_funcs` with `args.reward_weights`, as TRL's `reward`).
        dataset_name: The Hub id of the clients' data, for the model card.
        client_ids: The federation's client ids where the server knows them without their data (a Flower
            `ClientRegistry`); besides these, those of `client_datasets` and `num_samples`, and each client it learns
            of (`add_clients`, `broadcast`, a checkpoint's history): no client's metric is kept under another's name.
        eval_samples: The rows of each client's own evaluation split where the server knows them (a registry's
            `eval-samples`): a client evaluation counting more is refused, one counting fewer weighs as it counts.
        report_header: With a header (may be empty), the server also writes `summary.md` and the plots after every
            round (`reporting.ReportCallback`) and `result.json` when the run ends; None: neither.
        is_main_process, num_processes: Under `accelerate launch`, the main process aggregates and writes; the
            others receive its results, so every process leaves a round identical. Every process takes part in
            each evaluation, generating its share of the batches (`evaluation.evaluate_accuracy`).
    """

    def __init__(
        self,
        model: PeftModel,
        args: FedGRPOConfig,
        aggregator: Aggregator,
        reward_funcs=None,
        client_datasets: Mapping[str, Dataset] | None = None,
        num_samples: Mapping[str, int] | None = None,
        callbacks: list | None = None,
        processing_class=None,
        eval_dataset: Dataset | None = None,
        eval_reward_funcs: Callable | Sequence[Callable] | None = None,
        dataset_name: str | None = None,
        report_header: str | None = None,
        is_main_process: bool = True,
        num_processes: int = 1,
        client_ids: Sequence[str] | None = None,
        eval_samples: Mapping[str, int] | None = None,
    ):
        client_datasets = dict(client_datasets or {})
        for client_id in [*client_datasets, *(num_samples or {}), *(client_ids or ())]:
            check_client_id(client_id)
        self.args = args
        self.model = model
        self.aggregator = aggregator
        self.global_state: AdapterState = get_adapter_state(model)
        self.wire = WireFormat.from_config(args, self.global_state)
        self.metrics_log = MetricsLoggerCallback(args.output_dir)
        self.callbacks = [self.metrics_log, *(callbacks or [])]
        if report_header is not None:
            self.callbacks.append(ReportCallback(args.output_dir, header=report_header))
        self.writes_result = report_header is not None
        # The interval R̄ must lie in, from the reward functions' declared ranges (None: not known).
        self.reward_range = None if reward_funcs is None else combined_reward_range(reward_funcs, args.reward_weights)
        for message in args.federation_warnings(self.reward_range):
            logger.warning(message)
        self.eval_dataset = eval_dataset
        self.eval_reward_funcs = self.eval_reward_weights = None
        if eval_dataset is not None:
            if eval_reward_funcs is None:
                eval_reward_funcs, self.eval_reward_weights = reward_funcs, args.reward_weights
            # A reward model among the training rewards fails now, not after the first round.
            self.eval_reward_funcs = check_eval_reward_funcs(eval_reward_funcs)
            if processing_class is None:
                from .models import load_processing_class

                processing_class = load_processing_class(model.config._name_or_path)
        self.processing_class = processing_class
        self.dataset_name = dataset_name
        self.num_clients = len(client_datasets) or args.num_clients
        for message in participation_errors(args, self.num_clients):
            raise ValueError(message)
        self.clients_per_round = clients_per_round(self.num_clients, args.fraction_train, args.min_train_clients)
        # Client-level DP (None without `dp_noise_multiplier`): the aggregator clips, noises and accounts.
        aggregator.privacy = privacy_from_config(
            args, aggregator, self.num_clients, self.clients_per_round,
            args.dp_clip_norm * update_norm_unit(args.local_steps, args.learning_rate, self.global_state),
            self.reward_range,
        )
        self.num_rounds = args.num_rounds  # the rounds this run does: `start_run` sets it
        self.is_main_process, self.num_processes = is_main_process, num_processes
        self.history: list[RoundRecord] = []
        self.evaluations: dict[int, dict[str, Any]] = {}
        # The rows of each client's evaluation split, where the server knows them (a registry's `eval-samples`).
        self.eval_samples = dict(eval_samples or {})
        known_samples = {client_id: len(dataset) for client_id, dataset in client_datasets.items()}
        # Every update enters the server through this gate: decoding, identity, values, sample count, norms.
        self.gate = UpdateGate.from_config(
            args, self.global_state, self.reward_range, num_samples=known_samples or num_samples, aggregator=aggregator,
            client_ids=[*client_datasets, *(client_ids or ())],
        )
        # What a checkpoint must match to be resumed, taken before any training can touch the model.
        self.identity = run_identity(model, client_datasets, aggregator, args)
        self.started = time.perf_counter()
        self._round: _Round | None = None

    def _fire(self, hook: str, **kwargs) -> None:
        if self.is_main_process:
            fire_round_callbacks(self.callbacks, hook, self.args, **kwargs)

    # The run ------------------------------------------------------------------------------------------------

    def start_run(self) -> int:
        """Prepare `output_dir` and return the first round to run: 0 after evaluating the initial adapter (unless
        `args.eval_initial` is off), or the
        round after the checkpoint `args.resume_from_checkpoint` names, restored. The run goes on to round
        `num_rounds` - 1: the config's last, or under `dp_max_epsilon` the last whose ε stays within the budget."""
        self.started = time.perf_counter()
        resume_from = prepare_output_dir(self.args, self.is_main_process)
        wait_for_everyone()  # the main process may just have cleared output_dir
        first_round = 0
        if resume_from is not None:
            first_round = self.load_checkpoint(resume_from) + 1
            logger.info("Resumed from %s: continuing with round %d of %d.", resume_from, first_round,
                        self.args.num_rounds)
        elif self.args.eval_initial:
            self.evaluate(round_idx=-1)
        privacy = self.aggregator.privacy
        if privacy is not None:
            self.warn_of_noise_floor(privacy)
            self.num_rounds = first_round + privacy.affordable_rounds(self.args.num_rounds - first_round)
            if self.num_rounds < self.args.num_rounds:
                logger.warning(
                    "The privacy budget dp_max_epsilon=%g allows %d more rounds: the run ends after round %d of the "
                    "%d configured, with its checkpoint, final adapter and model card.", privacy.max_epsilon,
                    self.num_rounds - first_round, self.num_rounds - 1, self.args.num_rounds,
                )
        return first_round

    def warn_of_noise_floor(self, privacy: ClientLevelPrivacy) -> None:
        """Warn when DP's noise will outweigh whatever the clients send (`noise_to_signal_floor` above 1): then the
        run cannot learn, whatever the data, and it takes more clients a round or a smaller adapter."""
        num_coordinates = state_size(self.global_state)
        floor = privacy.noise_to_signal_floor(num_coordinates)
        if floor > 1 and self.is_main_process:
            logger.warning(
                "Under differential privacy the noise on Δ will be at least %.3g times as long as any change the "
                "clients can make (‖noise‖ ≈ σ·2C·ω_max·√d ≥ 2σ√d/m with σ = %g, m = %d clients a round and d = %s "
                "adapter coordinates, against ‖Δ‖ ≤ C): this run cannot learn. The noise falls to the longest Δ's size "
                "only from %s clients a round at this σ, or with a smaller adapter (docs/privacy.md, 'What it "
                "costs').", floor, privacy.noise_multiplier, privacy.sample_size, f"{num_coordinates:,}",
                f"{math.ceil(floor * privacy.sample_size):,}",
            )

    def close(self) -> None:
        """Release the output folder that `start_run` locked (`checkpoint.lock_output_dir`); drivers call it however
        the run ends (the process's exit releases it too)."""
        if self.is_main_process:
            unlock_output_dir(self.args.output_dir)

    def finish_run(self) -> None:
        """Save the final global adapter in `output_dir` (PEFT layout, with its model card) and `result.json` (with a
        report header), load it into the model, and push to the Hub when `args.push_to_hub`, last, so that a Hub
        failure loses nothing."""
        output_dir = Path(self.args.output_dir)
        if self.is_main_process:
            save_adapter(self.model, self.global_state, output_dir)
            # Over PEFT's placeholder README.md, pushed or not: the folder describes its adapter (see `hub`).
            privacy = self.aggregator.privacy
            card = federated_model_card(self.model, self.args, self.num_clients, self.evaluations, self.dataset_name,
                                        privacy=None if privacy is None else privacy.describe())
            card.save(output_dir / "README.md")
            if self.writes_result:
                self.write_result(output_dir / "result.json", time.perf_counter() - self.started)
        set_adapter_state(self.model, self.global_state)
        wait_for_everyone()
        if self.args.push_to_hub and self.is_main_process:
            push_to_hub(self.args)

    def write_result(self, path: str | Path, wall_time: float) -> Path:
        """`result.json`, written atomically: the evaluations and each round's R̄, ω, traffic and the aggregator's
        round metrics (RPG: h as "gains", τ as "temperature"). Its presence marks a finished run (`trl-federated
        compare` relies on it)."""
        keys = ("round_idx", "sampled", "rewards", "weights", "bytes_sent", "bytes_received", "dropped")
        result = {
            "wall_time": wall_time,
            "evaluations": {str(idx): value for idx, value in sorted(self.evaluations.items())},
            "rounds": [
                {**{key: getattr(record, key) for key in keys}, **record.metric_values()} for record in self.history
            ],
        }
        path = Path(path)
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(result, indent=1), encoding="utf-8")
        temporary.replace(path)
        return path

    # A round -----------------------------------------------------------------------------------------------

    def begin_round(self, round_idx: int) -> list[int]:
        """Open round `round_idx` and return the indices, ascending, of the clients it trains
        (`sampling.sample_clients`: every client unless `fraction_train` < 1): replies are admitted against the
        current global adapter from now on."""
        self._fire("on_round_begin", round_idx=round_idx)
        self.gate.open_round(self.global_state)
        args = self.args
        sampled = sample_clients(self.num_clients, args.fraction_train, args.min_train_clients, args.seed, round_idx)
        self._round = _Round(round_idx, time.perf_counter(), sampled, state_nbytes(self.wire.sent(self.global_state)))
        return sampled

    def add_clients(self, client_ids: Iterable[str]) -> None:
        """Clients of the federation the server learns of as the run goes (a Flower node bound to its client): from
        now on no other client's metric is kept under their names (`admission.bound_metrics`)."""
        self.gate.client_ids.update(client_ids)

    def broadcast(self, client_id: str) -> tuple[AdapterState, dict[str, AdapterState]]:
        """What the server sends `client_id` this round: the global adapter's entries that travel (all but the
        frozen ones, `adapters.WireFormat.sent`) and the aggregator's extras for it (`Aggregator.client_extras`),
        whose bytes count in the round's traffic."""
        extras = self.aggregator.client_extras(client_id, self.global_state)
        self.add_clients([client_id])
        if self._round is not None:
            self._round.extras_bytes[client_id] = sum(state_nbytes(extra) for extra in extras.values())
        return self.wire.sent(self.global_state), extras

    def admit(self, client_id: str, update: ClientUpdate) -> ClientUpdate:
        """`update` of `client_id` as it came off the wire (its `state` the wire payload, `WireFormat.encode`),
        decoded into the client's full adapter (the server aggregates what the wire delivers) with `wire_bytes` set
        to everything it carried (the payload and the extras), then checked and bounded (`UpdateGate.check`);
        `InvalidUpdateError`, naming the client and the fault, for anything else."""

        def decode() -> ClientUpdate:
            payload = update.state
            update.state = self.wire.decode(payload, self.gate.global_state)
            update.wire_bytes = state_nbytes(payload) + sum(state_nbytes(extra) for extra in update.extras.values())
            return update

        return self.gate.check(client_id, read_reply(client_id, decode))

    def accept(self, update: ClientUpdate) -> None:
        """An admitted update joins the round: in the order of the clients' indices, so that summation order, and
        with it every bit of the aggregate, is the same whichever transport delivered it. The aggregator commits its
        per-client state when the round ends, once the round's self-reported sample counts are bounded
        (`UpdateGate.bound_round_samples`)."""
        self._round.updates.append(update)
        self._fire("on_client_end", round_idx=self._round.round_idx, update=update)

    def drop(self, client_id: str, kind: str, reason: str, error: BaseException | None = None) -> None:
        """`client_id` leaves the round: `kind` is 'error', 'timeout' or 'invalid_update'; one `client_dropped` line
        in metrics.jsonl."""
        round_idx = self._round.round_idx
        reason = bounded_text(reason)  # a client's words: one line, escaped, bounded, whoever delivered them
        # The traceback only helps with an unexpected error.
        logger.warning("Round %d: client %r dropped (%s): %s", round_idx, client_id, kind, reason,
                       exc_info=error if kind == "error" else None)
        self._round.dropped[client_id] = reason
        if kind == "invalid_update":  # refused by the gate: its past input stops acting on the others
            self.aggregator.forget(client_id)
        self._fire("on_client_dropped", round_idx=round_idx, client_id=client_id, kind=kind, reason=reason)

    def refuse(self, name: str, reason: str) -> None:
        """A participant that is no client of the federation (a Flower node that did not say which client it
        serves, or whose key is not registered) is sent nothing this round: it is named in the round's record and
        the log, but it has no `client_dropped` line, since it is no client."""
        logger.warning("Round %d: %s is sent no training message: %s.", self._round.round_idx, name, reason)
        self._round.dropped[name] = reason

    def end_round(self) -> RoundRecord:
        """Aggregate the accepted updates into the next global adapter, record, evaluate when due, fire the
        callbacks and checkpoint; `NotEnoughClientsError`, the last checkpoint intact, with fewer than
        `min_clients_per_round` updates."""
        current, args = self._round, self.args
        round_idx, updates = current.round_idx, current.updates
        if len(updates) < args.min_clients_per_round:
            reasons = "; ".join(f"{client_id}: {reason}" for client_id, reason in current.dropped.items())
            last = list_checkpoints(args.output_dir)
            raise NotEnoughClientsError(
                f"Round {round_idx}: only {len(updates)} of {len(updates) + len(current.dropped)} clients reported a "
                f"valid update, fewer than min_clients_per_round={args.min_clients_per_round}. Dropped: "
                f"{reasons or 'none'}. The run stops; "
                f"{f'the last checkpoint, {last[-1]}, is intact' if last else 'no round finished'}."
            )
        # A sample count the server does not know is bounded by the round's median (it weighs FedAvg's and
        # SCAFFOLD's mean, and SCAFFOLD's c), before the aggregator commits any client's state.
        self.gate.bound_round_samples(updates)
        for update in updates:
            self.aggregator.accept(update)
        record = None
        if self.is_main_process:
            # The gate checked every value already: the aggregator checks the rest (ids, keys, shapes, result).
            self.global_state = self.aggregator.aggregate(self.global_state, updates, round_idx, check_finite=False)
            received = {
                update.client_id: current.broadcast_bytes + current.extras_bytes.get(update.client_id, 0)
                for update in updates
            }
            record = RoundRecord.from_aggregation(
                round_idx, self.aggregator, updates, current.dropped, received, current.sampled
            )
        if self.num_processes > 1:
            # Every other process receives the new global adapter, the aggregator's state (SCAFFOLD's c and c_i steer
            # its next local steps) and the record, so that all processes leave the round identical.
            self.global_state, aggregator_state, record = from_main_process(
                (self.global_state, self.aggregator.state_dict(), record)
            )
            self.aggregator.load_state_dict(aggregator_state)
        if round_idx == self.num_rounds - 1 or (args.eval_every and (round_idx + 1) % args.eval_every == 0):
            record.evaluation = self.evaluate(round_idx)  # on every process, from the same global adapter
        record.wall_time = time.perf_counter() - current.started
        self.history.append(record)
        self._fire("on_round_end", record=record)
        if self.is_main_process:
            self.save_checkpoint(round_idx)  # with round-<t>/ when save_every_round, in the same atomic step
            delta_is_rounding = self.delta_is_rounding(record)
            logger.info("%s", format_round_log(record, args.num_rounds, self.num_clients, delta_is_rounding))
            self.check_server_step(record, delta_is_rounding)
        self._round = None
        return record

    def delta_is_rounding(self, record: RoundRecord) -> bool:
        """Whether the round's Δ is at float rounding of the adapter: every client sent back what it received, so
        ‖server step‖ / ‖Δ‖ measures rounding, not the server optimizer. Only a large ratio can be such a round (a
        step of Δ's size or less is said as it is), so only then is ‖θ‖ computed: not a pass over the adapter every
        round."""
        ratio = record.server_step_ratio
        if ratio is None or ratio <= SERVER_STEP_RATIO_WARNING:
            return False
        return record.delta_norm <= ZERO_DELTA_RELATIVE * state_norm(self.global_state)

    def check_server_step(self, record: RoundRecord, delta_is_rounding: bool) -> None:
        """Warn, with advice for the server optimizer in use, when the round's server step moved the adapter far
        more than the clients' mean change Δ (`server_step_ratio` above `SERVER_STEP_RATIO_WARNING`). A round whose Δ
        is at float rounding of the adapter (`delta_is_rounding`) is said as such, not as a configuration at fault:
        whatever moved then was the server's momentum."""
        ratio, args = record.server_step_ratio, self.args
        if ratio is None or ratio <= SERVER_STEP_RATIO_WARNING:
            return
        if delta_is_rounding:
            logger.info(
                "Round %d: the clients' mean change Δ is at float rounding of the adapter (‖Δ‖ = %.3g): they sent "
                "back what they received; the server step (%.3g) is the momentum of `server_optimizer` %r.",
                record.round_idx, record.delta_norm, record.server_step_norm, args.server_optimizer,
            )
            return
        setting = (f"`server_optimizer` {args.server_optimizer!r} with `server_learning_rate` "
                   f"{args.server_learning_rate:g} ({args.server_field_origin('server_learning_rate')})")
        logger.warning(
            "Round %d: the server step moved the global adapter %.1fx as far as the clients' mean change Δ "
            "(‖θ^{t+1} − θ^{t}‖ = %.3g, ‖Δ‖ = %.3g); %s. %s metrics.jsonl records every round's ratio "
            "(`server_step_ratio`).",
            record.round_idx, ratio, record.server_step_norm, record.delta_norm, setting,
            SERVER_STEP_ADVICE.get(args.server_optimizer, SERVER_STEP_ADVICE["sgd"]),
        )

    # Evaluation and checkpoints ----------------------------------------------------------------------------

    def evaluate(self, round_idx: int) -> dict[str, Any] | None:
        """Mean evaluation reward (the accuracy, for a binary reward) of the current global adapter on
        `eval_dataset`, overall and per `args.partition_column` label (None without an `eval_dataset`)."""
        if self.eval_dataset is None:
            return None
        results = evaluate_adapter(
            self.model, self.global_state, self.processing_class, self.eval_dataset, self.args,
            self.eval_reward_funcs, self.eval_reward_weights, distributed=self.num_processes > 1,
        )
        self.evaluations[round_idx] = results
        self._fire("on_evaluate_round", round_idx=round_idx, results=results)
        return results

    def evaluation_clients(self, round_idx: int) -> list[int]:
        """The indices, ascending, of the clients that evaluate the global adapter of round `round_idx` on their own
        held-out data (Flower's evaluate round): `fraction_evaluate` and `min_evaluate_clients`, drawn from (seed,
        round) apart from the round's training draw (`sampling.sample_clients`); none with `fraction_evaluate` 0."""
        args = self.args
        if args.fraction_evaluate == 0:
            return []
        return sample_clients(
            self.num_clients, args.fraction_evaluate, args.min_evaluate_clients, args.seed, round_idx, "evaluate"
        )

    def record_client_evaluation(
        self, round_idx: int, evaluations: dict[str, dict[str, Any]], failed: dict[str, str]
    ) -> dict[str, Any]:
        """Record the clients' evaluations of the global adapter of round `round_idx`, each on its own held-out data
        (`evaluate_accuracy`'s "accuracy" and "count" per label), and why the others sampled have none: the pooled
        result (`pool_client_evaluations`: per label reported by 3 or more clients, the row-weighted mean with every
        count bounded, `bound_client_evaluations`; the median without a declared reward range), the labels not pooled
        ("unpooled"), each client's as sent, and the failures go to the callbacks (`RoundCallback.on_client_evaluation`,
        a `client_evaluation` line in metrics.jsonl) and the log; returns them."""
        failed = dict(failed)
        reward_range = self.evaluation_range()
        bounded = bound_client_evaluations(evaluations, reward_range, failed, self.eval_samples)
        pooled = pool_client_evaluations(bounded, reward_range)
        reported = {label for client_id, evaluation in evaluations.items() if client_id not in failed
                    for label in evaluation["count"]}
        unpooled = sorted(reported - set(pooled["count"]))
        results = {**pooled, "clients": evaluations, "failed": failed, "unpooled": unpooled}
        self._fire("on_client_evaluation", round_idx=round_idx, results=results)
        total = results["accuracy"].get(TOTAL)
        if total is None:  # fewer than MIN_POOLED_CLIENTS replies: each client's own, not pooled
            summary = "not pooled (fewer than %d clients): %s" % (MIN_POOLED_CLIENTS, ", ".join(
                f"{client_id} {100 * evaluations[client_id]['accuracy'][TOTAL]:.2f}% over "
                f"{evaluations[client_id]['count'][TOTAL]} rows" for client_id in evaluations if client_id not in failed
            ) or "no evaluation")
        else:
            summary = f"accuracy {100 * total:.2f}% over {results['count'][TOTAL]} rows"
        logger.info(
            "Round %d: %d clients evaluated the global adapter on their own held-out data: %s%s%s.",
            round_idx, len(evaluations), summary,
            "" if not unpooled or total is None else f"; labels reported by fewer than {MIN_POOLED_CLIENTS} "
            f"clients, shown per client only: {', '.join(map(repr, unpooled[:10]))}",
            "".join(f"; {client_id}: {reason}" for client_id, reason in failed.items()),
        )
        return results

    def evaluation_range(self) -> tuple[float, float] | None:
        """The interval an evaluation's mean reward lies in: its reward functions' declared range (the evaluation's
        own, else the training's, which evaluate by default); None when they declare none."""
        if self.eval_reward_funcs is not None:
            return combined_reward_range(self.eval_reward_funcs, self.eval_reward_weights)
        return self.reward_range

    def client_evaluation_recorded(self, round_idx: int) -> bool:
        """Whether the clients' evaluation of round `round_idx` was recorded (its `client_evaluation` line in
        metrics.jsonl). Only the log can tell: a round's checkpoint is written before its evaluate round, and a resume
        keeps the lines of the rounds up to its checkpoint, the evaluate round's included, and drops a torn one."""
        return self.metrics_log.has_line("client_evaluation", round_idx)

    def save_checkpoint(self, round_idx: int) -> Path:
        """Write `output_dir/checkpoint-<round_idx>`: the state after round `round_idx`, atomically, with the round's
        adapter `round-<round_idx>/` when `args.save_every_round` (`checkpoint.write_checkpoint`)."""
        checkpoint = Checkpoint(
            round_idx=round_idx,
            global_state=self.global_state,
            aggregator=self.aggregator.state_dict(),
            history=self.history,
            evaluations=self.evaluations,
            identity=self.identity,
        )
        adapter_config = self.model.peft_config[self.model.active_adapter]
        return write_checkpoint(
            checkpoint, self.args.output_dir, adapter_config, self.args.save_total_limit, self.args.save_every_round
        )

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore the run's state from the checkpoint at `path` (verified by `checkpoint.read_checkpoint`) after
        checking that this run made it (same base model, LoRA configuration, clients, aggregator, server optimizer,
        wire format and training settings, up to `args.resume_allow_changes`; else `CheckpointMismatchError`);
        returns its round."""
        checkpoint = read_checkpoint(path)
        self.keep_server_step(checkpoint.identity)
        check_identity(checkpoint.identity, self.identity, path, allow_changes=allowed_changes(self.args))
        try:
            check_state(checkpoint.global_state, self.global_state, "the global adapter")
        except ValueError as error:
            raise CorruptCheckpointError(path, str(error).rstrip(".")) from error
        self.global_state = checkpoint.global_state
        try:
            self.aggregator.load_state_dict(checkpoint.aggregator)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise CorruptCheckpointError(path, f"its aggregator state does not load ({type(error).__name__}: "
                                              f"{error})") from error
        self.history = checkpoint.history
        self.add_clients(name for record in self.history for name in [*record.rewards, *record.client_metrics])
        self.evaluations = checkpoint.evaluations
        set_adapter_state(self.model, self.global_state)
        self._fire("on_resume", round_idx=checkpoint.round_idx, history=self.history, evaluations=self.evaluations)
        return checkpoint.round_idx

    def keep_server_step(self, saved_identity: dict[str, Any]) -> None:
        """Server-step fields left unset (`FedGRPOConfig.derived_server_fields`) are resolved once per run: resumed,
        the run takes its checkpoint's server optimizer and learning rate, even where the defaults or the fields they
        derive from have changed since (FGRPO's default step did). An explicit value is checked against the
        checkpoint as any setting (`run_identity.check_identity`)."""
        args, derived = self.args, self.args.derived_server_fields
        saved_class, current_class = saved_identity["server_optimizer"], self.identity["server_optimizer"]
        names = {optimizer_class.__name__: name for name, optimizer_class in SERVER_OPTIMIZER_CLASSES.items()}
        if "server_optimizer" in derived and saved_class != current_class and saved_class in names:
            logger.warning(
                "Resuming with the checkpoint's server_optimizer %r, resolved when the run began (left unset, this "
                "configuration would take %r now); set `server_optimizer` to choose.",
                names[saved_class], args.server_optimizer,
            )
            args.resolve_server_step(names[saved_class])
            self.aggregator.server_optimizer = server_optimizer_from_config(args)
            self.identity["server_optimizer"] = saved_class
            self.identity["training"].update(
                {name: getattr(args, name) for name in SERVER_STEP_FIELDS if name in self.identity["training"]}
            )
        saved, current = saved_identity["training"]["server_learning_rate"], args.server_learning_rate
        same_optimizer = saved_class == self.identity["server_optimizer"]
        if not ("server_learning_rate" in derived and same_optimizer) or saved == current:
            return
        logger.warning(
            "Resuming with the checkpoint's server_learning_rate %g, resolved when the run began (left unset, this "
            "configuration would derive %g now).", saved, current,
        )
        args.server_learning_rate = self.aggregator.server_optimizer.learning_rate = saved
        self.identity["training"]["server_learning_rate"] = saved


# The most rows one client's evaluation may count (a held-out split of that size takes hours to evaluate on the
# hardware this runs on): a reply claiming more is refused, its client failed. A count the server cannot check weighs
# at most `EVALUATION_WEIGHT_SPREAD` times the median count of its label, and a label is pooled only when
# `MIN_POOLED_CLIENTS` or more clients report it: with fewer there is no median one reply cannot move.
MAX_EVALUATION_ROWS = 1_000_000
EVALUATION_WEIGHT_SPREAD = SAMPLES_MEDIAN_SPREAD
MIN_POOLED_CLIENTS = MIN_MEDIAN_CLIENTS


def bound_client_evaluations(
    evaluations: dict[str, dict[str, Any]], reward_range: tuple[float, float] | None, failed: dict[str, str],
    known_counts: Mapping[str, int] | None = None,
) -> dict[str, dict[str, Any]]:
    """The clients' evaluations as they enter the pooled accuracy, which no one reply can own. A reply that is not an
    evaluation (`evaluation_fault`: values no finite numbers, counts no positive integers up to its Total), whose
    accuracy lies outside `reward_range`, or that counts more rows than is plausible (`MAX_EVALUATION_ROWS`, or the
    size of its evaluation split where the server knows it, `known_counts`) fails that client (named in `failed`).
    Of the others, a label enters only when `MIN_POOLED_CLIENTS` or more clients report it (the rest are shown per
    client), each count bounded by what the server knows of the client (its split's size) or, without that, by
    `EVALUATION_WEIGHT_SPREAD` times the median of that label's counts: a client claiming 2^63 rows weighs as a
    median client does. The clients' own figures stay in the record as sent."""
    known_counts = dict(known_counts or {})
    kept = {}
    for client_id, evaluation in evaluations.items():
        fault = evaluation_fault(evaluation, reward_range, known_counts.get(client_id))
        if fault is not None:
            failed[client_id] = f"invalid evaluation reply: {fault}"
            continue
        kept[client_id] = evaluation
    counts: dict[str, list[int]] = {}
    for evaluation in kept.values():
        for label, count in evaluation["count"].items():
            counts.setdefault(label, []).append(count)
    caps = {
        label: max(1, math.floor(EVALUATION_WEIGHT_SPREAD * statistics.median(values)))
        for label, values in counts.items() if len(values) >= MIN_POOLED_CLIENTS
    }
    bounded = {}
    for client_id, evaluation in kept.items():
        labels = [label for label in evaluation["count"] if label in caps]
        over = [label for label in labels if client_id not in known_counts and evaluation["count"][label] > caps[label]]
        if over:
            logger.warning("Client %r's evaluation counts more rows than the median client's (%s): counted as the "
                           "median.", client_id, ", ".join(f"{bounded_text(repr(label), 100)}: "
                                                            f"{evaluation['count'][label]:,} > {caps[label]:,}"
                                                            for label in over[:5]))
        bounded[client_id] = {
            "accuracy": {label: evaluation["accuracy"][label] for label in labels},
            "count": {
                label: evaluation["count"][label] if client_id in known_counts
                else min(evaluation["count"][label], caps[label])
                for label in labels
            },
        }
    return bounded


def evaluation_fault(
    evaluation: Any, reward_range: tuple[float, float] | None, known_count: int | None = None
) -> str | None:
    """Why a client's evaluation reply cannot be pooled, or None: it must hold "accuracy" and "count" for the same
    labels, `TOTAL` among them; every accuracy a finite number inside `reward_range` (when declared), every count a
    positive integer up to its Total, and the Total at most `MAX_EVALUATION_ROWS` and `known_count` (the rows of the
    client's evaluation split, where the server knows them)."""
    accuracy = evaluation.get("accuracy") if isinstance(evaluation, dict) else None
    count = evaluation.get("count") if isinstance(evaluation, dict) else None
    if not isinstance(accuracy, dict) or not isinstance(count, dict) or set(accuracy) != set(count) or (
        TOTAL not in count
    ):
        return f"it holds no accuracy and row count per label with {TOTAL!r}"
    total = count[TOTAL]
    for label, value in accuracy.items():
        number, rows = plain_number(value), count[label]
        name = bounded_text(repr(label), 100)
        if number is None or not math.isfinite(number):
            return f"its accuracy of {name} is no finite number"
        if reward_range is not None and not reward_range[0] <= number <= reward_range[1]:
            return (f"its accuracy of {name!s} lies outside the evaluation's reward range "
                    f"[{reward_range[0]}, {reward_range[1]}]")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1 or (
            isinstance(total, int) and rows > total
        ):
            return f"its row count of {name} is no positive integer up to its {TOTAL} ({bounded_text(repr(rows), 40)})"
    if total > MAX_EVALUATION_ROWS:
        return f"it counts {total:,} rows, more than any evaluation counts ({MAX_EVALUATION_ROWS:,})"
    if known_count is not None and total > known_count:
        return f"it counts {total:,} rows, more than the {known_count:,} of its evaluation split"
    return None


def pool_client_evaluations(
    bounded: dict[str, dict[str, Any]], reward_range: tuple[float, float] | None
) -> dict[str, dict[str, Any]]:
    """The pooled evaluation of the clients' bounded evaluations (`bound_client_evaluations`): per label, the
    row-weighted mean (`evaluation.merge_evaluations`), or, when the evaluation's rewards declare no range (nothing
    bounds what one client's value can be), the median of the clients' values, which no one client can move beyond
    the others'."""
    pooled = merge_evaluations(bounded.values())
    if reward_range is None:
        for label in pooled["accuracy"]:
            pooled["accuracy"][label] = statistics.median(
                evaluation["accuracy"][label] for evaluation in bounded.values() if label in evaluation["accuracy"]
            )
    return pooled


def format_round_log(record: RoundRecord, num_rounds: int, num_clients: int, delta_is_rounding: bool = False) -> str:
    """A finished round in a few log lines: the clients sampled when not all `num_clients`, each aggregated client's
    R̄, ω, traffic and the aggregator's per-client round metrics (RPG: h), its round metrics (RPG: τ), the drops and
    the evaluation, so that a console (`flwr run --stream`, a SuperLink's log) shows what metrics.jsonl records.
    With `delta_is_rounding` (`FederatedServer.delta_is_rounding`) the server step is said as a norm, its ratio to a
    Δ of float rounding meaning nothing."""
    per_client = [metric for metric in record.round_metrics if metric.per_client]
    shown = "".join(
        f", {metric.show(metric.value)}" for metric in record.round_metrics
        if not metric.per_client and metric.value is not None
    )
    if record.server_step_ratio is None:
        step = ""
    elif delta_is_rounding:
        step = f", Δ ≈ 0 (float rounding), server step ‖s‖ = {record.server_step_norm:.3g}"
    else:
        step = f", server step {record.server_step_ratio:.2f}x ‖Δ‖"
    sampled = record.sampled
    sampling = "" if len(sampled) == num_clients else f" ({len(sampled)} of {num_clients} sampled: {sampled})"
    lines = [
        f"Round {round_label(record.round_idx, num_rounds)}: {len(record.weights)} clients aggregated{sampling}, "
        f"{len(record.dropped)} dropped{shown}{step}, {record.wall_time:.1f} s"
    ]
    for client_id, reward in record.rewards.items():
        cosine = record.update_cosines.get(client_id)
        values = [(metric, (metric.value or {}).get(client_id)) for metric in per_client]
        lines.append(
            f"  {client_id}: R̄ = {reward:.4f}"
            + "".join(f", {metric.show(value)}" for metric, value in values if value is not None)
            + f", ω = {record.weights[client_id]:.4f}, ‖u‖ = {record.update_norms[client_id]:.3g}"
            + ("" if cosine is None else f", cos(u, Δ) = {cosine:+.3f}")
            + f", sent {record.bytes_sent[client_id]:,} B, "
            f"received {record.bytes_received[client_id]:,} B"
        )
    for client_id, reason in record.dropped.items():
        lines.append(f"  {client_id}: dropped ({reason})")
    if record.evaluation is not None:
        accuracy = ", ".join(f"{label} {100 * value:.2f}%" for label, value in record.evaluation["accuracy"].items())
        lines.append(f"  evaluation: {accuracy}")
    return "\n".join(lines)


class ServerStateView:
    """What a driver that owns `self.server` (`FederatedRunner`, the Flower strategy) shows of the server: the global
    adapter, the aggregator, the round records, the evaluations and the run's callbacks; the rest is
    `self.server`'s."""

    server: FederatedServer

    @property
    def evaluations(self) -> dict[int, dict[str, Any]]:
        return self.server.evaluations

    @property
    def callbacks(self) -> list:
        """The run's callbacks: the server fires their round hooks, every client's trainer their trainer hooks."""
        return self.server.callbacks

    @callbacks.setter
    def callbacks(self, callbacks: list) -> None:
        self.server.callbacks = callbacks

    @property
    def global_state(self) -> AdapterState:
        return self.server.global_state

    @property
    def aggregator(self) -> Aggregator:
        return self.server.aggregator

    @property
    def history(self) -> list[RoundRecord]:
        return self.server.history
