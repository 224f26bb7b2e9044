"""The gate before the grid: does GRPO learn at the grid's budget? Centralised GRPO and FedAvg, each against the base
model, with a paired test over the test items.

Two cells of the grid's config (`examples/configs/grid.yaml`), seed 0, run and resumed by the grid's harness
(`benchmarks/harness/grid.py`: skipped when finished, resumed from their last round checkpoint, `--parallel`,
`--commit`), in the grid's folder by default:

- centralised GRPO: one client holding all the training data (`num_clients` 1, `dirichlet_alpha` inf), with the
  grid's rounds and local steps, so it takes as many local steps as each federated client (rounds × local steps,
  with its local AdamW restarted every round as every client's is) and differs from FedAvg only in that nothing is
  split or averaged; its server step (FedAvg's SGD at 1.0 over one client) hands the client's adapter on unchanged;
- FedAvg: the grid's own FedAvg cell of that seed (same folder, same budget: the grid skips it once it is done).

Each final adapter's greedy evaluation is paired item by item with the base model's (round -1, `row_rewards`): the
gain in points with the 95% t-interval of the per-item differences (scipy), the paired t-test's p-value, and
McNemar's exact test on the items that changed (scipy's binomial test). A run PASSes when both resolve a gain: the
interval lies above 0 and McNemar's p < 0.05. If either FAILs, change the budget (a new config, in a new
`--output_dir`: the folder's `budget.json` refuses another budget) and rerun; keep each attempt's folder as the trail.

    python benchmarks/gate.py [--config examples/configs/grid.yaml] [--output_dir benchmarks/results/grid]
        [--seed 0] [--parallel 2] [--commit] [--report_only] [--key value ...]   # unknown flags go to both cells
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.cells import BUDGET_FILE, finished_results
from harness.grid import BudgetError, add_run_arguments, run_grid
from harness.significance import p_text, paired_gain
from trl_federated.reports.compare import Cell, markdown

LEVEL = 0.05  # both tests at 5%: the 95% interval above 0, McNemar's two-sided p below 0.05
BUDGET_KEYS = (
    "num_clients",
    "dirichlet_alpha",
    "num_rounds",
    "local_steps",
    "reward_window",
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler_type",
    "benchmark_size",
    "max_completion_length",
)


def gate_cells(seed: int, num_clients: int, dirichlet_alpha: str) -> dict[str, Cell]:
    """The gate's runs: centralised GRPO first (the cheaper cell, which evaluates the base model), then FedAvg."""
    return {
        "centralised GRPO": Cell("fedavg", seed, 1, "inf"),
        "FedAvg": Cell("fedavg", seed, num_clients, dirichlet_alpha),
    }


def run_record(result: dict) -> dict:
    """A finished cell's paired gain over the base model (total), with its hard-tier gain."""
    evaluations = result["evaluations"]
    base, final = evaluations["-1"], evaluations[max(evaluations, key=int)]
    if "row_rewards" not in base or "row_rewards" not in final:
        raise ValueError("An evaluation without `row_rewards` (made before they were recorded) cannot be paired.")
    record = paired_gain(base["row_rewards"], final["row_rewards"], 1 - LEVEL)
    if "hard" in base["accuracy"] and "hard" in final["accuracy"]:
        record["hard_gain"] = 100 * (final["accuracy"]["hard"] - base["accuracy"]["hard"])
    return record


