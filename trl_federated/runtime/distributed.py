"""The few collective operations a federation needs under `accelerate launch` (or `torchrun`).

Every process runs the same rounds: each client's local steps are data-parallel over the processes (TRL's
trainer wraps the shared model in DDP or DeepSpeed), so all processes end a client's round with the same adapter
and the same gathered R̄. Decisions that rest on one process's view, such as the wall clock of a deadline, and the
server step are taken on the main process and broadcast, so that no two processes can ever disagree about which
clients count or what the next global adapter is. Evaluation is shared: every process generates its share of the
batches and the per-row scores are gathered (`evaluation.evaluate_accuracy`).
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

import torch.distributed as dist
from accelerate import PartialState

T = TypeVar("T")


def num_processes() -> int:
    return PartialState().num_processes


def from_main_process(value: T) -> T:
    """The main process's `value`, on every process (pickled over the process group, CPU or GPU alike)."""
    if num_processes() == 1:
        return value
    payload: list[Any] = [value]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def wait_for_everyone() -> None:
    PartialState().wait_for_everyone()


def shut_down() -> None:
    """End the process group once every process got here. A process that exits while its peers still talk to it
    can make a rank abort at interpreter exit, so scripts launched with several processes end with this."""
    state = PartialState()
    if state.num_processes > 1 and dist.is_initialized():
        state.wait_for_everyone()
        state.destroy_process_group()


def launched_with_deepspeed() -> bool:
    """Whether `accelerate launch` started this process with DeepSpeed (its environment says so)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def check_parameters_unsharded(args=None) -> None:
    """Refuse launch modes that shard the parameters themselves (DeepSpeed ZeRO-3, FSDP), whether `accelerate launch`
    (its environment) or the training arguments (`deepspeed`, `fsdp`) ask for them: the runner reads and writes whole
    adapters between rounds, which there would need gathering it does not do yet. DDP and ZeRO-1/2 keep every
    parameter whole on every process and are supported."""
    launched_zero_3 = launched_with_deepspeed() and os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
    if launched_zero_3 or getattr(getattr(args, "deepspeed_plugin", None), "zero_stage", None) == 3:
        raise ValueError(
            "DeepSpeed ZeRO-3 shards the model's parameters, so the LoRA adapter cannot be read or loaded between "
            "rounds. Use ZeRO-2 (examples/accelerate/deepspeed_zero2.yaml) or DDP (multi_gpu.yaml)."
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or getattr(args, "fsdp", None):
        raise ValueError(
            "FSDP shards the model's parameters, so the LoRA adapter cannot be read or loaded between rounds. Use "
            "DDP (examples/accelerate/multi_gpu.yaml) or DeepSpeed ZeRO-2 (deepspeed_zero2.yaml)."
        )


def check_deepspeed_precision(args) -> None:
    """Refuse an `accelerate launch` with DeepSpeed whose mixed precision differs from the run's own. Without a
    DeepSpeed config file of its own, accelerate writes `bf16.enabled` and `fp16.enabled` from `--mixed_precision`
    (the launch config's `mixed_precision`), and transformers refuses a DeepSpeed config whose precision differs from
    the Trainer's `bf16`/`fp16`, in every client's first local step: round 0 would drop every client."""
    if not launched_with_deepspeed():
        return
    if os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none").lower() != "none":
        return  # a config file of the user's: its "auto" values follow the run, others are the user's choice
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    launched_bf16, launched_fp16 = launched in ("bf16", "fp8"), launched == "fp16"
    run_bf16, run_fp16 = bool(args.bf16 or args.bf16_full_eval), bool(args.fp16 or args.fp16_full_eval)
    if (launched_bf16, launched_fp16) != (run_bf16, run_fp16):
        run = "bf16" if run_bf16 else "fp16" if run_fp16 else "no"
        raise ValueError(
            f"`accelerate launch` gives DeepSpeed mixed precision {launched!r}, but this run trains with `bf16` "
            f"{run_bf16} and `fp16` {run_fp16}, a mismatch DeepSpeed's Trainer integration refuses. Launch with "
            f"`--mixed_precision {run}` (or set `mixed_precision: {run}` in the accelerate config), or set the run's "
            "`bf16`/`fp16` to match."
        )
