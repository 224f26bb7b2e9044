"""The balanced benchmark's pilot: does FedAvg learn tasks with varied answers at the grid's budget, beyond what a
constant answer or the base model already scores?

FedAvg cells of a grid config (by default `examples/configs/balanced.yaml`, the verdict grid's budget on the balanced
benchmark) at seeds 0 and 1, run and resumed by the grid's harness (`benchmarks/harness/grid.py`: skipped when
finished, resumed from their last round checkpoint, `--commit`) in the grid's folder, so that the verdict grid reuses
them. Each final adapter is paired item by item with the base model (round -1) within each task: the gain, McNemar's
exact test on the items that changed, and the number of distinct gold answers among the items newly solved (a task
learned as one answer would show one).

The gate, named before the cells ran (issue 56): PASS when in **every** pilot cell at least two tasks each gain with
McNemar p < 0.05 and have at least 10 distinct gold answers among their newly solved items. Beside it, per task, the
two no-information references every accuracy is judged against: the best constant answer (the most common gold answer
of the task's test items, answered to all of them) and the reference policy (per task, the better of that constant and
the base model's own answers); a cell whose total does not beat the reference policy is marked.

    python benchmarks/pilot.py [--config examples/configs/balanced.yaml] [--output_dir benchmarks/results/grid-balanced]
        [--seeds 0 1] [--commit] [--report_only] [--key value ...]   # unknown flags go to every cell
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from harness.cells import finished_results, gold_answers, no_information_section, task_items, with_shared_base
from harness.grid import add_run_arguments, grid_main
from harness.significance import p_text, paired_gain
from trl_federated.reports.compare import Cell, markdown

LEVEL = 0.05  # McNemar's two-sided p below it
MIN_DISTINCT_ANSWERS = 10  # distinct gold answers among a task's newly solved items
MIN_TASKS = 2  # tasks that must pass in every cell
REPORT = "pilot"


def task_records(tasks: list[str], gold: list[str], base: list[float], final: list[float]) -> dict[str, dict]:
    """Per task: the paired gain of `final` over `base` (`paired_gain`), the distinct gold answers among the items
    newly solved, and whether the task passes (gain, McNemar p < `LEVEL`, at least `MIN_DISTINCT_ANSWERS`)."""
    records = {}
    for task, items in task_items(tasks).items():
        record = paired_gain([base[index] for index in items], [final[index] for index in items], 1 - LEVEL)
        solved = Counter(gold[index] for index in items if final[index] > 0.5 >= base[index])
        record["new_answers"] = len(solved)
        record["top_new_answer"] = solved.most_common(1)[0] if solved else None
        p_value = record["mcnemar_p"]
        record["passed"] = bool(record["gain"] > 0 and p_value is not None and p_value < LEVEL
                                and len(solved) >= MIN_DISTINCT_ANSWERS)  # fmt: skip
        records[task] = record
    return records


def write_report(root: Path, cells: list[Cell], command: str) -> tuple[str, str]:
    """pilot.md and pilot.json from the finished cells; returns the report and the gate's status."""
    results = with_shared_base(finished_results(cells, root))
    finished = [cell for cell in cells if cell in results]
    status = "PENDING" if len(finished) < len(cells) else None
    lines = ["# The balanced benchmark's pilot: FedAvg at the grid's budget ({status})", "",
             f"Command: `{command}`", "",
             "Gate (named before the cells ran): PASS when in every cell at least "
             f"{MIN_TASKS} tasks each gain over the base model with McNemar's exact p < {LEVEL} and have at least "
             f"{MIN_DISTINCT_ANSWERS} distinct gold answers among their newly solved items.", ""]  # fmt: skip
    record = {"command": command, "cells": {}}
    if not finished:
        status = "PENDING"
        text = "\n".join(lines).replace("{status}", status) + "No cell has finished.\n"
        (root / f"{REPORT}.md").write_text(text, encoding="utf-8")
        return text, status
    base_evaluation = results[finished[0]]["evaluations"]["-1"]
    tasks, gold = gold_answers(root, base_evaluation)
    base = base_evaluation["row_rewards"]
    section, reference = no_information_section(root, {f"{cell.method} seed {cell.seed}": results[cell]
                                                       for cell in finished})  # fmt: skip
    record["references"] = reference
    lines += [section]
    rows, passes = [], []
    for cell in finished:
        evaluations = results[cell]["evaluations"]
        final = evaluations[max(evaluations, key=int)]["row_rewards"]
        per_task = task_records(tasks, gold, base, final)
        total = paired_gain(base, final, 1 - LEVEL)
        beats = total["final"] > reference["Total"]["reference"]
        passed_tasks = [task for task, task_record in per_task.items() if task_record["passed"]]
        passes.append(len(passed_tasks) >= MIN_TASKS)
        name = f"{cell.method} seed {cell.seed}"
        for task, task_record in per_task.items():
            top = task_record["top_new_answer"]
            rows.append([
                name, task, f"{task_record['base']:.2f}", f"{task_record['final']:.2f}", f"{task_record['gain']:+.2f}",
                f"{task_record['improved']} / {task_record['worsened']}", p_text(task_record["mcnemar_p"]),
                str(task_record["new_answers"]), "—" if top is None else f"'{top[0]}' ×{top[1]}",
                "PASS" if task_record["passed"] else "—",
            ])  # fmt: skip
        mark = "beats" if beats else "**does not beat**"
        rows.append([name, "**Total**", f"{total['base']:.2f}", f"{total['final']:.2f}", f"{total['gain']:+.2f}",
                     f"{total['improved']} / {total['worsened']}", p_text(total["mcnemar_p"]), "", "",
                     f"{mark} the reference {reference['Total']['reference']:.2f}"])  # fmt: skip
        record["cells"][name] = {"tasks": per_task, "total": total, "beats_reference": beats,
                                 "passed_tasks": passed_tasks}  # fmt: skip
    if status is None:
        status = "PASS" if all(passes) else "FAIL"
    lines += ["## Each cell against the base model, per task", "",
              "Accuracy in % of the final adapter and the base model on each task's test items, paired item by item: "
              "items improved / worsened, McNemar's exact p, and the distinct gold answers among the newly solved "
              "items with the most common of them.", "",
              markdown(["Cell", "Task", "Base", "Final", "Gain", "Improved / worsened", "McNemar p",
                        "Distinct new answers", "Most common new answer", "Task passes"], rows), ""]  # fmt: skip
    record["status"] = status
    text = "\n".join(lines).replace("{status}", status)
    (root / f"{REPORT}.md").write_text(text, encoding="utf-8")
    (root / f"{REPORT}.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return text, status


def report_paths(root: Path) -> list[Path]:
    return [path for path in (root / f"{REPORT}.md", root / f"{REPORT}.json", root / "budget.json") if path.is_file()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_run_arguments(parser, output_dir="benchmarks/results/grid-balanced")
    parser.set_defaults(config="examples/configs/balanced.yaml")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--num_clients", type=int, default=3, help="FedAvg's clients (the grid's).")
    parser.add_argument("--dirichlet_alpha", default="0.05", help="FedAvg's Dirichlet μ (the grid's).")
    args, extra = parser.parse_known_args(argv)
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    cells = [Cell("fedavg", seed, args.num_clients, args.dirichlet_alpha) for seed in args.seeds]
    command = "python benchmarks/pilot.py " + " ".join(arg for arg in argv if arg not in ("--report_only", "--commit"))
    return grid_main(parser, cells, args, extra, lambda: write_report(root, cells, command.strip())[0], REPORT,
                     report_paths)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
