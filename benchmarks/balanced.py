"""The verdict re-asked on the balanced benchmark: FGRPO (the default) against FedAvg, and SCAFFOLD and FedProx where
the budget allows, on a benchmark where no constant answer pays.

Every (method, seed) cell is one `trl-federated run` of `examples/configs/balanced.yaml` (the verdict grid's budget:
3 clients, Dirichlet 0.05 over difficulty, 8 rounds × 5 local steps; the balanced benchmark's 1,049 test items) with
only `aggregation`, `server_optimizer` and `seed` overridden, in `benchmarks/results/grid-balanced/`, the folder of
the pilot (`benchmarks/pilot.py`), whose FedAvg cells it reuses. Run, resumed and committed by the grid's harness
(`benchmarks/harness/grid.py`); the report (balanced.md, balanced.json) regenerates from the cells (`--report_only`).

Endpoints, named before the cells ran (the report's header repeats them):
- primary: total accuracy of the final adapter, the paired difference method − FedAvg over seeds (same seed, same
  partition) with its 95% t-interval;
- secondary: the worst task's accuracy and each task's accuracy, paired the same way, their p-values (two-sided paired
  t) Holm-corrected within each comparison.
Every accuracy stands beside what no information scores (the best constant answer per task, and the reference policy:
per task the better of that constant and the base model), and each cell's z of RPG's gain against its permutation
null.

    python benchmarks/balanced.py --methods fedavg fgrpo --seeds 0 1 2 3 4 5 [--extra_seeds scaffold,fedprox:0,1,2]
        [--commit] [--report_only]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from harness.cells import (
    cell_cost,
    cpu_text,
    finished_results,
    gold_answers,
    no_information_section,
    points,
    round_records,
    shadow_predictiveness,
    task_items,
    with_shared_base,
)
from harness.grid import add_run_arguments, extra_seeds_argument, grid_cells, grid_main
from harness.significance import paired_endpoints, t_interval
from trl_federated.methods import METHODS
from trl_federated.reports.compare import Cell, markdown

DEFAULT_CONFIG = "examples/configs/balanced.yaml"
DEFAULT_OUTPUT_DIR = "benchmarks/results/grid-balanced"
BASELINE = "fedavg"
TOTAL, WORST = "Total", "worst task"
REPORT = "balanced"


def cell_accuracies(result: dict, root: Path) -> dict[str, float]:
    """A cell's final accuracy in points: total, each task (from the per-item scores) and the worst task; and the
    base model's the same way, under "base " + name."""
    evaluations = result["evaluations"]
    record = {}
    for prefix, evaluation in (("", evaluations[max(evaluations, key=int)]), ("base ", evaluations["-1"])):
        scores = evaluation["row_rewards"]
        tasks, _ = gold_answers(root, evaluation)
        per_task = {task: 100 * statistics.fmean(scores[index] for index in items)
                    for task, items in task_items(tasks).items()}  # fmt: skip
        record.update({prefix + TOTAL: 100 * statistics.fmean(scores), prefix + WORST: min(per_task.values()),
                       **{prefix + task: value for task, value in per_task.items()}})  # fmt: skip
    return record


def summarize(results: dict[Cell, dict], root: Path) -> dict:
    per_cell = {}
    for cell, result in results.items():
        correlation, z = shadow_predictiveness(round_records(cell.directory(root)))
        per_cell[cell] = {**cell_accuracies(result, root), "gain_predictiveness_run": correlation, "z": z,
                          "cost": cell_cost(cell.directory(root))}  # fmt: skip
    endpoints = [TOTAL, WORST, *sorted(key for key in next(iter(per_cell.values()))
                                       if not key.startswith("base ") and key not in (TOTAL, WORST)
                                       and key not in ("gain_predictiveness_run", "z", "cost"))]
    methods = list(dict.fromkeys(cell.method for cell in results))
    gains = {}
    for method in methods:
        cells = [cell for cell in results if cell.method == method]
        gains[method] = {"seeds": sorted(cell.seed for cell in cells),
                         **{name: t_interval([per_cell[cell][name] - per_cell[cell]["base " + name] for cell in cells])
                            for name in endpoints}}  # fmt: skip
    comparisons = {}
    for method in methods:
        seeds = sorted({cell.seed for cell in results if cell.method == method}
                       & {cell.seed for cell in results if cell.method == BASELINE})
        if method == BASELINE or not seeds:
            continue
        pairs = [(per_cell[Cell(method, seed, *_setting(results))], per_cell[Cell(BASELINE, seed, *_setting(results))])
                 for seed in seeds]  # fmt: skip
        comparisons[method] = {"seeds": seeds, "endpoints": paired_endpoints(pairs, endpoints, TOTAL)}
    return {"per_cell": per_cell, "endpoints": endpoints, "gains": gains, "comparisons": comparisons}


def _setting(results: dict[Cell, dict]) -> tuple[int, str]:
    cell = next(iter(results))
    return cell.num_clients, cell.dirichlet_alpha


