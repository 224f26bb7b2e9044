"""Greedy accuracy of the base model on candidate reasoning-gym settings, to calibrate the benchmark's tiers.

Each candidate is one (task, generator settings) group of `--items` distinct questions, prompted exactly as the
benchmark prompts them (system message, one worked example of the same group, the question); the base model
answers greedily with the evaluation's budget (64 new tokens, stop at `</answer>`) and the task's own scorer
scores it. `--default` measures the tiers of `DEFAULT_TASKS` on `--items` questions per (task, tier) instead.

`--config` re-measures the tiers where a run is tested: the base model's greedy accuracy on the test split of a
`trl-federated run` config (its benchmark, model and evaluation settings: budget, batch, `fast_generation`), per tier
and per (task, tier), with each rate's standard error, against the tiers' targets. Other `--key value` flags go to
that config as to `trl-federated run`. With `--from_result`, the per-item scores come from a finished run's base
evaluation (round -1 of its result.json, e.g. the gate's first cell), which is this same measurement, instead of
evaluating again.

    python benchmarks/calibrate_tiers.py --items 24 --output benchmarks/results/calibration-screen.json
    python benchmarks/calibrate_tiers.py --default --items 40 --output benchmarks/results/calibration-default.json
    python benchmarks/calibrate_tiers.py --config examples/configs/grid.yaml \
        --output benchmarks/results/calibration-grid.json \
        [--from_result benchmarks/results/grid/N1-muinf/fedavg/seed0/result.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

from datasets import concatenate_datasets

from trl_federated.core.evaluation import evaluate_accuracy
from trl_federated.data import DEFAULT_TASKS, build_reasoning_benchmark
from trl_federated.runtime.models import load_model_and_tokenizer

# Candidate settings per task, from easy to hard; each is measured on its own.
CANDIDATES = {
    "chain_sum": {
        "2x1d": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        "2x2d": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2},
        "3x1d": {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1},
        "2-3x1-2d": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
        "3x2d": {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2},
    },
    "products": {
        "1dx1d": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        "1-2d": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
        "2dx2d": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2},
    },
    "gcd": {
        "max20": {"min_value": 1, "max_value": 20},
        "max50": {"min_value": 1, "max_value": 50},
        "max100": {"min_value": 1, "max_value": 100},
        "max200": {"min_value": 1, "max_value": 200},
    },
    "letter_counting": {
        "1-2w": {"min_words": 1, "max_words": 2},
        "2-3w": {"min_words": 2, "max_words": 3},
        "3-4w": {"min_words": 3, "max_words": 4},
        "5-6w": {"min_words": 5, "max_words": 6},
        "7-8w": {"min_words": 7, "max_words": 8},
    },
}


def candidate_items(tasks, items: int, seed: int):
    """`items` distinct questions per (task, label), as one dataset labelled `group` = "task/label"."""
    parts = []
    for task, levels in tasks.items():
        for label, config in levels.items():
            # One group per benchmark, so that overlapping candidates do not take each other's questions; a test
            # fraction just under 1 puts all but one item in the test split, which is the one measured.
            splits = build_reasoning_benchmark(
                {task: {label: config}}, size=items + 1, test_size=items / (items + 1), seed=seed
            )
            parts.append(splits["test"].map(lambda row: {"group": f"{task}/{label}"}))
    return concatenate_datasets(parts)


TARGETS = {"simple": 0.50, "medium": 0.25, "hard": 0.10}
"""The greedy accuracy each tier of `DEFAULT_TASKS` aims at (`trl_federated/data/reasoning_gym.py`)."""


def rates(scores: list[float], labels: list[str]) -> dict[str, dict[str, float]]:
    """Per label (and `Total`): mean score, item count and the binomial standard error of the mean."""
    groups: dict[str, list[float]] = defaultdict(list)
    for score, label in zip(scores, labels, strict=True):
        groups[label].append(score)
    groups["Total"] = list(scores)
    table = {}
    for label, values in groups.items():
        rate = sum(values) / len(values)
        table[label] = {"rate": rate, "count": len(values), "stderr": math.sqrt(rate * (1 - rate) / len(values))}
    return table


def measure_config(config: str, flags: list[str], from_result: str | None, batch_size: int | None) -> dict:
    """The base model's per-item scores on the test split of a `trl-federated run` config, by tier and by
    (task, tier): evaluated as the run evaluates its round -1 (a fresh LoRA adapter, which leaves the base model's
    outputs as they are, and the run's evaluation settings), or read from a finished run's result.json."""
    from trl_federated.adapters import with_federated_adapter
    from trl_federated.arguments import parse_run_args
    from trl_federated.data.loading import load_benchmark
    from trl_federated.runtime.models import load_model, lora_config
    from trl_federated.scoring.rewards import reward_functions

    run_args, model_args, data_args = parse_run_args(["--config", config, *flags])
    _, test = load_benchmark(data_args)
    started = time.perf_counter()
    if from_result:
        scores = json.loads(Path(from_result).read_text(encoding="utf-8"))["evaluations"]["-1"]["row_rewards"]
        if len(scores) != len(test):
            raise ValueError(f"{from_result} scored {len(scores)} items; {config}'s test split has {len(test)}.")
    else:
        model, processing_class = load_model(model_args, run_args)
        model = with_federated_adapter(model, run_args.seed, lora_config(model_args))
        scores = evaluate_accuracy(
            model, processing_class, test, label_column=run_args.partition_column,
            batch_size=batch_size or run_args.per_device_eval_batch_size,
            max_new_tokens=run_args.max_completion_length,
            reward_funcs=reward_functions(data_args.eval_reward_funcs, "eval_reward_funcs"),
            mixed_precision=run_args.mixed_precision, fast_generation=run_args.fast_generation,
            generation_dtype=run_args.generation_dtype,
        )["row_rewards"]  # fmt: skip
    tiers = rates(scores, test["difficulty"])
    return {
        "config": config, "flags": flags, "from_result": from_result, "test_items": len(test),
        "by_tier": tiers,
        "by_group": rates(scores, [f"{task}/{tier}" for task, tier in zip(test["category"], test["difficulty"])]),
        "targets": {tier: target for tier, target in TARGETS.items() if tier in tiers},
        "seconds": time.perf_counter() - started,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--items", type=int, default=24, help="Questions per candidate (or per task and tier).")
    parser.add_argument("--default", action="store_true", help="Measure DEFAULT_TASKS' tiers instead of CANDIDATES.")
    parser.add_argument("--seed", type=int, default=1, help="Generation seed (the benchmark itself uses 0).")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="Prompts generated together (default 32, or the config's per_device_eval_batch_size).")
    parser.add_argument("--config", help="Measure the base model on this run config's test split instead.")
    parser.add_argument("--from_result", help="With --config: a finished run's result.json to read the scores from.")
    parser.add_argument("--output", required=True, help="JSON file for the rates and counts.")
    args, flags = parser.parse_known_args(argv)
    if flags and not args.config:
        parser.error(f"unrecognized arguments: {' '.join(flags)} (flags for a run config need --config)")
    if args.from_result and not args.config:
        parser.error("--from_result needs --config, whose test split the scores belong to")

    if args.config:
        report = measure_config(args.config, flags, args.from_result, args.batch_size)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2), encoding="utf-8")
        for table in (report["by_tier"], report["by_group"]):
            for label, rate in table.items():
                target = f"  (target {100 * TARGETS[label]:.0f}%)" if label in TARGETS else ""
                print(f"{label:28s} {100 * rate['rate']:6.1f}% ± {100 * rate['stderr']:.1f}  "
                      f"(n={rate['count']}){target}")
        return 0

    dataset = candidate_items(DEFAULT_TASKS if args.default else CANDIDATES, args.items, args.seed)
    model, tokenizer = load_model_and_tokenizer()
    started = time.perf_counter()
    batch_size = args.batch_size or 32
    by_group = evaluate_accuracy(model, tokenizer, dataset, label_column="group", batch_size=batch_size)
    report = {"items_per_group": args.items, "seed": args.seed, "default": args.default, "by_group": by_group}
    if args.default:
        report["by_tier"] = evaluate_accuracy(
            model, tokenizer, dataset, label_column="difficulty", batch_size=batch_size
        )
    report["seconds"] = time.perf_counter() - started
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2), encoding="utf-8")
    for group, accuracy in by_group["accuracy"].items():
        print(f"{group:28s} {100 * accuracy:6.1f}%  (n={by_group['count'][group]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
