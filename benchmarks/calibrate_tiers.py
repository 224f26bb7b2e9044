"""Greedy accuracy of the base model on candidate reasoning-gym settings, to calibrate the benchmark's tiers.

Each candidate is one (task, generator settings) group of `--items` distinct questions, prompted exactly as the
benchmark prompts them (system message, one worked example of the same group, the question); the base model
answers greedily with the evaluation's budget (64 new tokens, stop at `</answer>`) and the task's own scorer
scores it. `--default` measures the tiers of `DEFAULT_TASKS` on `--items` questions per (task, tier) instead.

    python benchmarks/calibrate_tiers.py --items 24 --output benchmarks/results/calibration-screen.json
    python benchmarks/calibrate_tiers.py --default --items 40 --output benchmarks/results/calibration-default.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from datasets import concatenate_datasets

from trl_federated.data import DEFAULT_TASKS, build_reasoning_benchmark
from trl_federated.evaluation import evaluate_accuracy
from trl_federated.models import load_model_and_tokenizer

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=24, help="Questions per candidate (or per task and tier).")
    parser.add_argument("--default", action="store_true", help="Measure DEFAULT_TASKS' tiers instead of CANDIDATES.")
    parser.add_argument("--seed", type=int, default=1, help="Generation seed (the benchmark itself uses 0).")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--output", required=True, help="JSON file for the rates and counts.")
    args = parser.parse_args(argv)

    dataset = candidate_items(DEFAULT_TASKS if args.default else CANDIDATES, args.items, args.seed)
    model, tokenizer = load_model_and_tokenizer()
    started = time.perf_counter()
    by_group = evaluate_accuracy(model, tokenizer, dataset, label_column="group", batch_size=args.batch_size)
    report = {"items_per_group": args.items, "seed": args.seed, "default": args.default, "by_group": by_group}
    if args.default:
        report["by_tier"] = evaluate_accuracy(
            model, tokenizer, dataset, label_column="difficulty", batch_size=args.batch_size
        )
    report["seconds"] = time.perf_counter() - started
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2), encoding="utf-8")
    for group, accuracy in by_group["accuracy"].items():
        print(f"{group:28s} {100 * accuracy:6.1f}%  (n={by_group['count'][group]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
