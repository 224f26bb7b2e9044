"""Does RPG help where its premise holds? FedAvg against the paper's RPG and the noise-aware RPG, on clients that differ
in what they learn, not in how much data they hold.

The setting (`examples/configs/premise.yaml`): 4 clients, one reasoning-gym task each (`labels_per_client: 1` over
`category`), equal data volumes (`equal_partition_sizes`: FedAvg's weights are all 1/4), 12 rounds of 4 local steps,
R̄ over the whole round. Every cell is one `trl-federated run` of that config with only the method's settings and
`seed` overridden, run, resumed and committed by the benchmarks' harness (`benchmarks/harness/grid.py`: `run_grid`):
a cell whose `result.json` exists is skipped, an interrupted one resumes from its last round, `--commit` commits each
finished cell's small files (per-item scores in result.json) and this report, which regenerates from them
(`--report_only`).

Endpoints, named before any cell ran (the report's header repeats them):
- primary: total accuracy of the final global adapter, the paired difference (RPG variant − FedAvg) over seeds with
  its 95% t-interval;
- secondary: worst-task accuracy and each task's accuracy, paired the same way, their p-values (two-sided paired t)
  Holm-corrected within each comparison;
- the pilot's gate (2 seeds): `gain_predictiveness_run` > 0 (RPG's gain h correlates positively with the next change
  of R̄, over all client-rounds of the run) for an RPG variant, on average over the pilot seeds; only then do 6 paired
  seeds of the better variant against FedAvg run.
Diagnostics: R̄'s standard error against the typical change of R̄ a round (is the window long enough for a gain to
be seen?), the same predictiveness for FedAvg's clients under RPG's formula (what RPG would have read), the weights'
spread, idle client-rounds and the entropy of the last round.

    python benchmarks/premise.py --methods fedavg fgrpo fgrpo-noise-aware --seeds 0 1 --commit   # the pilot
    python benchmarks/premise.py --methods fedavg fgrpo fgrpo-noise-aware --seeds 0 1 --report_only
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from harness.cells import (
    base_evaluation,
    cell_cost,
    cell_diagnostics,
    cpu_text,
    finished_results,
    machines,
    no_information_section,
    round_records,
    shadow_predictiveness,
)
from harness.grid import add_run_arguments, grid_cells, grid_main, report_files
from harness.significance import holm, paired
from trl_federated.methods import METHODS
from trl_federated.reports.compare import Cell

DEFAULT_CONFIG = "examples/configs/premise.yaml"
DEFAULT_OUTPUT_DIR = "benchmarks/results/grid-premise"
DEFAULT_METHODS = ["fedavg", "fgrpo", "fgrpo-noise-aware"]
BASELINE = "fedavg"
NUM_CLIENTS = 4
TOTAL = "Total"
WORST = "worst task"
REPORT = "premise.md"
REPORT_JSON = "premise.json"
PILOT_SEEDS = 2


def accuracies(result: dict) -> dict[str, float]:
    """The final adapter's accuracy in points: total, each task (the evaluation's labels) and the worst task."""
    evaluations = result["evaluations"]
    final = evaluations[max(evaluations, key=int)]["accuracy"]
    tasks = {key: 100 * value for key, value in final.items() if key != TOTAL}
    return {TOTAL: 100 * final[TOTAL], **tasks, WORST: min(tasks.values()) if tasks else math.nan}


def run_diagnostics(rounds: list[dict]) -> dict[str, float]:
    """R̄'s standard error and the typical change of R̄ a round (mean |R̄_t − R̄_{t−1}| over clients), the run's
    predictiveness (its own, and RPG's formula on its clients), idle client-rounds, from its round records."""
    stderrs = [value for record in rounds for value in (record.get("reward_stderr") or {}).values()
               if value is not None]
    changes, previous = [], {}
    for record in rounds:
        for client_id, reward in record["rewards"].items():
            if client_id in previous:
                changes.append(abs(reward - previous[client_id]))
            previous[client_id] = reward
    own = rounds[-1].get("gain_predictiveness_run") if rounds else None
    (paper, paper_z), (noise_aware, noise_aware_z) = (shadow_predictiveness(rounds, gain)
                                                      for gain in ("paper", "noise-aware"))  # fmt: skip
    idle = sum(value for record in rounds for value in (record.get("idle") or {}).values())
    return {
        "reward_stderr": statistics.fmean(stderrs) if stderrs else math.nan,
        "reward_change": statistics.fmean(changes) if changes else math.nan,
        "predictiveness": math.nan if own is None else own,
        "shadow_paper": _or_nan(paper),
        "shadow_paper_z": _or_nan(paper_z),
        "shadow_noise_aware": _or_nan(noise_aware),
        "shadow_noise_aware_z": _or_nan(noise_aware_z),
        "idle_client_rounds": idle,
        "final_reward": statistics.fmean(rounds[-1]["rewards"].values()) if rounds else math.nan,
    }


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def summarize(results: dict[Cell, dict], root: Path) -> dict:
    per_cell = {}
    for cell, result in results.items():
        rounds = round_records(cell.directory(root))  # metrics.jsonl, read once for both diagnostics
        per_cell[cell] = {**accuracies(result), **run_diagnostics(rounds), **cell_diagnostics(rounds),
                          **cell_cost(cell.directory(root))}
    methods = list(dict.fromkeys(cell.method for cell in results))
    base = base_evaluation(root)
    comparisons = {}
    for method in methods:
        if method == BASELINE:
            continue
        seeds = sorted({cell.seed for cell in results if cell.method == method}
                       & {cell.seed for cell in results if cell.method == BASELINE})
        if not seeds:
            continue
        by_seed = {seed: (per_cell[_cell(results, method, seed)], per_cell[_cell(results, BASELINE, seed)])
                   for seed in seeds}
        endpoints = [TOTAL, WORST, *sorted(key for key in by_seed[seeds[0]][0] if key in _tasks(results))]
        rows = {name: paired([ours[name] - theirs[name] for ours, theirs in by_seed.values()]) for name in endpoints}
        secondary = holm({name: rows[name]["p"] for name in endpoints if name != TOTAL})
        for name, adjusted in secondary.items():
            rows[name]["p_holm"] = adjusted
        comparisons[method] = {"seeds": seeds, "endpoints": rows}
    gate = {}
    for method in methods:
        values = [per_cell[cell]["predictiveness"] for cell in results if cell.method == method
                  and cell.seed in range(PILOT_SEEDS)]
        if METHODS[method].aggregation == "rpg" and values:
            gate[method] = {"value": statistics.fmean(values), "seeds": len(values)}
    return {"per_cell": per_cell, "comparisons": comparisons, "gate": gate, "methods": methods,
            "base": None if base is None else {key: 100 * value for key, value in base["accuracy"].items()}}


def _cell(results: dict[Cell, dict], method: str, seed: int) -> Cell:
    return next(cell for cell in results if cell.method == method and cell.seed == seed)


def _tasks(results: dict[Cell, dict]) -> set[str]:
    return {key for result in results.values() for key in accuracies(result) if key not in (TOTAL, WORST)}


def _num(value: float, spec: str = ".2f") -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def write_report(summary: dict, results: dict[Cell, dict], total_cells: int, root: Path, command: str) -> str:
    tasks = sorted(_tasks(results))
    status = (f"complete: {len(results)} of {total_cells} cells finished" if len(results) == total_cells
              else f"PARTIAL: {len(results)} of {total_cells} cells finished")
    lines = [
        "# Does RPG help where its premise holds?", "",
        f"Status: {status}. Command: `{command}`; the report regenerates from the committed cells with "
        "`--report_only`.", "",
        "Setting: `examples/configs/premise.yaml`: 4 clients, one task each (chain_sum, gcd, letter_counting, "
        "products), equal data volumes, 12 rounds × 4 local steps, R̄ over the whole round, the embedded "
        "SmolLM2-135M-Instruct; one thread a cell.", "",
        "Endpoints, named before the cells ran: **primary** total accuracy of the final adapter, paired by seed "
        "(method − FedAvg, 95% t-interval); **secondary** worst-task accuracy and each task's accuracy, p-values "
        "(paired t) Holm-corrected within each comparison; **pilot gate** (seeds 0-1): `gain_predictiveness_run` > 0 "
        "for an RPG variant, on average over the pilot seeds.", "",
    ]
    if summary["base"]:
        lines += ["Base model: " + ", ".join(f"{key} {value:.2f}%" for key, value in sorted(summary["base"].items())),
                  ""]
    lines += ["## Cells", "",
              "| method | seed | total | " + " | ".join(tasks) + " | worst | final R̄ | se(R̄) | mean abs ΔR̄ a round "
              "| corr(h, next ΔR̄) own | paper's h | its z | noise-aware h | its z | idle | weight spread "
              "| last entropy | CPU h |",
              "|---|---|---|" + "---|" * len(tasks) + "---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell in sorted(results, key=lambda c: (c.seed, summary["methods"].index(c.method))):
        row = summary["per_cell"][cell]
        lines.append(
            f"| {cell.method} | {cell.seed} | {row[TOTAL]:.2f} | " + " | ".join(_num(row.get(task)) for task in tasks)
            + f" | {_num(row[WORST])} | {_num(row['final_reward'], '.3f')} | {_num(row['reward_stderr'], '.3f')} | "
            f"{_num(row['reward_change'], '.3f')} | {_num(row['predictiveness'], '+.2f')} | "
            f"{_num(row['shadow_paper'], '+.2f')} | {_num(row['shadow_paper_z'], '+.2f')} | "
            f"{_num(row['shadow_noise_aware'], '+.2f')} | {_num(row['shadow_noise_aware_z'], '+.2f')} | "
            f"{row['idle_client_rounds']} | {_num(row['weight_spread'], '.2f')} | {_num(row['last_entropy'], '.2f')} | "
            f"{cpu_text([row])} |")
    lines += ["", "`paper's h` and `noise-aware h`: RPG's gain formula applied to the R̄ this cell's clients reported, "
              "whatever weighed them, as corr(h, next ΔR̄) over the run; `its z`: that correlation in standard "
              "deviations from its no-information value (each client's R̄ permuted over its rounds, 200 times; the "
              "null's mean is about −0.5, not 0: h holds +R̄_{t−1} and the next change −R̄_{t−1}); `own`: the run's own "
              "RPG (empty for FedAvg). `CPU h`: the attempts its cost.json records; `≥` where "
              "an attempt it resumed from was killed with its machine and recorded none.", ""]
    section, _ = no_information_section(root, {f"{cell.method} seed {cell.seed}": result
                                               for cell, result in results.items()})  # fmt: skip
    if section:
        lines += [section, "A task's accuracy near its constant can be a constant policy, not reasoning: "
                  "`benchmarks/answers.py --grid " + str(root) + "` shows which answers the cells got right.", ""]
    lines += ["## Pilot gate", ""]
    if summary["gate"]:
        for method, gate in summary["gate"].items():
            verdict = "passes" if gate["value"] > 0 else "fails"
            if gate["seeds"] < PILOT_SEEDS:
                side = "above" if gate["value"] > 0 else "not above"
                verdict = f"{side} 0 so far: {gate['seeds']} of {PILOT_SEEDS} seeds"
            lines.append(f"- {method}: mean `gain_predictiveness_run` over the pilot's seeds {gate['value']:+.3f} "
                         f"({verdict})")
        complete = all(gate["seeds"] >= PILOT_SEEDS for gate in summary["gate"].values())
        if complete and not any(gate["value"] > 0 for gate in summary["gate"].values()):
            lines += ["", "No RPG variant passes the gate: the 6-seed comparison does not run. The paired comparisons "
                      "below are the pilot's 2 seeds, too few to resolve a difference of a few points."]
        lines += ["", "Read against its null (issue 57): this gate compared with 0 a statistic whose no-information "
                  "value is about −0.5, so failing it says nothing by itself. Each cell's `its z` (table above) is the "
                  "null-calibrated reading: the mean z of the paper's and of the noise-aware gain over "
                  "the pilot's cells (FedAvg's included: the formula read on its clients):"]
        for column, name in (("shadow_paper_z", "paper's gain"), ("shadow_noise_aware_z", "noise-aware gain")):
            values = [row[column] for row in summary["per_cell"].values() if not math.isnan(row[column])]
            if values:
                lines.append(f"  - {name}: mean z {statistics.fmean(values):+.2f} over {len(values)} cells "
                             f"(range {min(values):+.2f} to {max(values):+.2f})")
    else:
        lines.append("- no RPG cell of the pilot has finished")
    lines += ["", "## Paired comparisons (method − FedAvg, points)", ""]
    for method, comparison in summary["comparisons"].items():
        lines += [f"### {method} − {BASELINE}, seeds {comparison['seeds']}", "",
                  "| endpoint | mean [95% CI] | p | p (Holm) |", "|---|---|---|---|"]
        for name, row in comparison["endpoints"].items():
            interval = (f"{row['mean']:+.2f}" if math.isnan(row["low"])
                        else f"{row['mean']:+.2f} [{row['low']:+.2f}, {row['high']:+.2f}]")
            kind = " (primary)" if name == TOTAL else ""
            lines.append(f"| {name}{kind} | {interval} | {_num(row['p'], '.3f')} | "
                         f"{_num(row.get('p_holm', math.nan), '.3f')} |")
        lines.append("")
    records, unrecorded = machines(root, results)
    lines += ["## Machines", ""] + [f"- {json.dumps(record, sort_keys=True)}" for record in records]
    text = "\n".join(lines) + "\n"
    (root / REPORT).write_text(text, encoding="utf-8")
    (root / REPORT_JSON).write_text(json.dumps({
        "status": status,
        "cells": {f"{cell.method}/seed{cell.seed}": summary["per_cell"][cell] for cell in results},
        "comparisons": summary["comparisons"], "gate": summary["gate"], "base": summary["base"],
    }, indent=1, sort_keys=True, default=str), encoding="utf-8")
    return text


def premise_files(root: Path) -> list[Path]:
    """The report's files a finished cell commits with it: this report's, and the grid folder's budget."""
    return [*(root / name for name in (REPORT, REPORT_JSON) if (root / name).is_file()), *report_files(root)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_run_arguments(parser, DEFAULT_OUTPUT_DIR)
    parser.set_defaults(config=DEFAULT_CONFIG)
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="Seeds every method runs.")
    args, extra = parser.parse_known_args(argv)
    if BASELINE not in args.methods:
        parser.error(f"--methods must include {BASELINE!r}, the method every other is paired with.")
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    cells = grid_cells(args.methods, args.seeds, {}, [NUM_CLIENTS], [None])
    # The cells' command, whatever run reports it (the harness with --commit, or --report_only after it)
    shown = [arg for arg in argv if arg not in ("--report_only", "--commit")]
    command = "python benchmarks/premise.py " + " ".join(shown)

    def report() -> str:
        results = finished_results(cells, root)
        if not results:
            return "No cell has finished yet.\n"
        return write_report(summarize(results, root), results, len(cells), root, command.strip())

    return grid_main(parser, cells, args, extra, report, "premise", premise_files)


if __name__ == "__main__":
    sys.exit(main())
