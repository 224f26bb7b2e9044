"""Where one client's local GRPO step spends CPU time and memory: generation and scoring, the loss forward, the
backward, the rest (optimizer step, callbacks), and the greedy evaluation, for the quickstart configuration.

    python benchmarks/step_profile.py --config examples/configs/quickstart.yaml [--steps 2] [--eval_rows 84] \
        [any `trl-federated run` flag: --gradient_checkpointing true, --attn_implementation eager, ...]

It builds what `trl-federated run` builds (benchmark, Dirichlet partition, embedded SmolLM2-135M, LoRA), trains the
largest client for `--steps` local steps of round 0 with the runner's own client configuration, and wraps the
trainer's methods from here (nothing in the package changes). Per phase it prints CPU seconds (`process_time`, all
threads), wall seconds and the peak resident memory reached during that phase: the kernel's high-water mark
(VmHWM), reset at the start of every phase through /proc/self/clear_refs, so each peak is that phase's own. The
first step includes one-time warm-up (allocator growth, lazy initialisation). Before the evaluation the freed heap
is handed back to the system, as the runner does after every client round.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import defaultdict
from pathlib import Path

from harness.timing import read_peak_rss_mib, reset_peak_rss


class PhaseMeter:
    """CPU seconds, wall seconds and peak RSS per phase and step; phases must not nest."""

    def __init__(self):
        self.step = 0
        self.table: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0]))

    @contextlib.contextmanager
    def phase(self, name: str):
        reset_peak_rss()
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            yield
        finally:
            row = self.table[self.step][name]
            row[0] += time.process_time() - cpu
            row[1] += time.perf_counter() - wall
            row[2] = max(row[2], read_peak_rss_mib())
            reset_peak_rss()

    def wrap(self, owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, timed)


def main(argv: list[str] | None = None) -> int:
    from transformers import TrainerCallback
    from trl import ModelConfig, TrlParser, get_peft_config

    from trl_federated.adapters import default_lora_config, with_federated_adapter
    from trl_federated.arguments import BenchmarkArguments, config_class
    from trl_federated.core.evaluation import evaluate_accuracy
    from trl_federated.data import partition_clients
    from trl_federated.data.loading import load_benchmark
    from trl_federated.local.client import local_training_args
    from trl_federated.runtime.memory import release_free_memory
    from trl_federated.runtime.models import load_model_and_tokenizer
    from trl_federated.scoring.rewards import training_rewards
    from trl_federated.trainer import FedGRPOTrainer

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--steps", type=int, default=2)
    own.add_argument("--eval_rows", type=int, default=0, help="greedy-evaluate this many test rows (0: none)")
    options, rest = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    parser = TrlParser((config_class(rest), ModelConfig, BenchmarkArguments))
    args, model_args, data_args = parser.parse_args_and_config(rest)

    meter = PhaseMeter()
    with meter.phase("setup (data, model)"):
        train, test = load_benchmark(data_args)
        clients = partition_clients(train, args)
        model, tokenizer = load_model_and_tokenizer(model_args.model_name_or_path, dtype=model_args.dtype)
        if model_args.attn_implementation:
            model.set_attn_implementation(model_args.attn_implementation)
        peft_config = get_peft_config(model_args) if model_args.use_peft else default_lora_config()
        model = with_federated_adapter(model, args.seed, peft_config)
    client_id, client_data = max(enumerate(clients), key=lambda item: len(item[1]))
    local = local_training_args(args, 0, client_id, len(clients), f"client_{client_id}")
    local.max_steps = local.local_steps = options.steps
    local.output_dir = str(Path("/tmp") / "step_profile")

    class StepPhases(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            meter.step = state.global_step + 1

    trainer = FedGRPOTrainer(
        model=model, reward_funcs=training_rewards(data_args), args=local, train_dataset=client_data,
        processing_class=tokenizer, callbacks=[StepPhases()],
    )
    meter.wrap(trainer, "_generate_and_score_completions", "generation + scoring")
    meter.wrap(trainer, "compute_loss", "loss forward")
    meter.wrap(trainer.accelerator, "backward", "backward")
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    trainer.train()
    train_cpu, train_wall = time.process_time() - start_cpu, time.perf_counter() - start_wall
    if options.eval_rows:
        release_free_memory()  # as the runner does after every client round
        meter.step = "eval"
        with meter.phase(f"greedy evaluation ({options.eval_rows} rows)"):
            evaluate_accuracy(
                model, tokenizer, test.select(range(min(options.eval_rows, len(test)))),
                label_column=args.partition_column, batch_size=args.per_device_eval_batch_size,
                max_new_tokens=args.max_completion_length,
            )

    print(f"client {client_id} ({len(client_data)} rows), {options.steps} steps of {args.per_device_train_batch_size} "
          f"completions, attention {model.config._attn_implementation}, gradient checkpointing "
          f"{args.gradient_checkpointing}; train(): {train_cpu:.1f} CPU s, {train_wall:.1f} s wall")
    print("| step | phase | CPU s | wall s | peak RSS (MiB) |")
    print("|---|---|---:|---:|---:|")
    for step, phases in meter.table.items():
        for name, (cpu, wall, peak) in phases.items():
            print(f"| {step} | {name} | {cpu:.2f} | {wall:.2f} | {peak:.0f} |")
    peak = max(row[2] for phases in meter.table.values() for row in phases.values())
    print(f"peak RSS over all phases: {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
