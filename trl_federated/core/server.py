"""`FederatedServer`: the server of a federated run (Algorithm 1, lines 19-22), whatever carries the messages.

The in-process `FederatedRunner` and the Flower `FederatedStrategy` are drivers: they train or reach the clients,
and deliver every client's reply, or the reason it has none, to this one object. Everything a round does on the
server happens here, once:

    begin_round(t)          the round opens: callbacks, the admission gate, and the clients it samples
                            (`sampling.sample_clients`: `fraction_train`, `min_train_clients`, from seed and t)
    broadcast(client_id)    what the server sends a client: the global adapter as the wire format sends it and the
                            aggregator's extras for that client (`Aggregator.client_extras`: SCAFFOLD's c and c_i)
    admit(client_id, ...)   a reply, as it came off the wire, decoded once (`wire.WireFormat`), its bytes
                            counted, then checked and bounded (`admission.UpdateGate.check`)
    accept(update)          an admitted update joins the round
    drop(client_id, ...)    a client leaves the round, with the kind of fault and the reason
    end_round()             min_clients_per_round, the self-reported sample counts bounded by the round's median
                            (`UpdateGate.bound_round_samples`), the aggregator's per-client state committed
                            (`Aggregator.accept`: SCAFFOLD's c_i ← c_i + Δc_i), aggregation, the round record,
                            evaluation, callbacks, the atomic checkpoint, then `on_round_saved` (the round's lines in
                            the log)

and, for a Flower evaluate round after a round, `evaluation_clients(t)` (the clients sampled to evaluate the global
adapter on their own held-out data), `record_client_evaluation` (their results and row-weighted mean, logged) and
`client_evaluation_recorded(t)` (whether metrics.jsonl holds them: a resumed run redoes the checkpointed round's
evaluate round otherwise); plus `start_run` (output folder, which this process then writes alone, resume or the
evaluation before training, and `num_rounds`, fewer than configured when the privacy budget `dp_max_epsilon` ends the
run), `finish_run` (the final adapter, `on_adapter_saved` for its model card, `result.json`, and `on_run_end` for the
Hub) and `close` (the output folder's lock, however the run ended). Under differential privacy (`dp_noise_multiplier`)
the aggregator clips, noises and accounts (`aggregation.privacy`, set up here for the federation's clients and
sampling). The per-client state of an aggregation is the aggregator's own (see `aggregation.Aggregator`): this module
names no method. Traffic is counted per client and round in both directions, everything that crosses the wire: the
adapter entries the wire format sends, and the extras (SCAFFOLD's c and c_i down, Δc_i up).

The core imports nothing a person reads: summary.md and the plots, the round's log lines and the server-step advice,
the model card and the Hub push are `RoundCallback`s on its events (`reports.server_reports`), which the drivers
attach. The transport contract is enforced here, not left to each driver: `accept` takes a round's updates in the
order of the clients' indices, and `session` (a context manager around a run) closes the server however the run ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datasets import Dataset
from peft import PeftModel

from ..adapters import (
    AdapterState,
    check_state,
    get_adapter_state,
    save_adapter,
    set_adapter_state,
    state_nbytes,
    state_size,
)
from ..aggregation import Aggregator, ClientUpdate
from ..aggregation.privacy import DamagedLedgerError, privacy_from_config
from ..aggregation.update import IDLE_UPDATE_SHARE
from ..config import FedGRPOConfig
from ..runtime.distributed import from_main_process, wait_for_everyone
from ..sampling import clients_per_round, participation_errors, sample_clients
from ..scoring.rewards import combined_reward_range
from ..wire import WireFormat
from .admission import UpdateGate, bounded_text, check_client_id, read_reply, update_norm_unit
from .callbacks import MetricsLoggerCallback, fire_round_callbacks
from .checkpoint import (
    DP_RELEASE_LOG,
    Checkpoint,
    CorruptCheckpointError,
    list_checkpoints,
    prepare_output_dir,
    read_checkpoint,
    unlock_output_dir,
    write_checkpoint,
)
from .evaluation import (
    COMPLETIONS_FILE,
    check_eval_reward_funcs,
    client_evaluation_record,
    describe_client_evaluation,
    evaluate_adapter,
    write_completions,
)
from .round_record import RoundRecord
from .run_identity import allowed_changes, check_identity, keep_server_step, run_identity

logger = logging.getLogger(__name__)


class NotEnoughClientsError(RuntimeError):
    """Fewer than `min_clients_per_round` clients had their update accepted in a round; the run stops."""


class TransportContractError(RuntimeError):
    """A driver broke the transport contract: it accepted a round's updates out of the clients' index order."""


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
    # Each client broadcast to, by id: its index (as the driver names it, else its place among the broadcasts).
    indices: dict[str, int] = field(default_factory=dict)


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
        writes_result: Whether the server writes `result.json` when the run ends (summary.md, the plots and the
            model card are reports among `callbacks`: `reports.server_reports`).
        client_ids: The federation's client ids where the server knows them without their data (a Flower
            `ClientRegistry`); besides these, those of `client_datasets` and `num_samples`, and each client it learns
            of (`add_clients`, `broadcast`, a checkpoint's history): no client's metric is kept under another's name.
        eval_samples: The rows of each client's own evaluation split where the server knows them (a registry's
            `eval-samples`): a client evaluation counting more is refused, one counting fewer weighs as it counts.
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
        writes_result: bool = False,
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
        self.writes_result = writes_result
        # The interval R̄ must lie in, from the reward functions' declared ranges (None: not known).
        self.reward_range = None if reward_funcs is None else combined_reward_range(reward_funcs, args.reward_weights)
        for message in args.federation_warnings(self.reward_range):
            logger.warning(message)
        aggregator.reward_range = self.reward_range
        self.eval_dataset = eval_dataset
        self.eval_reward_funcs = self.eval_reward_weights = None
        if eval_dataset is not None:
            if eval_reward_funcs is None:
                eval_reward_funcs, self.eval_reward_weights = reward_funcs, args.reward_weights
            # A reward model among the training rewards fails now, not after the first round.
            self.eval_reward_funcs = check_eval_reward_funcs(eval_reward_funcs)
            if processing_class is None:
                from ..runtime.models import load_processing_class

                processing_class = load_processing_class(model.config._name_or_path)
        self.processing_class = processing_class
        self.num_clients = len(client_datasets) or args.num_clients
        for message in participation_errors(args, self.num_clients):
            raise ValueError(message)
        self.clients_per_round = clients_per_round(self.num_clients, args.fraction_train, args.min_train_clients)
        # Client-level DP (None without `dp_noise_multiplier`): the aggregator clips, noises and accounts.
        aggregator.privacy = privacy_from_config(
            args, aggregator, self.num_clients, self.clients_per_round,
            args.dp_clip_norm * update_norm_unit(args.local_steps, args.learning_rate, self.global_state),
            self.reward_range, frozen_keys=self.wire.frozen_keys,
            release_log=Path(args.output_dir) / DP_RELEASE_LOG if is_main_process else None,
        )
        # An update shorter than this share of U is idle (`aggregation.base.is_idle`), not only one of exactly zero.
        aggregator.idle_norm = IDLE_UPDATE_SHARE * update_norm_unit(args.local_steps, args.learning_rate,
                                                                    self.global_state)
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
            if self.is_main_process:
                # the coordinates the noise lands on: a frozen LoRA A takes none
                privacy.warn_of_noise_floor(state_size(self.wire.sent(self.global_state)))
            self.num_rounds = first_round + privacy.affordable_rounds(self.args.num_rounds - first_round)
            if self.num_rounds < self.args.num_rounds:
                logger.warning(
                    "The privacy budget dp_max_epsilon=%g allows %d more rounds: the run ends after round %d of the "
                    "%d configured, with its checkpoint, final adapter and model card.", privacy.max_epsilon,
                    self.num_rounds - first_round, self.num_rounds - 1, self.args.num_rounds,
                )
        return first_round

    @contextlib.contextmanager
    def session(self) -> Iterator[int]:
        """A run, as a driver holds it: `with server.session() as first_round:` runs `start_run` and closes the server
        however the run ends (`close`: the output folder's lock is released on an error too). The transport contract's
        second rule, kept here rather than in each driver's `finally`."""
        try:
            yield self.start_run()
        finally:
            self.close()

    def close(self) -> None:
        """Release the output folder that `start_run` locked (`checkpoint.lock_output_dir`); `session` calls it
        however the run ends (the process's exit releases it too)."""
        if self.is_main_process:
            unlock_output_dir(self.args.output_dir)

    def finish_run(self) -> None:
        """Save the final global adapter in `output_dir` (PEFT layout; the callbacks' `on_adapter_saved` writes its
        model card) and `result.json` (`writes_result`), load it into the model, and fire `on_run_end` (the push to the
        Hub when `args.push_to_hub`), last, so that a Hub failure loses nothing."""
        output_dir = Path(self.args.output_dir)
        if self.is_main_process:
            save_adapter(self.model, self.global_state, output_dir)
            # What describes the adapter is written beside it (the model card, `reports.hub.ModelCardReport`).
            mechanisms = [mechanism for mechanism in (self.aggregator.privacy, self.aggregator.record_privacy)
                          if mechanism is not None]
            self._fire("on_adapter_saved", model=self.model, output_dir=output_dir, num_clients=self.num_clients,
                       evaluations=self.evaluations,
                       privacy="; ".join(mechanism.describe() for mechanism in mechanisms) or None)
            if self.writes_result:
                self.write_result(output_dir / "result.json", time.perf_counter() - self.started)
            # Said by every driver: a drop-in `trainer.train()` otherwise ends without a word of where it went.
            logger.info("The global adapter is in %s (PEFT layout: `PeftModel.from_pretrained(base_model, %r)` "
                        "loads it).", output_dir.resolve(), str(output_dir))
        set_adapter_state(self.model, self.global_state)
        wait_for_everyone()
        self._fire("on_run_end")  # the Hub push, last, so that a Hub failure loses nothing

    def write_result(self, path: str | Path, wall_time: float) -> Path:
        """`result.json`, written atomically: the evaluations and each round's R̄, ω, traffic and the aggregator's
        round metrics (RPG: h as "gains", τ as "temperature"). Its presence marks a finished run (`trl-federated
        compare` relies on it)."""
        keys = ("round_idx", "sampled", "rewards", "weights", "bytes_sent", "bytes_received", "dropped")
        result = {
            "wall_time": wall_time,
            "robust_aggregation": self.args.robust_aggregation,  # the combiner each round's `robust_selected` is of
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
        # Under DP the draw comes from a server-only secret: clients know `seed`, and could otherwise tell when they
        # are sampled, which the accountant's amplification by sampling assumes they cannot.
        privacy = self.aggregator.privacy
        seed = args.seed if privacy is None else privacy.sampling_seed
        sampled = sample_clients(self.num_clients, args.fraction_train, args.min_train_clients, seed, round_idx)
        self._round = _Round(round_idx, time.perf_counter(), sampled, state_nbytes(self.wire.sent(self.global_state)))
        return sampled

    def add_clients(self, client_ids: Iterable[str]) -> None:
        """Clients of the federation the server learns of as the run goes (a Flower node bound to its client): from
        now on no other client's metric is kept under their names (`admission.bound_metrics`)."""
        self.gate.client_ids.update(client_ids)

    def broadcast(
        self, client_id: str, client_index: int | None = None
    ) -> tuple[AdapterState, dict[str, AdapterState]]:
        """What the server sends `client_id` this round: the global adapter's entries that travel (all but the
        frozen ones, `wire.WireFormat.sent`) and the aggregator's extras for it (`Aggregator.client_extras`),
        whose bytes count in the round's traffic. `client_index`: the client's index, by which `accept` orders the
        round's updates (None: its place among this round's broadcasts, as a driver that sends in index order has)."""
        extras = self.aggregator.client_extras(client_id, self.global_state)
        self.add_clients([client_id])
        if self._round is not None:
            self._round.extras_bytes[client_id] = sum(state_nbytes(extra) for extra in extras.values())
            indices = self._round.indices
            indices[client_id] = len(indices) if client_index is None else client_index
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
        with it every bit of the aggregate, is the same whichever transport delivered it. The transport contract's
        first rule: an update whose client comes before one already accepted is refused (`TransportContractError`);
        a driver that receives replies in another order hands them to `accept_in_order`. The aggregator commits its
        per-client state when the round ends, once the round's self-reported sample counts are bounded
        (`UpdateGate.bound_round_samples`)."""
        indices = self._round.indices
        index = indices.get(update.client_id)
        behind = [accepted.client_id for accepted in self._round.updates
                  if index is not None and indices.get(accepted.client_id, -1) > index]
        if behind:
            raise TransportContractError(
                f"Round {self._round.round_idx}: the update of client {update.client_id!r} (index {index}) was "
                f"accepted after that of {behind[0]!r} (index {indices[behind[0]]}): a round's updates join in the "
                "order of the clients' indices (`FederatedServer.accept_in_order` sorts them)."
            )
        self._round.updates.append(update)
        self._fire("on_client_end", round_idx=self._round.round_idx, update=update)

    def accept_in_order(self, updates: Iterable[ClientUpdate]) -> None:
        """`accept` each of `updates` (admitted, in whatever order their replies came) in the order of the clients'
        indices, as the clients were given them at `broadcast`."""
        indices = self._round.indices
        for update in sorted(updates, key=lambda update: indices.get(update.client_id, len(indices))):
            self.accept(update)

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
            # The round's lines in the log and the server-step advice (`reports.round_log.RoundLog`)
            self._fire("on_round_saved", record=record, global_state=self.global_state, num_clients=self.num_clients)
        self._round = None
        return record

    # Evaluation and checkpoints ----------------------------------------------------------------------------

    def evaluate(self, round_idx: int) -> dict[str, Any] | None:
        """Mean evaluation reward (the accuracy, for a binary reward) of the current global adapter on
        `eval_dataset`, overall and per `args.partition_column` label (None without an `eval_dataset`)."""
        if self.eval_dataset is None:
            return None
        results = evaluate_adapter(
            self.model, self.global_state, self.processing_class, self.eval_dataset, self.args,
            self.eval_reward_funcs, self.eval_reward_weights, distributed=self.num_processes > 1, keep_completions=True,
        )
        completions = results.pop("completions")
        if self.is_main_process:
            write_completions(Path(self.args.output_dir) / COMPLETIONS_FILE, round_idx,
                              {**results, "completions": completions})
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
        result, the labels not pooled, each client's as sent and the failures (`client_evaluation_record`) go to the
        callbacks (`RoundCallback.on_client_evaluation`, a `client_evaluation` line in metrics.jsonl) and the log;
        returns them."""
        results = client_evaluation_record(evaluations, failed, self.evaluation_range(), self.eval_samples)
        self._fire("on_client_evaluation", round_idx=round_idx, results=results)
        logger.info("Round %d: %d clients evaluated the global adapter on their own held-out data: %s.", round_idx,
                    len(evaluations), describe_client_evaluation(results))
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
        keep_server_step(self.args, self.aggregator, self.identity, checkpoint.identity)
        check_identity(checkpoint.identity, self.identity, path, allow_changes=allowed_changes(self.args))
        try:
            check_state(checkpoint.global_state, self.global_state, "the global adapter")
        except ValueError as error:
            raise CorruptCheckpointError(path, str(error).rstrip(".")) from error
        self.global_state = checkpoint.global_state
        try:
            self.aggregator.load_state_dict(checkpoint.aggregator)
        except DamagedLedgerError:  # the ledger in output_dir, not the checkpoint, is at fault: it names the file
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise CorruptCheckpointError(path, f"its aggregator state does not load ({type(error).__name__}: "
                                              f"{error})") from error
        self.history = checkpoint.history
        self.add_clients(name for record in self.history for name in [*record.rewards, *record.client_metrics])
        self.evaluations = checkpoint.evaluations
        set_adapter_state(self.model, self.global_state)
        self._fire("on_resume", round_idx=checkpoint.round_idx, history=self.history, evaluations=self.evaluations)
        return checkpoint.round_idx


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
