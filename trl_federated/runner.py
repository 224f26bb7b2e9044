"""`FederatedRunner`: rounds of local GRPO on every client, then one server aggregation (Algorithm 1)."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from accelerate import PartialState
from datasets import Dataset
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, set_seed
from trl import GRPOTrainer

from .adapters import AdapterState, get_adapter_state, save_adapter, set_adapter_state, state_nbytes
from .admission import UpdateGate
from .aggregation import Aggregator, ClientUpdate, ScaffoldAggregator, aggregator_from_config
from .callbacks import IntegrationLog, MetricsLoggerCallback, RoundRecord, TrainerLogCallback, fire_round_callbacks
from .checkpoint import (
    CheckpointedServer,
    list_checkpoints,
    prepare_output_dir,
    run_identity,
)
from .client import (
    describe_failure,
    load_reward_models,
    local_training_args,
    release_free_memory,
    train_local_round,
    zero_control,
)
from .config import FedGRPOConfig
from .distributed import check_parameters_unsharded, from_main_process, wait_for_everyone
from .evaluation import check_eval_reward_funcs, evaluate_accuracy
from .hub import federated_model_card, push_to_hub
from .reporting import RunProgress
from .rewards import combined_reward_range
from .trainer import federated
from .transport import WireFormat, is_lora_a

logger = logging.getLogger(__name__)


class NotEnoughClientsError(RuntimeError):
    """Fewer than `min_clients_per_round` clients had their update accepted in a round; the run stops."""


def default_lora_config() -> LoraConfig:
    """LoRA on every linear projection of the decoder, as the paper does (it uses r=32, α=128 on 3B+ models)."""
    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def with_federated_adapter(model: PreTrainedModel | PeftModel, seed: int, peft_config: PeftConfig | None = None):
    """`model` wrapped in the LoRA adapter the federation trains (`peft_config`, default `default_lora_config`);
    a `PeftModel` is returned as it is.

    LoRA draws its A matrices from the global RNG: it is seeded with `seed` first, as `Trainer` does before
    `model_init`, so that the initial global adapter, and with it the whole run, follows from the seed alone,
    in whichever process (runner, Flower ServerApp) builds it.
    """
    if isinstance(model, PeftModel):
        if peft_config is not None:
            raise ValueError("`model` is already a PeftModel: pass its adapter configuration, not `peft_config`.")
        return model
    set_seed(seed)
    return get_peft_model(model, peft_config or default_lora_config())


class FederatedRunner(CheckpointedServer):
    """Simulates N clients and the server of a federated GRPO run in one process.

    The base model is loaded once and wrapped in PEFT once; clients take turns on it. For each round and client
    the runner loads the global adapter with `set_peft_model_state_dict`, trains a fresh `FedGRPOTrainer` (or
    `federated(trainer_class)`) for
    `local_steps` steps on the client's data (seed `args.seed + round * num_clients + client_index`), and keeps
    only the client's adapter (`get_peft_model_state_dict`) and R̄. Memory therefore grows by one adapter copy
    per client, never by a model. The aggregator then produces the next global adapter.

    Reliability: a client that raises, runs past `client_timeout` or reports an update that the server's
    `admission.UpdateGate` rejects (malformed, non-finite, out of range, over `update_norm_bound`) is dropped from its round (a `client_dropped` line in metrics.jsonl) and the round aggregates the
    others, if at least `min_clients_per_round` are left; the run stops with `NotEnoughClientsError` otherwise.
    After every round `output_dir/checkpoint-<t>` is written atomically (see `trl_federated.checkpoint`), and
    `run()` continues from one when `args.resume_from_checkpoint` is set, exactly as if never interrupted.

    Besides its callbacks and `output_dir/metrics.jsonl`, the runner reports every round to the `report_to`
    integrations as a `Trainer` would (`callbacks.TrainerLogCallback`): through `log_to`'s state and callbacks,
    else, when `args.report_to` names any, through an `IntegrationLog` of its own (`self.log_to`).

    Args:
        model: A model id or local path, a `PreTrainedModel`, or a `PeftModel` whose active adapter is federated.
        reward_funcs: As for `GRPOTrainer`; a reward model given by id or path is loaded once, for every client
            and round (`client.load_reward_models`).
        args: The run's `FedGRPOConfig`; its GRPO fields configure every client's local training.
        client_datasets: Each client's private training set, as a dict keyed by client id or a list.
        processing_class: Tokenizer, or processor for a vision-language model; loaded from the model's path when
            omitted (`models.load_processing_class`).
        peft_config: LoRA configuration for a model that is not yet a `PeftModel` (default: `default_lora_config`).
        aggregator: Server strategy; built from `args` (`aggregation`, `server_optimizer`, `rpg_*`) when omitted.
        eval_dataset: Held-out prompts scored before training, every `eval_every` rounds and after the last round;
            its columns other than `prompt` go to the reward functions (e.g. `answer`, or TRL's `solution`), and
            accuracy is broken down by `args.partition_column` when it has that column.
        callbacks: `RoundCallback`s (they also receive the clients' trainer events) or plain `TrainerCallback`s.
        eval_reward_funcs: The reward function(s) that score `eval_dataset`, summed with weight 1 each (default:
            `reward_funcs` with `args.reward_weights`, as TRL's `reward`). Give a binary correctness reward
            such as `accuracy_reward` to report accuracy when training also rewards format or length.
        trainer_kwargs: Further `GRPOTrainer` arguments for every client's trainer (`reward_processing_classes`,
            `tools`, `rollout_func`, ...).
        trainer_class: The `GRPOTrainer` subclass every client trains with (TRL's experimental `GMPOTrainer`, or your
            own), federated with `trainer.federated` (default: `GRPOTrainer`, i.e. `FedGRPOTrainer`). Give `args` of
            its config class made federated (`config.federated_config`) when it has one.
        log_to: A `Trainer` whose `state`, `log()` and callbacks report the run (the drop-in `FedGRPOTrainer`
            passes itself).
        dataset_name: The Hub id of the clients' data, named in the model card (see `trl_federated.hub`).
    """

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        reward_funcs,
        args: FedGRPOConfig,
        client_datasets: Mapping[str, Dataset] | Sequence[Dataset],
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        peft_config: PeftConfig | None = None,
        aggregator: Aggregator | None = None,
        eval_dataset: Dataset | None = None,
        callbacks: list | None = None,
        eval_reward_funcs: Callable | Sequence[Callable] | None = None,
        trainer_kwargs: dict[str, Any] | None = None,
        log_to=None,
        dataset_name: str | None = None,
        trainer_class: type[GRPOTrainer] | None = None,
    ):
        if not isinstance(args, FedGRPOConfig):
            raise TypeError(f"`args` must be a FedGRPOConfig, got {type(args).__name__}.")
        check_parameters_unsharded()
        self.trainer_class = federated(trainer_class or GRPOTrainer)  # a class that is no GRPOTrainer fails here
        self.args = args
        self.client_datasets = self._named_clients(client_datasets)

        if isinstance(model, str):
            from .models import load_model_and_tokenizer

            model, tokenizer = load_model_and_tokenizer(model)
            processing_class = processing_class or tokenizer
        if processing_class is None:
            from .models import load_processing_class

            processing_class = load_processing_class(model.config._name_or_path)
        self.model = model = with_federated_adapter(model, args.seed, peft_config)
        self.processing_class = processing_class
        self.reward_funcs = reward_funcs = load_reward_models(reward_funcs, args)
        self.aggregator = (
            aggregator if aggregator is not None else aggregator_from_config(args, len(self.client_datasets))
        )
        self.eval_dataset = eval_dataset
        if eval_reward_funcs is None:
            eval_reward_funcs, self.eval_reward_weights = reward_funcs, args.reward_weights
        else:
            self.eval_reward_weights = None
        # A reward model among the training rewards fails now, not after the first round.
        self.eval_reward_funcs = check_eval_reward_funcs(eval_reward_funcs) if eval_dataset is not None else None
        self.trainer_kwargs = trainer_kwargs or {}
        self.dataset_name = dataset_name
        self.callbacks = [MetricsLoggerCallback(args.output_dir), *(callbacks or [])]
        self.is_main_process = PartialState().is_main_process
        if log_to is None and args.report_to:
            log_to = IntegrationLog(args, model, processing_class, self.is_main_process)
        self.log_to = log_to
        if log_to is not None:
            self.callbacks.append(TrainerLogCallback(log_to, args.local_steps))
        self.global_state: AdapterState = get_adapter_state(model)
        # π_ref of the KL term: θ^{[0]}, fixed for every client and round (see `client.train_local_round`).
        self.reference_state = self.global_state if args.beta != 0 else None
        self.wire = WireFormat.from_config(args, self.global_state)
        if args.lora_aggregation == "freeze_a":
            # FFA-LoRA: A keeps its seeded initialisation, shared by every client; only B trains.
            for name, param in model.named_parameters():
                if is_lora_a(name):
                    param.requires_grad_(False)
        self.history: list[RoundRecord] = []
        # Client-side state that persists across rounds (SCAFFOLD's c_i), keyed by client id.
        self.client_controls: dict[str, AdapterState] = {}
        self.evaluations: dict[int, dict[str, Any]] = {}
        self.progress: RunProgress | None = None  # the progress bar, while `run()` runs
        self.num_processes = PartialState().num_processes
        # The interval R̄ must lie in, from the reward functions' declared ranges (None: not known).
        self.reward_range = combined_reward_range(reward_funcs, args.reward_weights)
        # Every update enters the server through this gate; the runner knows each client's D_i itself.
        self.gate = UpdateGate.from_config(
            args, self.global_state, self.reward_range,
            num_samples={client_id: len(dataset) for client_id, dataset in self.client_datasets.items()},
            control=isinstance(self.aggregator, ScaffoldAggregator),
        )
        self._check_clients()
        # What a checkpoint must match to be resumed, taken before any training can touch the model.
        self.identity = run_identity(self.model, self.client_datasets, self.aggregator, args)

    @staticmethod
    def _named_clients(client_datasets) -> dict[str, Dataset]:
        if isinstance(client_datasets, Mapping):
            named = {str(name): dataset for name, dataset in client_datasets.items()}
        else:
            named = {f"client_{index}": dataset for index, dataset in enumerate(client_datasets)}
        if not named:
            raise ValueError("`client_datasets` is empty: a federation needs at least one client.")
        empty = [name for name, dataset in named.items() if len(dataset) == 0]
        if empty:
            raise ValueError(f"Client datasets must not be empty; empty: {empty}.")
        return named

    def _check_clients(self) -> None:
        """Fail now, naming the clients, on a federation that could never run a round."""
        args, num_clients = self.args, len(self.client_datasets)
        if args.min_clients_per_round > num_clients:
            raise ValueError(
                f"`min_clients_per_round` ({args.min_clients_per_round}) exceeds the {num_clients} clients of the "
                "federation: no round could ever aggregate."
            )
        if args.use_vllm and args.vllm_mode == "colocate":
            raise ValueError(
                "`use_vllm` with `vllm_mode='colocate'` would start a vLLM engine, and load the base model into it, "
                "for every client's trainer in every round. Use `vllm_mode='server'`: one `trl vllm-serve` engine "
                "serves all clients and rounds, and TRL pushes each client's merged weights to it without reloading."
            )
        for message in args.federation_warnings(self.reward_range):
            logger.warning(message)
        # TRL's sampler draws generation_batch_size / num_generations distinct prompts per generation batch and
        # skips an incomplete batch, so a smaller client would never take a step.
        needed = args.generation_batch_size // args.num_generations
        small = {name: len(dataset) for name, dataset in self.client_datasets.items() if len(dataset) < needed}
        if small:
            raise ValueError(
                f"Client datasets too small for one generation batch of {needed} prompts (generation_batch_size "
                f"{args.generation_batch_size} / num_generations {args.num_generations}): {small} rows. Give these "
                "clients more data, or lower per_device_train_batch_size or steps_per_generation."
            )

    # Callbacks ---------------------------------------------------------------------------------------------

    def _fire(self, hook: str, **kwargs) -> None:
        if self.is_main_process:
            fire_round_callbacks(self.callbacks, hook, self.args, **kwargs)

    # One client --------------------------------------------------------------------------------------------

    def client_args(self, round_idx: int, client_index: int, client_id: str) -> FedGRPOConfig:
        """The local-training configuration of one client in one round (see `client.local_training_args`)."""
        return local_training_args(self.args, round_idx, client_index, len(self.client_datasets), client_id)

    def train_client(self, round_idx: int, client_index: int, client_id: str) -> ClientUpdate:
        """Run one client's local round from the current global adapter and return its update.

        Raises `ClientTimeoutError` when the round, from building the trainer to its last step, took longer
        than `client_timeout` seconds; training already stops at the first step boundary past the limit.
        """
        scaffold_controls = None
        if isinstance(self.aggregator, ScaffoldAggregator):
            scaffold_controls = (self.aggregator.server_control(self.global_state), self.client_control(client_id))
        return train_local_round(
            self.model,
            self.global_state,
            client_id,
            self.client_datasets[client_id],
            self.client_args(round_idx, client_index, client_id),
            self.reward_funcs,
            self.processing_class,
            callbacks=[*self.callbacks, self.progress] if self.progress is not None else self.callbacks,
            trainer_kwargs=self.trainer_kwargs,
            scaffold_controls=scaffold_controls,
            reference_state=self.reference_state,
            trainer_class=self.trainer_class,
        )

    def client_control(self, client_id: str) -> AdapterState:
        """SCAFFOLD's c_i of a client: zeros until its first accepted update."""
        if client_id not in self.client_controls:
            return zero_control(self.aggregator.server_control(self.global_state))
        return self.client_controls[client_id]

    # Rounds ------------------------------------------------------------------------------------------------

    def run(self) -> list[RoundRecord]:
        """Run all `num_rounds` rounds; save the final global adapter in `output_dir` (PEFT layout).

        With `args.resume_from_checkpoint` (a checkpoint folder, or "true" for the latest in `output_dir`) the
        run restores that checkpoint and goes on from the round after it. Otherwise `output_dir` must not hold
        another run, unless `args.overwrite_output_dir` (see `checkpoint.prepare_output_dir`).
        """
        # Everything alive now (the libraries, the model, the datasets) outlives the run, and `Trainer.train()` runs
        # a full `gc.collect()` for every client round, as `client.release_trainer` does: with TRL imported that is ~0.2 s a
        # collection, scanning ~400k long-lived objects. Frozen, they are skipped and a collection costs microseconds.
        gc.freeze()
        try:
            if self.log_to is None:
                return self._run()
            log_to = self.log_to
            log_to.state.max_steps = self.args.num_rounds * self.args.local_steps
            log_to.state.epoch = None  # each client is at its own epoch of its own data: there is none to log
            # The integrations set up here (TensorBoard opens its writer) and flush and close in on_train_end.
            log_to.control = log_to.callback_handler.on_train_begin(log_to.args, log_to.state, log_to.control)
            history = self._run()
            # Every process's state ends at the last step; the round entries are logged by the main process only.
            log_to.state.global_step = log_to.state.max_steps
            # Integrations print an epoch when training ends (a notebook's progress bar calls int() on it): the rounds
            # done stand in for it there; no round entry carries it.
            log_to.state.epoch = float(len(history))
            log_to.control = log_to.callback_handler.on_train_end(log_to.args, log_to.state, log_to.control)
            return history
        finally:
            gc.unfreeze()

    def _run(self) -> list[RoundRecord]:
        args = self.args
        output_dir = Path(args.output_dir)
        resume_from = prepare_output_dir(args, self.is_main_process)
        wait_for_everyone()  # the main process may just have cleared output_dir
        if resume_from is None:
            first_round = 0
            if self.is_main_process:
                self.evaluate(round_idx=-1)
        else:
            first_round = self.load_checkpoint(resume_from) + 1
            logger.info("Resumed from %s: continuing with round %d.", resume_from, first_round)
        client_ids = list(self.client_datasets)
        self.progress = RunProgress(
            args.num_rounds, client_ids, args.local_steps, first_round, disable=not self.is_main_process
        )
        for round_idx in range(first_round, args.num_rounds):
            start = time.perf_counter()
            self._fire("on_round_begin", round_idx=round_idx)
            broadcast_bytes = state_nbytes(self.wire.sent(self.global_state))
            self.gate.open_round(self.global_state)
            updates, dropped = [], {}
            for client_index, client_id in enumerate(client_ids):
                self.progress.start_client(round_idx, client_id)
                update = self._collect(round_idx, client_index, client_id, dropped)
                self.progress.end_client()
                if update is None:
                    continue
                if update.control_delta is not None:
                    # c_i ← c_i⁺ = c_i + Δc_i, kept only with an accepted update: the server's c then stays the
                    # mean of the clients' c_i.
                    control = self.client_control(client_id)
                    self.client_controls[client_id] = {
                        key: control[key] + delta for key, delta in update.control_delta.items()
                    }
                updates.append(update)
                self._fire("on_client_end", round_idx=round_idx, update=update)
            if len(updates) < args.min_clients_per_round:
                reasons = "; ".join(f"{client_id}: {reason}" for client_id, reason in dropped.items())
                last = list_checkpoints(output_dir)
                raise NotEnoughClientsError(
                    f"Round {round_idx}: only {len(updates)} of {len(client_ids)} clients reported a valid update, "
                    f"fewer than min_clients_per_round={args.min_clients_per_round}. Dropped: {reasons}. "
                    f"The run stops; {f'the last checkpoint, {last[-1]}, is intact' if last else 'no round finished'}."
                )

            record = self._server_round(round_idx, updates, dropped, broadcast_bytes)
            record.wall_time = time.perf_counter() - start
            self.history.append(record)
            self._fire("on_round_end", record=record)
            if self.is_main_process:
                self.save_checkpoint(round_idx)  # with round-<t>/ when save_every_round, in the same atomic step
        self.progress.close()
        self.progress = None
        if self.is_main_process:
            save_adapter(self.model, self.global_state, output_dir)
            # Over PEFT's placeholder README.md, pushed or not: the folder describes its adapter (see `hub`).
            card = federated_model_card(
                self.model, args, len(self.client_datasets), self.evaluations, self.dataset_name
            )
            card.save(output_dir / "README.md")
        set_adapter_state(self.model, self.global_state)
        wait_for_everyone()
        if args.push_to_hub and self.is_main_process:
            push_to_hub(args)  # last: when the Hub fails, everything is already saved locally
        return self.history

    def _server_round(
        self, round_idx: int, updates: list[ClientUpdate], dropped: dict[str, str], broadcast_bytes: int
    ) -> RoundRecord:
        """Aggregate and evaluate, on the main process only; every other process then
        receives the new global adapter, the aggregator's state (SCAFFOLD's c steers their next local steps) and
        the round's record, so all processes leave the round identical."""
        args = self.args
        record = None
        if self.is_main_process:
            # The gate checked every value already: the aggregator checks the rest (ids, keys, shapes, result).
            self.global_state = self.aggregator.aggregate(self.global_state, updates, round_idx, check_finite=False)
            record = self._record(round_idx, updates, dropped, broadcast_bytes)
            is_last = round_idx == args.num_rounds - 1
            if is_last or (args.eval_every and (round_idx + 1) % args.eval_every == 0):
                record.evaluation = self.evaluate(round_idx)
        if self.num_processes > 1:
            self.global_state, aggregator_state, record = from_main_process(
                (self.global_state, self.aggregator.state_dict(), record)
            )
            self.aggregator.load_state_dict(aggregator_state)
        return record

    def _collect(
        self, round_idx: int, client_index: int, client_id: str, dropped: dict[str, str]
    ) -> ClientUpdate | None:
        """One client's validated update, or None after recording in `dropped` why the round goes without it."""
        update, fault, error = None, None, None
        try:
            trained = self.train_client(round_idx, client_index, client_id)
            update = self.gate.admit(client_id, lambda: self._receive(trained))
        except Exception as caught:  # any client fault costs that client its round, not the federation its run
            error = caught
            fault = describe_failure(error)
        if self.num_processes > 1:
            # Whether the client counts is the main process's call (a timeout is measured on its clock).
            main_fault = from_main_process(fault)
            if main_fault is None and fault is not None:
                raise RuntimeError(
                    f"Round {round_idx}: client {client_id!r} failed on this process but not on the main process "
                    f"({fault[1]}); the processes would diverge."
                ) from error
            fault = main_fault
        if fault is None:
            return update
        kind, reason = fault
        # The traceback only helps with an unexpected error.
        logger.warning(
            "Round %d: client %r dropped (%s): %s", round_idx, client_id, kind, reason,
            exc_info=error if kind == "error" else None,
        )
        dropped[client_id] = reason
        self._fire("on_client_dropped", round_idx=round_idx, client_id=client_id, kind=kind, reason=reason)
        return None

    def _receive(self, update: ClientUpdate) -> ClientUpdate:
        """The update as the server receives it: the server aggregates what the wire delivers (see
        `transport.WireFormat`), not the client's exact adapter."""
        payload = self.wire.encode(update.state, self.global_state)
        update.state = self.wire.decode(payload, self.global_state)
        update.wire_bytes = state_nbytes(payload)
        return update

    # Checkpoints -------------------------------------------------------------------------------------------

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore the run's state from a checkpoint after checking that it belongs to this run (same base model,
        LoRA configuration, clients and aggregator, else `CheckpointMismatchError`); returns its round."""
        checkpoint = self.restore_checkpoint(path)
        set_adapter_state(self.model, self.global_state)
        self._fire("on_resume", round_idx=checkpoint.round_idx, history=self.history, evaluations=self.evaluations)
        return checkpoint.round_idx

    def _record(
        self, round_idx: int, updates: list[ClientUpdate], dropped: dict[str, str], broadcast_bytes: int
    ) -> RoundRecord:
        return RoundRecord.from_aggregation(round_idx, self.aggregator, updates, dropped, broadcast_bytes)

    def evaluate(self, round_idx: int) -> dict[str, Any] | None:
        """Mean evaluation reward (the accuracy, for a binary reward) of the current global adapter on
        `eval_dataset`, overall and per label (None without an `eval_dataset`)."""
        if self.eval_dataset is None:
            return None
        set_adapter_state(self.model, self.global_state)
        results = evaluate_accuracy(
            self.model,
            self.processing_class,
            self.eval_dataset,
            label_column=self.args.partition_column,
            batch_size=self.args.per_device_eval_batch_size,
            max_new_tokens=self.args.max_completion_length,
            reward_funcs=self.eval_reward_funcs,
            reward_weights=self.eval_reward_weights,
        )
        release_free_memory()  # evaluation's KV caches, before the next client or the server step
        self.evaluations[round_idx] = results
        self._fire("on_evaluate_round", round_idx=round_idx, results=results)
        return results