def _num(value: float | None, spec: str = "+.2f") -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def write_report(results: dict[Cell, dict], cells: list[Cell], root: Path, command: str) -> str:
    status = (f"complete: {len(results)} of {len(cells)} cells finished" if len(results) == len(cells)
              else f"PARTIAL: {len(results)} of {len(cells)} cells finished")  # fmt: skip
    lines = [
        "# The verdict on the balanced benchmark: FGRPO against FedAvg", "",
        f"Status: {status}. Command: `{command}`; the report regenerates from the committed cells with "
        "`--report_only`.", "",
        "Setting: `examples/configs/balanced.yaml`: the verdict grid's budget (3 clients, Dirichlet 0.05 over "
        "difficulty, 8 rounds × 5 local steps, 2 prompts × 8 completions a step) on the balanced benchmark (no gold "
        "answer over 10% of a task's train or test items; 1,049 test items).", "",
        "Endpoints, named before the cells ran: **primary** total accuracy of the final adapter, paired by seed "
        "(method − FedAvg, 95% t-interval); **secondary** the worst task's accuracy and each task's accuracy, paired "
        "t p-values Holm-corrected within each comparison.", "",
    ]
    results = with_shared_base(dict(results))
    if not results:
        (root / f"{REPORT}.md").write_text("\n".join(lines) + "No cell has finished.\n", encoding="utf-8")
        return "\n".join(lines)
    section, references = no_information_section(root, {f"{cell.method} seed {cell.seed}": result
                                                       for cell, result in results.items()})  # fmt: skip
    summary = summarize(results, root)
    endpoints = summary["endpoints"]
    lines += [section, "## Gains over the base model (points, 95% t-interval over seeds)", "",
              markdown(["Method", "Seeds", *endpoints], [
                  [method, str(len(row["seeds"])), *(points(row[name]) for name in endpoints)]
                  for method, row in summary["gains"].items()]), ""]  # fmt: skip
    lines += ["## Paired comparisons (method − FedAvg, points)", ""]
    for method, comparison in summary["comparisons"].items():
        lines += [f"### {method} − {BASELINE}, seeds {comparison['seeds']}", "",
                  markdown(["Endpoint", "Mean [95% CI]", "p", "p (Holm)"], [
                      [f"{name}{' (primary)' if name == TOTAL else ''}", points(row), _num(row["p"], ".3f"),
                       _num(row.get("p_holm"), ".3f")]
                      for name, row in comparison["endpoints"].items()]), ""]  # fmt: skip
    lines += ["## Cells", "",
              "Final accuracy (%) per task, and RPG's gain formula read on the cell's clients: corr(h, next ΔR̄) "
              "over the run and its z against the permutation null (each client's R̄ permuted over its rounds). "
              "`CPU h`: the attempts its cost.json records; `≥` where an attempt it resumed from was killed with its "
              "machine and recorded none.", "",
              markdown(["Method", "Seed", *endpoints, "corr(h, next ΔR̄)", "z", "CPU h"], [
                  [cell.method, str(cell.seed), *(_num(row[name], ".2f") for name in endpoints),
                   _num(row["gain_predictiveness_run"], "+.3f"), _num(row["z"]), cpu_text([row["cost"]])]
                  for cell, row in sorted(summary["per_cell"].items(), key=lambda item: (item[0].seed, item[0].method))
              ]), ""]  # fmt: skip
    text = "\n".join(lines)
    (root / f"{REPORT}.md").write_text(text, encoding="utf-8")
    record = {"status": status, "command": command, "references": references,
              "gains": summary["gains"], "comparisons": summary["comparisons"],
              "cells": {f"{cell.method} seed {cell.seed}": row for cell, row in summary["per_cell"].items()}}
    (root / f"{REPORT}.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return text


def report_paths(root: Path) -> list[Path]:
    return [path for path in (root / f"{REPORT}.md", root / f"{REPORT}.json", root / "budget.json") if path.is_file()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_run_arguments(parser, DEFAULT_OUTPUT_DIR)
    parser.set_defaults(config=DEFAULT_CONFIG)
    parser.add_argument("--methods", nargs="+", default=[BASELINE, "fgrpo"], choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--extra_seeds", nargs="+", default=[], metavar="METHODS:SEEDS",
                        help="Seeds only some methods run, after the others, e.g. scaffold,fedprox:0,1,2.")
    args, extra = parser.parse_known_args(argv)
    if BASELINE not in args.methods:
        parser.error(f"--methods must include {BASELINE!r}, the method every other is paired with.")
    extra_seeds = extra_seeds_argument(parser, args.extra_seeds, args.methods)
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    cells = grid_cells(args.methods, args.seeds, extra_seeds, [3], ["0.05"])
    shown = [arg for arg in argv if arg not in ("--report_only", "--commit")]
    command = "python benchmarks/balanced.py " + " ".join(shown)

    def report() -> str:
        return write_report(finished_results(cells, root), cells, root, command.strip())

    return grid_main(parser, cells, args, extra, report, REPORT, report_paths)


if __name__ == "__main__":
    sys.exit(main())
