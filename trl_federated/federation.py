"""One federated run from the parsed arguments of `trl-federated run` (`run_federation`): the data, rewards, model
and trainer they name, checked before anything is loaded or written, then a `FederatedRunner`. The command line parses
and hands over to it; a benchmark that runs the command in process calls it without the command line."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from trl import ModelConfig

from .arguments import BenchmarkArguments, check_model_path, usage_error
from .config import FedGRPOConfig
from .core.checkpoint import prepare_output_dir
from .data import partition_clients
from .data.loading import hub_dataset_id, load_benchmark
from .data.partition import split_description
from .local.local_trainer import drop_unsupported_speedups
from .reports.hub import HubPushError
from .runner import FederatedRunner
from .runtime.devices import has_native_bf16
from .runtime.distributed import shut_down
from .runtime.models import load_model, lora_config
from .scoring.rewards import check_reward_columns, reward_functions, training_rewards
from .trainer import trainer_class

logger = logging.getLogger("trl_federated")


def cpu_time_notice(cores: int, native_bf16: bool) -> str:
    """What a run on the CPU says before it starts: how long `make demo` (examples/configs/quickstart.yaml) takes on a
    CPU like this one, with native bf16 or without, as docs/getting-started.md measured it on 2 cores, and why."""
    here = f"{cores} core{'s' if cores != 1 else ''}"
    if native_bf16:
        expected = (f"CPU run on {here} with native bf16 (AVX512-BF16 or AMX: `bf16` and `generation_dtype: auto` "
                    "resolve to bfloat16): `make demo` took 4 min 37 s on 2 cores of such a CPU")
    else:
        expected = (f"CPU run on {here} without native bf16 (no AVX512-BF16 or AMX in use: `bf16` and "
                    "`generation_dtype: auto` resolve to float32, bf16 would be emulated): `make demo` took 3 min 49 s "
                    "on 2 cores of a fast CPU limited to AVX2, and about 9 minutes is the estimate for 2 quiet cores "
                    "of a slower AVX2-only one, from its float32 speed")
    fewer = "; fewer cores or busy ones take longer" if cores < 2 else ""
    return (f"{expected} (docs/getting-started.md){fewer}; a config with more rounds, clients, local steps or "
            "completions takes longer.")


def run_federation(args: FedGRPOConfig, model_args: ModelConfig, data_args: BenchmarkArguments) -> int:
    """Federate GRPO on the configured model and benchmark, from the parsed arguments of `trl-federated run`
    (`arguments.parse_run_args`); write adapters, metrics, summary and plots. What the arguments name is refused in one
    line (`usage_error`) before `output_dir` or any loading is touched."""
    from accelerate import PartialState

    check_model_path(model_args.model_name_or_path)
    peft_config = lora_config(model_args)
    try:  # what the command line names, refused in one line before output_dir or any loading is touched
        federated_trainer = trainer_class(data_args)
        rewards = training_rewards(data_args)
        eval_rewards = reward_functions(data_args.eval_reward_funcs, "eval_reward_funcs")
    except ValueError as fault:
        usage_error(str(fault))
    drop_unsupported_speedups(federated_trainer, args)  # said once, before the model loads
    if args.use_cpu and PartialState().is_main_process:  # before the data, the model and the rounds take their time
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        logger.info(cpu_time_notice(cores, has_native_bf16(torch.device("cpu"))))
    start = time.perf_counter()
    train, test = load_benchmark(data_args)
    try:  # a reward reading a column the data lacks would fail only at the first training step; a partition that
        # cannot be drawn, before anything is written
        clients = partition_clients(train, args)  # first: it names a missing `prompt` column
        check_reward_columns(rewards, train)
        check_reward_columns(eval_rewards, test, "eval_reward_funcs")
    except ValueError as fault:
        usage_error(str(fault))
    # A taken output_dir or a missing checkpoint fails here, before the model loads; after every check of the
    # command line, so that a refused run leaves a folder `overwrite_output_dir` would clear as it was.
    prepare_output_dir(args, PartialState().is_main_process)
    model, processing_class = load_model(model_args, args)
    header = (
        f"Model `{model_args.model_name_or_path or 'SmolLM2-135M-Instruct (embedded)'}`, "
        f"{args.num_clients} clients ({split_description(args, train)}), "
        f"{args.num_rounds} rounds × {args.local_steps} local steps (W={args.reward_window}), "
        f"{data_args.algorithm.upper() if data_args.trainer_class is None else federated_trainer.__name__} locally, "
        f"aggregation `{args.aggregation}` + server `{args.server_optimizer}` (lr {args.server_learning_rate})"
        f"{'' if args.robust_aggregation == 'none' else f', robust combiner `{args.robust_aggregation}`'}; "
        f"{len(train)} train / {len(test)} test items."
    )
    # The runner's server writes summary.md and the plots after every round, and result.json at the end.
    runner = FederatedRunner(
        model, rewards, args, clients, processing_class=processing_class, peft_config=peft_config,
        eval_dataset=test, eval_reward_funcs=eval_rewards, dataset_name=hub_dataset_id(data_args), report_header=header,
        trainer_class=federated_trainer,
    )
    push_error = None
    try:
        runner.run()
    except HubPushError as error:  # the run itself finished and is saved: it still gets its result.json
        push_error = error
    if runner.is_main_process:
        summary = (Path(args.output_dir) / "summary.md").read_text(encoding="utf-8")
        print(summary)
        print(f"Finished in {time.perf_counter() - start:.0f} s; outputs in {args.output_dir}")
    shut_down()
    if push_error is not None:
        raise push_error
    return 0
