"""Which server step lets FGRPO learn? Every design at the grid's budget, read round by round on a validation slice.

Each design is FGRPO's RPG weighting with one server optimizer (`methods.METHODS`: `fgrpo-paper` (the paper's
literal Adam), `fgrpo-fedadam`, `fgrpo-adam-norm`, `fgrpo-nesterov`, `fgrpo-sgd` (FGRPO's default, chosen here)),
beside `fedavg`; each (design, seed) is a cell as the verdict grid runs them (`benchmarks/verdict.py`: the grid's
budget, `examples/configs/grid.yaml`), in a folder of its own (`benchmarks/results/server-step`; `fgrpo-paper` and
`fedavg` there rerun the grid's committed cells,
which also checks that a cell is reproducible), so the chosen design's cells count as grid cells. After a
cell finishes, every round's global adapter (`round-<t>/`) is evaluated greedily on a validation slice carved from
the training items (`validation_slice`: `--per_group` items of each task × tier group, the first in the training
split's seeded order, the same for every design; the test split the verdict reads is never used here), into the
cell's `validation.json`, per task; the base model once, into the grid folder's `validation-base.json`. The report
(`report.md` in that folder) tabulates per design and round: validation accuracy on the arithmetic tasks
(chain_sum, products), on the others (gcd, letter_counting) and in total; the clients' mean token entropy and share
of GRPO groups with equal rewards; the server step's ratio to ‖Δ‖, cos(s, Δ), cos(s, s^{[t-1]}) and its norm over
LoRA A and B. A cell's first round draws the same client updates for every design of a seed (same partition, same
initial adapter, one thread), so the designs part from the first server step on.

    python benchmarks/server_step.py [--designs fgrpo-adam-norm fedavg ...] [--seeds 0] [--per_group 16] [--commit]
        [--report_only]

Run it with one thread per cell (`OMP_NUM_THREADS=1`, as the grid's cells): the cells are then reproducible.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

from harness.cells import BUDGET_FILE
from harness.grid import DEFAULT_CONFIG, check_budget, commit, committed_files, run_cells
from trl_federated.core.callbacks import read_metrics
from trl_federated.reports.compare import Cell, cell_command

DESIGNS = ["fgrpo-adam-norm", "fedavg", "fgrpo-sgd", "fgrpo-fedadam", "fgrpo-nesterov", "fgrpo-paper"]
VALIDATION_FILE = "validation.json"
BASE_VALIDATION_FILE = "validation-base.json"
DEFAULT_OUTPUT_DIR = "benchmarks/results/server-step"
REPORT_FILE = "report.md"
ARITHMETIC = ("chain_sum", "products")
# A client whose update is under this fraction of the round's largest is idle: every GRPO group it drew scored alike,
# so it sent back the adapter it received, and its RPG weight only shortens Δ.
IDLE_FRACTION = 0.01


def validation_slice(train, per_group: int):
    """`per_group` items of each (category, difficulty) group of the training split, the first in its (seeded,
    shuffled) order: the same items for every cell of a budget, held out of nothing, chosen before any result."""
    taken: dict[tuple[str, str], int] = {}
    indices = []
    for index, (category, difficulty) in enumerate(zip(train["category"], train["difficulty"])):
        if taken.get((category, difficulty), 0) < per_group:
            taken[(category, difficulty)] = taken.get((category, difficulty), 0) + 1
            indices.append(index)
    return train.select(indices)


def evaluate_rounds(config: str, directory: Path | None, output: Path, per_group: int) -> None:
    """Evaluate on the validation slice the base model (`directory` None) or every `round-<t>/` adapter of the cell
    `directory`, per task, into `output` ({round: evaluation}); rounds already in `output` are kept."""
    from peft.utils import load_peft_weights

    from trl_federated.adapters import set_adapter_state, with_federated_adapter
    from trl_federated.arguments import parse_run_args
    from trl_federated.core.evaluation import evaluate_accuracy, to_training_device
    from trl_federated.data.loading import load_benchmark
    from trl_federated.runtime.models import load_model, lora_config
    from trl_federated.scoring.rewards import reward_functions

    args, model_args, data_args = parse_run_args(["--config", config])
    train, _ = load_benchmark(data_args)
    items = validation_slice(train, per_group)
    model, tokenizer = load_model(model_args, args)
    model = with_federated_adapter(model, args.seed, lora_config(model_args))
    to_training_device(model, args)
    results = json.loads(output.read_text(encoding="utf-8")) if output.exists() else {}
    rounds = ([-1] if directory is None else
              sorted(int(path.name.split("-")[1]) for path in directory.glob("round-*") if path.is_dir()))
    for round_idx in rounds:
        if str(round_idx) in results:
            continue
        if directory is not None:
            set_adapter_state(model, load_peft_weights(str(directory / f"round-{round_idx}")))
        evaluation = evaluate_accuracy(
            model, tokenizer, items, label_column="category", batch_size=args.per_device_eval_batch_size,
            max_new_tokens=args.max_completion_length, reward_funcs=reward_functions(data_args.eval_reward_funcs),
            fast_generation=args.fast_generation, generation_dtype=args.generation_dtype,
            mixed_precision=args.mixed_precision,
        )
        results[str(round_idx)] = {"accuracy": evaluation["accuracy"], "count": evaluation["count"],
                                   "seconds": evaluation["seconds"]}
        output.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        print(f"[server_step] {output.parent.name} round {round_idx}: {evaluation['accuracy']}", flush=True)


def split_accuracy(evaluation: dict) -> dict[str, float]:
    """Validation accuracy (%) on the arithmetic tasks, the others and in total, weighted by items."""
    accuracy, count = evaluation["accuracy"], evaluation["count"]
    tasks = [task for task in count if task != "Total"]

    def pooled(names):
        items = sum(count[name] for name in names)
        return 100 * sum(accuracy[name] * count[name] for name in names) / items if items else math.nan

    return {"arith": pooled([t for t in tasks if t in ARITHMETIC]), "other": pooled([t for t in tasks if t not in
            ARITHMETIC]), "total": 100 * accuracy["Total"]}


def round_rows(directory: Path) -> dict[int, dict[str, float]]:
    """Per round of a cell: the clients' mean entropy and equal-reward share, the weight RPG gave to idle clients
    (an update under `IDLE_FRACTION` of the round's largest: all their groups scored alike) with ‖Δ‖ over the clients'
    mean ‖θ_i − θ‖, and the server step's diagnostics."""
    rows = {}
    for record in read_metrics(directory / "metrics.jsonl"):
        if record.get("event") != "round":
            continue
        clients = list((record.get("client_metrics") or {}).values())

        def mean(name, clients=clients):
            values = [metrics[name] for metrics in clients if metrics.get(name) is not None]
            return statistics.fmean(values) if values else math.nan

        weights, norms = record.get("weights") or {}, record.get("update_norms") or {}
        largest = max(norms.values(), default=0.0)
        idle = [client for client, norm in norms.items() if norm <= IDLE_FRACTION * largest]
        mean_norm = statistics.fmean(norms.values()) if norms else 0.0  # 0 when every client's groups scored alike
        rows[record["round_idx"]] = {
            "idle_weight": sum(weights.get(client, 0.0) for client in idle) if norms else math.nan,
            "delta_share": record["delta_norm"] / mean_norm if mean_norm > 0 else math.nan,
            "entropy": mean("entropy"), "equal": mean("frac_reward_zero_std"),
            "ratio": record.get("server_step_ratio"), "cos": record.get("server_step_cosine"),
            "cos_prev": record.get("server_step_momentum_cosine"), "norm_a": record.get("server_step_norm_a"),
            "norm_b": record.get("server_step_norm_b"), "reward": statistics.fmean(record["rewards"].values()),
        }
    return rows


def _cell(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:.2e}"  # a step over a Δ of ~0: 1.76e+06


def write_report(root: Path, cells: list[Cell], command: str) -> str:
    base_path = root / BASE_VALIDATION_FILE
    base = json.loads(base_path.read_text(encoding="utf-8")).get("-1") if base_path.exists() else None
    lines = [
        "# Server step designs at the grid's budget",
        "",
        f"`{command}`; cells in `{root}`. Validation: the slice of the training items `validation_slice` takes "
        "(never the test split). Per round t: validation accuracy (%) of the global adapter after round t on the "
        "arithmetic tasks, the others and in total; mean client R̄; the clients' mean token entropy and share of GRPO "
        "groups whose rewards were all equal; the weight of idle clients (update under 1% of the round's "
        "largest) and ‖Δ‖ over the clients' mean update norm; server step s: ‖s‖/‖Δ‖, cos(s, Δ), cos(s, s_prev), "
        "‖s‖ over LoRA A and B.",
        "",
    ]
    if base is not None:
        split = split_accuracy(base)
        lines += [f"Base model: arithmetic {split['arith']:.1f}, other {split['other']:.1f}, total "
                  f"{split['total']:.1f} ({base['count']['Total']} items).", ""]
    header = ("| design | seed | t | arith | other | total | R̄ | entropy | equal | idle ω | ‖Δ‖/‖u‖ | ‖s‖/‖Δ‖ | "
              "cos(s,Δ) | cos(s,s₋₁) | ‖s_A‖ | ‖s_B‖ |")
    lines += [header, "|" + "---|" * 16]
    for cell in cells:
        directory = cell.directory(root)
        if not (directory / "metrics.jsonl").exists():
            continue
        validation_path = directory / VALIDATION_FILE
        validation = json.loads(validation_path.read_text(encoding="utf-8")) if validation_path.exists() else {}
        for round_idx, row in sorted(round_rows(directory).items()):
            split = split_accuracy(validation[str(round_idx)]) if str(round_idx) in validation else {}
            lines.append(
                f"| {cell.method} | {cell.seed} | {round_idx} | {_cell(split.get('arith'), 1)} | "
                f"{_cell(split.get('other'), 1)} | {_cell(split.get('total'), 1)} | {_cell(row['reward'])} | "
                f"{_cell(row['entropy'])} | {_cell(row['equal'])} | {_cell(row['idle_weight'])} | "
                f"{_cell(row['delta_share'])} | {_cell(row['ratio'])} | {_cell(row['cos'])} | "
                f"{_cell(row['cos_prev'])} | {_cell(row['norm_a'], 3)} | {_cell(row['norm_b'], 3)} |"
            )
    text = "\n".join(lines) + "\n"
    (root / REPORT_FILE).write_text(text, encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--output_dir", default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--designs", nargs="+", default=DESIGNS, choices=DESIGNS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--per_group", type=int, default=16, help="Validation items per task × tier group.")
    parser.add_argument("--commit", action="store_true", help="Commit each finished cell's files and the report.")
    parser.add_argument("--report_only", action="store_true")
    parser.add_argument("--evaluate", nargs="?", const="", default=None, help=argparse.SUPPRESS)  # internal
    args = parser.parse_args(argv)
    root = Path(args.output_dir)
    if args.evaluate is not None:  # one evaluation pass in its own process (the model loads once per pass)
        directory = Path(args.evaluate) if args.evaluate else None
        output = directory / VALIDATION_FILE if directory else root / BASE_VALIDATION_FILE
        evaluate_rounds(args.config, directory, output, args.per_group)
        return 0
    cells = [Cell(design, seed, 3, "0.05") for seed in args.seeds for design in args.designs]
    command = "python benchmarks/server_step.py " + " ".join(arg for arg in argv if arg != "--report_only")
    if not args.report_only:
        check_budget(root, args.config, [])
        me = [sys.executable, __file__, "--config", args.config, "--output_dir", str(root),
              "--per_group", str(args.per_group), "--evaluate"]
        if not (root / BASE_VALIDATION_FILE).exists():
            subprocess.run(me, check=True)
        for cell in cells:
            directory = cell.directory(root)
            failures = run_cells(
                [cell], root, lambda cell: cell_command(cell, args.config, root, ["--eval_initial", "false"])
            )
            if failures:
                return 1
            subprocess.run([*me, str(directory)], check=True)
            write_report(root, cells, command.strip())
            if args.commit:
                shared = (BASE_VALIDATION_FILE, REPORT_FILE, BUDGET_FILE)
                files = [*committed_files(directory), *(root / name for name in shared)]
                commit(files, f"server step: {cell.method} seed {cell.seed} finished")
    print(write_report(root, cells, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
