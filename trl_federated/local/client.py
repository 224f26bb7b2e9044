"""One client's local round (Algorithm 1, lines 4-18), shared by `FederatedRunner` and the Flower `ClientApp`.

Whatever the transport, a client round is the same: load the global adapter into the client's `PeftModel`, train
a fresh `local_trainer(trainer_class)` (`GRPOTrainer` by default) for `local_steps` steps on the client's data with the
seed of (round, client), with what the aggregation exchanges besides the adapter (`Aggregator.client_hook`), and
report a `ClientUpdate` as it goes on the wire. Keeping it in one function is what lets a Flower run end where the
in-process runner ends.
"""

from __future__ import annotations

import copy
import gc
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from accelerate.state import AcceleratorState
from datasets import Dataset
from peft import PeftModel
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase, TrainerCallback
from transformers.trainer_callback import PrinterCallback
from transformers.trainer_utils import IntervalStrategy
from trl import GRPOTrainer

from ..adapters import AdapterState, InvalidUpdateError, set_adapter_state
from ..aggregation import AGGREGATIONS, Aggregator, ClientUpdate
from ..config import FedGRPOConfig
from ..data.partition import held_out_split
from ..runtime.master_weights import read_master_state, write_master_state
from ..runtime.memory import ReleaseFreeMemory, release_free_memory
from ..runtime.vllm_server import reuse_vllm_client
from ..scoring.rewards import combined_reward_range
from ..wire import WireFormat
from .local_trainer import Deadline, LocalGRPOMixin, local_trainer
from .record_privacy import RecordPrivacyMixin, private_update


class ClientTimeoutError(TimeoutError):
    """A client's local round took longer than `client_timeout`; its update is dropped."""


# How a dropped client's fault is labelled in metrics.jsonl; any other exception is an "error".
_FAILURE_KINDS = ((ClientTimeoutError, "timeout"), (InvalidUpdateError, "invalid_update"))


def describe_failure(error: Exception) -> tuple[str, str]:
    """(kind, reason) of a client round that failed with `error`: kind is "timeout", "invalid_update" or "error";
    the reason of an unexpected "error" names the exception type."""
    kind = next((kind for error_type, kind in _FAILURE_KINDS if isinstance(error, error_type)), "error")
    return kind, str(error) if kind != "error" else f"{type(error).__name__}: {error}"


def local_training_args(
    args: FedGRPOConfig, round_idx: int, client_index: int, num_clients: int, client_id: str
) -> FedGRPOConfig:
    """The local-training configuration of one client in one round: `local_steps` steps at their place in the
    federation's learning-rate schedule, the seed `args.seed + round_idx * num_clients + client_index`, a log
    entry every step (R̄ is read from it), and no checkpoints or reports of its own (the server logs and saves the
    federation)."""
    local = copy.deepcopy(args)  # dataclasses.replace fails on TRL's GRPOConfig
    local.num_clients = 1  # a client trains; it does not federate again
    local.federation_round = round_idx
    local.max_steps = args.local_steps
    local.seed = args.seed + round_idx * num_clients + client_index
    local.logging_strategy = IntervalStrategy.STEPS
    local.logging_steps = 1
    local.output_dir = os.path.join(args.output_dir, "clients", client_id)
    local.save_strategy = IntervalStrategy.NO
    local.eval_strategy = IntervalStrategy.NO
    local.report_to = []
    local.disable_tqdm = True
    local.push_to_hub = False
    return local


def load_reward_models(reward_funcs, args: FedGRPOConfig) -> list:
    """`reward_funcs` as a list, with every reward model given by Hub id or local path loaded now, as `GRPOTrainer`
    loads one (`AutoModelForSequenceClassification`, `num_labels=1`, `model_init_kwargs`, `trust_remote_code`).

    A trainer given an id loads the model itself, and every client round builds a fresh trainer: loaded once here,
    one instance serves every client and round.
    """
    if reward_funcs is None:
        return []
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    model_kwargs = {"trust_remote_code": args.trust_remote_code, **(args.model_init_kwargs or {})}
    return [
        AutoModelForSequenceClassification.from_pretrained(func, num_labels=1, **model_kwargs)
        if isinstance(func, str)
        else func
        for func in funcs
    ]