def write_report(
    records: dict[str, dict | None], cells: dict[str, Cell], root: Path, config: str, command: str
) -> tuple[str, str]:
    """gate.md and gate.json; returns the report and the status (PASS, FAIL or PENDING)."""
    budget_path = root / BUDGET_FILE
    budget = json.loads(budget_path.read_text(encoding="utf-8")) if budget_path.exists() else {"config": {}}
    budget_line = ", ".join(f"{key} {budget['config'][key]}" for key in BUDGET_KEYS if key in budget["config"])
    if budget.get("flags"):
        budget_line += f"; flags over it: {' '.join(budget['flags'])}"
    finished = {name: record for name, record in records.items() if record is not None}
    if len(finished) < len(records):
        status = "PENDING"
    else:
        status = "PASS" if all(record["passed"] for record in finished.values()) else "FAIL"
    header = [
        "Run",
        "Cell",
        "Items",
        "Base",
        "Final",
        "Gain [95% CI]",
        "Paired t p",
        "Improved / worsened",
        "McNemar exact p",
        "Hard gain",
        "Verdict",
    ]
    rows = []
    for name, cell in cells.items():
        record = records[name]
        if record is None:
            rows.append([name, f"{cell.setting} {cell.method} seed {cell.seed}", *["—"] * 8, "not finished"])
            continue
        hard = record.get("hard_gain")
        rows.append(
            [
                name,
                f"{cell.setting} {cell.method} seed {cell.seed}",
                str(record["items"]),
                f"{record['base']:.2f}",
                f"{record['final']:.2f}",
                f"{record['gain']:+.2f} [{record['low']:+.2f}, {record['high']:+.2f}]",
                p_text(record["p_value"]),
                f"{record['improved']} / {record['worsened']}",
                p_text(record["mcnemar_p"]),
                "—" if hard is None else f"{hard:+.2f}",
                "PASS" if record["passed"] else "FAIL",
            ]
        )
    report = (
        f"# Gate: does GRPO learn at the grid's budget? ({status})\n\n"
        f"Command: `{command}`\n\nConfig: `{config}`" + (f" ({budget_line})" if budget_line else "") + "\n\n"
        "Accuracy in % on the test split, greedy, of the final adapter and of the base model, paired item by item: "
        "gain in points with the 95% t-interval of the per-item differences, the paired t-test's p, and McNemar's "
        "exact test on the items that changed. PASS: the interval lies above 0 and McNemar's p < 0.05.\n\n"
        f"{markdown(header, rows)}\n"
    )
    (root / "gate.md").write_text(report, encoding="utf-8")
    (root / "gate.json").write_text(
        json.dumps(
            {
                "status": status,
                "command": command,
                "config": config,
                "runs": {
                    name: {"cell": str(cells[name].directory(Path("."))), **(record or {})}
                    for name, record in records.items()
                },
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    return report, status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_run_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num_clients", type=int, default=3, help="FedAvg's clients (the grid's).")
    parser.add_argument("--dirichlet_alpha", default="0.05", help="FedAvg's Dirichlet μ (the grid's).")
    args, extra = parser.parse_known_args(argv)
    if args.parallel < 1:
        parser.error(f"--parallel must be at least 1, got {args.parallel}.")
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    cells = gate_cells(args.seed, args.num_clients, args.dirichlet_alpha)
    command = "python benchmarks/gate.py " + " ".join(arg for arg in argv if arg != "--report_only")

    def report() -> tuple[str, str, dict[str, dict | None]]:
        finished = finished_results(cells.values(), root)
        results = {name: finished[cell] for name, cell in cells.items() if cell in finished}
        records = {name: run_record(results[name]) if name in results else None for name in cells}
        return (*write_report(records, cells, root, args.config, command.strip()), records)

    failed = 0
    if not args.report_only:
        try:
            failed = run_grid(list(cells.values()), args, extra, lambda: report()[0], "gate")
        except BudgetError as error:
            parser.error(str(error))
    text, status, records = report()
    print(text)
    for name, record in records.items():
        if record is None:
            print(f"PENDING {name}: not finished (or the base model not evaluated yet)")
        else:
            print(
                f"{'PASS' if record['passed'] else 'FAIL'} {name}: {record['gain']:+.2f} points "
                f"[{record['low']:+.2f}, {record['high']:+.2f}], McNemar p {p_text(record['mcnemar_p'])}"
            )
    return 0 if status == "PASS" and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
