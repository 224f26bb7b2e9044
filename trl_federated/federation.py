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
from .runtime.devices import cpu_kind, free_cpu_threads, has_native_bf16, usable_cores
from .runtime.distributed import shut_down
from .runtime.models import load_model, lora_config
from .scoring.rewards import check_reward_columns, reward_functions, training_rewards
from .trainer import trainer_class

logger = logging.getLogger(__name__)


# `make demo`'s wall time as docs/getting-started.md measured it, by the kind of CPU (`devices.cpu_kind`), whether it
# computed bf16 natively, and its cores: a run promises a time only on a kind that was measured.
DEMO_TIMES = {
    ("Intel(R) Xeon(R) Processor", True, 2): "4 min 25 s (quiet, 2026-11-28)",
    ("AMD EPYC", True, 2): "4 min 37 s (quiet, the first benchmark, 2026-11-26)",
    ("AMD EPYC", False, 2): "from 3 min 49 s (quiet, AVX-512 turned off) to 1 h 05 min (an AVX2-only one shared with "
    "other jobs), 2026-11-27",
}


def cpu_run_notice(kind: str, cores: int, native_bf16: bool, threads: int, load: float, threads_set: bool) -> str:
    """What a run on the CPU says in one line before the data and the model load: the threads it computes with and
    why (`devices.free_cpu_threads`, or `OMP_NUM_THREADS` when set), and how long `make demo` took on this kind of
    CPU where it was measured (`DEMO_TIMES`), else that it was not."""
    bf16 = ("with native bf16 (`bf16` and `generation_dtype: auto` resolve to bfloat16)" if native_bf16 else
            "without native bf16 (`bf16` and `generation_dtype: auto` resolve to float32)")
    if threads_set:
        chosen = f"{threads} thread{'s' if threads != 1 else ''} a process, as OMP_NUM_THREADS sets"
    else:
        chosen = (f"{threads} thread{'s' if threads != 1 else ''} a process, for the cores the load average "
                  f"{load:.2f} leaves free (threads beyond them wait for each other; OMP_NUM_THREADS sets it)")
    measured = DEMO_TIMES.get((kind, native_bf16, cores))
    if measured is None:
        promise = "no `make demo` time was measured on this kind of CPU (docs/getting-started.md lists those measured)"
    else:
        promise = f"`make demo` took {measured} on {cores} cores of this kind (docs/getting-started.md)"
        if load >= 0.5:
            promise += ", and takes longer beside other jobs"
    return (f"CPU run on {cores} core{'s' if cores != 1 else ''} ({kind}) {bf16}: {chosen}; {promise}; a config "
            "with more rounds, clients, local steps or completions takes longer.")


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
    if args.use_cpu:  # before the data, the model and the rounds take their time
        state = PartialState()
        cores, load = usable_cores(), os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        threads_set = "OMP_NUM_THREADS" in os.environ
        if not threads_set:
            torch.set_num_threads(free_cpu_threads(state.num_processes, cores, load))
        if state.is_main_process:
            logger.info(cpu_run_notice(cpu_kind(), cores, has_native_bf16(torch.device("cpu")), torch.get_num_threads(),
                                       load, threads_set))
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