def train_local_round(
    model: PeftModel,
    global_state: AdapterState,
    client_id: str,
    train_dataset: Dataset,
    args: FedGRPOConfig,
    reward_funcs,
    processing_class: PreTrainedTokenizerBase,
    callbacks: list | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    extras: dict[str, AdapterState] | None = None,
    aggregator_class: type[Aggregator] | None = None,
    reference_state: AdapterState | None = None,
    trainer_class: type[GRPOTrainer] | None = None,
    wire: WireFormat | None = None,
    wire_residual: AdapterState | None = None,
    evaluate: Callable[..., dict[str, Any]] | None = None,
) -> ClientUpdate:
    """Run one client's local round from `global_state` and return its update as the client sends it: its adapter
    encoded for the wire, and its extras.

    Args:
        model: The client's `PeftModel`; its active adapter is overwritten with `global_state` first.
        global_state: The global adapter θ^{[t]}.
        client_id: Stable name of the client, reported in the update.
        train_dataset: The client's private training set (its rows D_i); under `rpg_signal="held-out"` the round sets
            its held-out slice aside from it (`data.partition.held_out_split`).
        args: The client's local configuration (`local_training_args`).
        reward_funcs, processing_class, callbacks, trainer_kwargs: As for `GRPOTrainer`.
        extras: What the server sent besides the adapter (`Aggregator.client_extras`: SCAFFOLD's c and c_i). The
            aggregation's `client_hook` trains with them, and the update carries its reply in `extras`.
        aggregator_class: The aggregation whose `client_hook` that is (default: the one `args.aggregation` names).
        reference_state: With `beta > 0`: θ^{[0]}, the adapter the federation started from, which is π_ref in every
            round. TRL's trainer copies the adapter it is built with (θ^{[t]}) into its `ref` adapter; this state
            overwrites that copy. None: π_ref is the base model (adapters disabled), which equals θ^{[0]} for a
            freshly initialised LoRA.
        trainer_class: The `GRPOTrainer` subclass that trains the round, with `local_trainer.LocalGRPOMixin`
            (default: `FedGRPOTrainer`).
        wire: The wire format the adapter is sent in (`wire.WireFormat.encode`; default: all of it, in float32).
        wire_residual: The client's own error-feedback memory for a quantized `wire` (`WireFormat.encode`), which the
            round updates; it never leaves the client. None: none kept (each round's rounding is then lost).
        evaluate: Under `rpg_signal="held-out"`: the greedy evaluation that measures R̄ on the client's held-out
            slice (`data.partition.held_out_split`) after its local steps, `evaluation.evaluate_adapter`'s signature
            (the transports pass that one: the client side does not import the server core).

    Raises `ClientTimeoutError` when the round, from loading the adapter to its last step, took longer than
    `args.client_timeout` seconds; training already stops at the first step boundary past the limit.
    """
    started, began = time.perf_counter(), time.time()
    train_rows, held_out = held_out_split(train_dataset, args, client_id)
    if held_out is not None and evaluate is None:
        raise ValueError("`rpg_signal='held-out'` measures R̄ by greedy evaluation: pass `evaluate`.")
    if args.beta != 0 and REFERENCE_ADAPTER in model.peft_config:
        raise ValueError(
            f"The model already has an adapter named {REFERENCE_ADAPTER!r}, which TRL reserves for the KL reference "
            "when `beta` != 0: rename that adapter, or set `beta: 0`."
        )
    set_adapter_state(model, global_state)
    if args.deepspeed_plugin is not None:
        # Each trainer hands its DeepSpeed plugin to a new `Accelerator`, which accelerate refuses once a DeepSpeed
        # state exists in the process (the previous client round's): each round's trainer starts from a fresh one,
        # as `Trainer` does for the trials of a hyperparameter search.
        AcceleratorState._reset_state()
    trainer, patches = None, module_patches(model)
    try:
        with reuse_vllm_client():  # vLLM server mode: one client and weight-sync group per process (`vllm_server`)
            trainer = local_trainer(trainer_class or GRPOTrainer, args)(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_rows,
                processing_class=processing_class,
                # First: the callbacks that read the adapter when training begins (FedProx, SCAFFOLD) find θ^{[t]}.
                callbacks=[LoadMasterWeights(global_state), *(callbacks or [])],
                **(trainer_kwargs or {}),
            )
        if args.beta != 0:
            # π_ref stays θ^{[0]} in every round (see `reference_state`), not the θ^{[t]} TRL just copied.
            if reference_state is None:
                model.delete_adapter(REFERENCE_ADAPTER)
            else:
                set_adapter_state(model, reference_state, adapter_name=REFERENCE_ADAPTER)
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(ReleaseFreeMemory())
        if args.client_timeout is not None:
            trainer.add_callback(Deadline(started + args.client_timeout))
        hook = (aggregator_class or AGGREGATIONS[args.aggregation].aggregator_class).client_hook(extras or {}, args)
        if hook is not None:
            trainer.add_callback(hook.callback)
        start = time.perf_counter()
        output = trainer.train()
        elapsed = time.perf_counter() - started
        if args.client_timeout is not None and elapsed > args.client_timeout:
            raise ClientTimeoutError(
                f"client {client_id!r} took {elapsed:.1f} s, over client_timeout={args.client_timeout} s "
                f"(stopped after {trainer.state.global_step} of {args.local_steps} local steps)"
            )
        train_seconds, reward, signal_metrics = time.perf_counter() - start, trainer.window_reward(), {}
        local_state = read_master_state(model)
        if held_out is not None:  # R̄: the local model's greedy mean reward on the same rows every round
            measured = time.perf_counter()
            scored = evaluate(model, local_state, processing_class, held_out, args, reward_funcs, args.reward_weights)
            reward = statistics.fmean(scored["row_rewards"])
            signal_metrics = {"signal_seconds": time.perf_counter() - measured}
        update = ClientUpdate(
            client_id=client_id,
            state=(wire or WireFormat()).encode(local_state, global_state, wire_residual),
            num_samples=len(train_dataset),  # D_i: the client's rows, its held-out slice included
            reward=reward,
            metrics={
                "step_rewards": trainer.step_rewards,
                "train_loss": output.training_loss,
                "train_seconds": train_seconds,
                **signal_metrics,
                # When the round ran, in Unix seconds: clients training in parallel overlap (a list, so that round
                # logs, which average a round's scalar metrics, leave it out).
                "wall_clock": [began, time.time()],
                **trainer.mean_step_metrics(),
            },
        )
        if hook is not None:
            update.extras = hook.reply()
        if isinstance(trainer, RecordPrivacyMixin):
            update = private_update(update, trainer, combined_reward_range(reward_funcs, args.reward_weights))
    finally:
        release_trainer(model, trainer, drop_reference=args.beta != 0)
        restore_module_patches(model, patches)
    return update


