"""`FederatedRunner`: rounds of local GRPO on every client (or those `fraction_train` samples), then one server
aggregation (Algorithm 1)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from accelerate import PartialState
from datasets import Dataset
from peft import PeftConfig, PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin
from trl import GRPOTrainer

from .adapters import AdapterState, freeze_lora_a, with_federated_adapter
from .aggregation import Aggregator, ClientUpdate, aggregator_from_config
from .config import FederatedConfig, FedGRPOConfig
from .core.callbacks import IntegrationLog, TrainerLogCallback
from .core.evaluation import evaluate_adapter
from .core.round_record import RoundRecord
from .core.server import FederatedServer, NotEnoughClientsError, ServerStateView
from .data.partition import check_held_out_room
from .local.client import describe_failure, load_reward_models, local_training_args, train_local_round
from .local.local_trainer import drop_unsupported_speedups, local_trainer, require_family_config
from .reports import server_reports
from .reports.summary import RunProgress
from .runtime.distributed import check_deepspeed_precision, check_parameters_unsharded, from_main_process
from .runtime.master_weights import check_float32_adapter

__all__ = ["FederatedRunner", "NotEnoughClientsError"]

logger = logging.getLogger(__name__)


class FederatedRunner(ServerStateView):
    """Simulates N clients and the server of a federated GRPO run in one process.

    The base model is loaded once and wrapped in PEFT once; clients take turns on it. For each round and client
    the server samples (every client unless `fraction_train` < 1: `sampling.sample_clients`, the Flower strategy's
    draw), the runner loads the global adapter with `set_peft_model_state_dict`, trains a fresh
    `local_trainer(trainer_class)` for `local_steps` steps on the client's data (seed
    `args.seed + round * num_clients + client_index`), and keeps only the client's adapter
    (`get_peft_model_state_dict`) and R̄. Memory therefore grows by one adapter copy per client, never by a model. The
    server side of every round (admission, aggregation, records, evaluation, checkpoints, reports) is `self.server`,
    the `server.FederatedServer` the Flower strategy drives too; the runner trains the clients and delivers their
    updates to it.

    Reliability: a client that raises, runs past `client_timeout` or reports an update that the server's
    `admission.UpdateGate` rejects (malformed, non-finite, out of range, over `update_norm_bound`) is dropped from its
    round (a `client_dropped` line in metrics.jsonl) and the round aggregates the others, if at least
    `min_clients_per_round` are left; the run stops with `NotEnoughClientsError` otherwise.
    After every round `output_dir/checkpoint-<t>` is written atomically (see `trl_federated.core.checkpoint`), and
    `run()` continues from one when `args.resume_from_checkpoint` is set, exactly as if never interrupted (under a
    quantized `transfer_dtype`, but for the clients' error-feedback residuals, `self.wire_residuals`, which are client
    memory, not server state, and start again from zero: a round's rounding is lost, nothing more).

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
            such as `answer_accuracy_reward` to report accuracy when training also rewards format or length.
        trainer_kwargs: Further `GRPOTrainer` arguments for every client's trainer (`reward_processing_classes`,
            `tools`, `rollout_func`, ...).
        trainer_class: The `GRPOTrainer` subclass every client trains with (TRL's experimental `GMPOTrainer`, or your
            own), with `local_trainer.LocalGRPOMixin` mixed in (default: `GRPOTrainer`). Give `args` of
            its config class made federated (`config.federated_config`) when it has one.
        log_to: A `Trainer` whose `state`, `log()` and callbacks report the run (the drop-in `FedGRPOTrainer`
            passes itself).
        dataset_name: The Hub id of the clients' data, named in the model card (see `trl_federated.reports.hub`).
        report_header: With a header (may be empty), `summary.md` and plots are rewritten after every round and
            `result.json` is written at the end (`trl-federated run` passes its run description); None: neither.
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
        report_header: str | None = None,
        trainer_class: type[GRPOTrainer] | None = None,
    ):
        if not isinstance(args, FederatedConfig):
            raise TypeError(f"`args` must be a FedGRPOConfig (or a `federated_config`), got {type(args).__name__}.")
        args.check_vllm()  # before the model loads
        check_parameters_unsharded(args)
        check_deepspeed_precision(args)
        # A class of no federated family, or `args` of another family, fails here, before the model loads.
        self.trainer_class = local_trainer(trainer_class or GRPOTrainer)
        require_family_config(self.trainer_class, args)
        drop_unsupported_speedups(self.trainer_class, args)
        self.args = args
        self.client_datasets = self._named_clients(client_datasets)

        if isinstance(model, str):
            from .runtime.models import load_model_and_tokenizer

            model, tokenizer = load_model_and_tokenizer(model)
            processing_class = processing_class or tokenizer
        if processing_class is None:
            from .runtime.models import load_processing_class

            processing_class = load_processing_class(model.config._name_or_path)
        self.model = model = with_federated_adapter(model, args.seed, peft_config)
        self.processing_class = processing_class
        self.reward_funcs = load_reward_models(reward_funcs, args)
        if aggregator is None:
            aggregator = aggregator_from_config(args, len(self.client_datasets))
        self.trainer_kwargs = trainer_kwargs or {}
        state = PartialState()
        self.is_main_process, self.num_processes = state.is_main_process, state.num_processes
        if log_to is None and args.report_to:
            log_to = IntegrationLog(args, model, processing_class, self.is_main_process)
        self.log_to = log_to
        callbacks = list(callbacks or [])
        if log_to is not None:
            callbacks.append(TrainerLogCallback(log_to, args.local_steps))
        if args.lora_aggregation == "freeze_a":
            freeze_lora_a(model)
        check_float32_adapter(model)
        self.progress: RunProgress | None = None  # the progress bar, while `run()` runs
        # Each client's error-feedback memory under a quantized wire (`WireFormat.encode`), by client id: the client
        # side of the simulation keeps it, as a Flower client keeps its own.
        self.wire_residuals: dict[str, AdapterState] = {}
        self._check_clients()
        if args.fraction_evaluate > 0:  # the same config file serves both paths: not refused, but said
            logger.warning(
                "`fraction_evaluate` (%s) is ignored by the in-process FederatedRunner: only the Flower deployment "
                "runs client evaluation (its evaluate round); the server's evaluation of `eval_dataset` is unaffected.",
                args.fraction_evaluate,
            )
        # The runner knows each client's D_i itself: the server counts them, not the clients.
        self.server = FederatedServer(
            model, args, aggregator, self.reward_funcs, client_datasets=self.client_datasets,
            callbacks=[*callbacks, *server_reports(args.output_dir, report_header, dataset_name)],
            processing_class=processing_class, eval_dataset=eval_dataset, eval_reward_funcs=eval_reward_funcs,
            writes_result=report_header is not None, is_main_process=self.is_main_process,
            num_processes=self.num_processes,
        )
        # π_ref of the KL term: θ^{[0]}, fixed for every client and round (see `client.train_local_round`).
        self.reference_state = self.server.global_state if args.beta != 0 else None

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
        args = self.args  # the clients against the sampling settings: `FederatedServer` (`participation_errors`)
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
        for name, dataset in self.client_datasets.items():
            check_held_out_room(len(dataset), args, name)

    # One client --------------------------------------------------------------------------------------------

    def train_client(self, round_idx: int, client_index: int, client_id: str) -> ClientUpdate:
        """Run one client's local round from the current global adapter and return its update as the client sends it
        (`client.train_local_round`: its adapter encoded for the wire, so that the server aggregates what the wire
        delivers, not the client's exact adapter).

        Raises `ClientTimeoutError` when the round, from building the trainer to its last step, took longer
        than `client_timeout` seconds; training already stops at the first step boundary past the limit.
        """
        _, extras = self.server.broadcast(client_id, client_index)
        return train_local_round(
            self.model,
            self.global_state,
            client_id,
            self.client_datasets[client_id],
            local_training_args(self.args, round_idx, client_index, len(self.client_datasets), client_id),
            self.reward_funcs,
            self.processing_class,
            callbacks=[*self.callbacks, self.progress] if self.progress is not None else self.callbacks,
            trainer_kwargs=self.trainer_kwargs,
            extras=extras,
            aggregator_class=type(self.aggregator),
            reference_state=self.reference_state,
            trainer_class=self.trainer_class,
            wire=self.server.wire,
            wire_residual=self.wire_residuals.setdefault(client_id, {}),
            evaluate=evaluate_adapter,
        )

    # Rounds ------------------------------------------------------------------------------------------------

    def run(self) -> list[RoundRecord]:
        """Run all `num_rounds` rounds (fewer when the privacy budget `dp_max_epsilon` ends the run first); save the
        final global adapter in `output_dir` (PEFT layout).

        With `args.resume_from_checkpoint` (a checkpoint folder, or "true" for the latest in `output_dir`) the
        run restores that checkpoint and goes on from the round after it. Otherwise `output_dir` must not hold
        another run, unless `args.overwrite_output_dir` (see `checkpoint.prepare_output_dir`).
        """
        # Everything alive now (the libraries, the model, the datasets) outlives the run, and `Trainer.train()` runs
        # a full `gc.collect()` for every client round, as `client.release_trainer` does: with TRL imported that is
        # ~0.2 s a collection, scanning ~400k long-lived objects. Frozen, they are skipped and a collection costs
        # microseconds.
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
        args, server = self.args, self.server
        with server.session() as first_round:  # closed however the run ends
            client_ids = list(self.client_datasets)
            progress = RunProgress(server.num_rounds, server.clients_per_round, args.local_steps, first_round,
                                   disable=not self.is_main_process)
            with progress as self.progress:
                for round_idx in range(first_round, server.num_rounds):  # fewer than configured under a privacy budget
                    for client_index in server.begin_round(round_idx):
                        client_id = client_ids[client_index]
                        self.progress.start_client(round_idx, client_id)
                        update = self._collect(round_idx, client_index, client_id)
                        self.progress.end_client()
                        if update is not None:
                            server.accept(update)
                    server.end_round()
            self.progress = None
            server.finish_run()
        return self.history

    def _collect(self, round_idx: int, client_index: int, client_id: str) -> ClientUpdate | None:
        """One client's admitted update, or None after the server dropped it from the round with the reason."""
        update, fault, error = None, None, None
        try:
            trained = self.train_client(round_idx, client_index, client_id)
            update = self.server.admit(client_id, trained)
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
        self.server.drop(client_id, *fault, error=error)
        return None