class LoadMasterWeights(TrainerCallback):
    """Loads the global adapter into the values the optimizer steps (`master_weights`) once the engine is built.

    The adapter is loaded into the model before the trainer is built too, but an engine that keeps float32 copies
    makes them from the module: DeepSpeed with bf16 first casts the module, so its copies would start from the
    bf16-rounded adapter. A trainable parameter with no float32 values at all is refused here, before any step.
    """

    def __init__(self, adapter: AdapterState):
        self.adapter = adapter

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        write_master_state(model, self.adapter)


# What a client round patches onto the modules of the shared model. Attributes set on the instance: `forward` and the
# forward it wrapped, by TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`, in every GRPOTrainer's
# constructor) and accelerate's mixed-precision wrapper; transformers' flag that its output-capturing hooks are
# installed. Hooks, in the module's hook dicts: the input-grad hook of gradient checkpointing
# (`enable_input_require_grads`, several per trainer), TRL's fp32 LM-head casts, the output-capturing hooks.
_INSTANCE_ATTRIBUTES = ("forward", "_original_forward", "_output_capturing_hooks_installed")
_HOOK_DICTS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
)


def module_patches(model: PeftModel) -> dict[str, dict[str, Any]]:
    """What each module of `model` holds on the instance that a client round may patch, by module name: the
    attributes of `_INSTANCE_ATTRIBUTES` it has and a copy of every forward/backward hook dict."""
    return {
        name: {
            **{attribute: vars(module)[attribute] for attribute in _INSTANCE_ATTRIBUTES if attribute in vars(module)},
            **{hooks: dict(getattr(module, hooks)) for hooks in _HOOK_DICTS},
        }
        for name, module in model.named_modules()
    }


def restore_module_patches(model: PeftModel, patches: dict[str, dict[str, Any]]) -> None:
    """Leave the shared model's modules as `module_patches` found them before a client round: its trainer's forward
    wrappers undone, every hook added since removed (with the flag of the hooks that install themselves once, so
    that they install again).

    Each GRPOTrainer wraps the forward it finds and adds its hooks, so without this the forward of client-round k would
    run through k nested wrappers and 3k input-grad hooks: every step slower, and Python's recursion limit reached
    near a thousand client-rounds.
    """
    for name, module in model.named_modules():
        before = patches.get(name, {})
        for attribute in _INSTANCE_ATTRIBUTES:
            if attribute in before:
                setattr(module, attribute, before[attribute])
            elif attribute in vars(module):
                delattr(module, attribute)
        for hooks in _HOOK_DICTS:
            current = getattr(module, hooks)
            for handle_id in [handle_id for handle_id in current if handle_id not in before.get(hooks, {})]:
                del current[handle_id]


# The adapter TRL adds to a PeftModel for the KL reference when beta != 0 (GRPOTrainer.__init__).
REFERENCE_ADAPTER = "ref"


def release_trainer(model: PeftModel, trainer: LocalGRPOMixin | None, drop_reference: bool = True) -> None:
    """Drop everything a finished (or failed) client trainer holds (optimizer state and, with `drop_reference`,
    the `ref` adapter TRL added for its KL term) so that memory stays flat in the number of clients. A `ref`
    adapter of the user's own (a run with beta = 0) is left alone. A vLLM client stays open for the next client's
    trainer (`vllm_server.reuse_vllm_client`)."""
    if drop_reference and REFERENCE_ADAPTER in model.peft_config:
        model.delete_adapter(REFERENCE_ADAPTER)
        model.set_adapter("default")
    if trainer is not None:
        trainer.accelerator.free_memory()
    del trainer
    gc.collect()
    release_free_memory()
