"""The premise pilot on the balanced benchmark (issue 57): does RPG's gain carry information about a client's next
change of R̄, with the paper's R̄ and with R̄ measured on held-out items, where RPG's premise holds and no constant
answer pays?

The setting (`examples/configs/premise-balanced.yaml`): 4 clients, one task of the balanced benchmark each
(basic_arithmetic, chain_sum, gcd, products), equal data volumes (385 rows), 12 rounds of 4 local steps, R̄ over the
whole round. Cells, seeds 0 and 1: `fedavg`; `fgrpo`, the paper's gain on the paper's R̄ (64 completions of 8 prompts a
round: se ≈ 0.095 against a real trend of 0.016-0.027 a round); `fgrpo-held-out`, the paper's gain on R̄ measured
greedily on a fixed slice of 160 items of each client's own partition (`rpg_signal: held-out`: each round's change a
paired difference on the same items). Every cell is one `trl-federated run` of that config with only the method's
settings and `seed` overridden, run, resumed and committed by the harness (`benchmarks/harness/grid.py`); the report
(premise-balanced.md, premise-balanced.json) regenerates from the cells (`--report_only`).

The gate, named before any cell ran (the report's header repeats it): PASS when an RPG variant's mean over its 2 seeds
of `gain_predictiveness_z` exceeds 2: the run's correlation of each client's gain h with the next change of its R̄,
over all its client-rounds, in standard deviations from the run's own permutation null (each client's reports permuted
over its rounds, `RPGAggregator.predictiveness_z`). Reported beside it, not gated: each cell's final accuracy, total
and per task, and each RPG variant's total accuracy minus FedAvg's, paired by seed.

Cost, measured 2026-11-28 (Intel Xeon, native bf16, one thread, beside a grid on both cores, load ~5.6): the greedy
evaluation of 32 training items of the benchmark by the embedded SmolLM2-135M-Instruct with a LoRA adapter, in the
config's settings (batch 32, 64 new tokens, fast generation), took 0.74 CPU s an item (1.30 s wall); quiet, on an AMD
EPYC with AVX512-BF16, issue 57 measured ~0.17 s. A held-out cell measures 4 clients × 12 rounds × 160 = 7,680 items:
~0.36 CPU h quiet, up to ~1.6 h at the loaded rate, on top of the ~0.7 CPU h a premise cell took (grid-premise): the
pilot's 6 cells ~5 CPU h quiet, ~7.5 loaded; two at a time (`--parallel 2`) ~2.5-4 h of wall time.

The follow-up, named before any cell ran and run only after the gate passed (`--followup`; a failed or pending gate is
a usage error): the better RPG variant against FedAvg, paired by seed (the pilot's seeds 0 and 1 are its first two).
The variant: of those whose mean z passed the gate, the one with the larger pilot accuracy difference from FedAvg.
Seeds: 6, or 13 where that difference is under 2 points (the paired SD of FGRPO − FedAvg was ~1.8 points on the
premise grid: 80% power for a 1.5-point effect needs 13). Endpoints: **primary** total accuracy of the final
adapter, the paired difference variant − FedAvg with its 95% t-interval; **secondary** the worst task's and each
task's accuracy, paired t p-values Holm-corrected (premise-balanced-followup.md and .json).

    OMP_NUM_THREADS=1 python benchmarks/premise_balanced.py [--parallel 2] --commit
    python benchmarks/premise_balanced.py --report_only
    OMP_NUM_THREADS=1 python benchmarks/premise_balanced.py --followup [--parallel 2] --commit
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
    machines,
    no_information_section,
    points,
    round_records,
    shadow_predictiveness,
)
from harness.grid import add_run_arguments, grid_cells, grid_main, report_files
from harness.significance import paired_endpoints
from trl_federated.methods import METHODS
from trl_federated.reports.compare import Cell, markdown

DEFAULT_CONFIG = "examples/configs/premise-balanced.yaml"
DEFAULT_OUTPUT_DIR = "benchmarks/results/grid-premise-balanced"
CELL_METHODS = ["fedavg", "fgrpo", "fgrpo-held-out"]
SEEDS = [0, 1]
BASELINE = "fedavg"
NUM_CLIENTS = 4
GATE_Z = 2.0
TOTAL = "Total"
REPORT = "premise-balanced"
FOLLOWUP_SEEDS, FOLLOWUP_SEEDS_SMALL_EFFECT, SMALL_EFFECT = 6, 13, 2.0
FOLLOWUP = "premise-balanced-followup"
WORST = "worst task"
GATE = (f"PASS when an RPG variant's `gain_predictiveness_z` (its run's correlation of h with the next change of R̄, in "
        f"standard deviations from its own permutation null), averaged over its {len(SEEDS)} seeds, exceeds {GATE_Z:g}")


def cell_row(cell: Cell, result: dict, root: Path) -> dict[str, float]:
    """A finished cell's final accuracy in points (total and per task), its R̄ and se(R̄) averaged over its
    client-rounds, its own gain's predictiveness (run correlation, null, z; NaN for FedAvg) and the paper's gain read
    on its reports (z: what RPG would have read of them), its CPU hours (whether all its attempts recorded theirs)
    and the wall hours its rounds took."""
    evaluations = result["evaluations"]
    final = evaluations[max(evaluations, key=int)]["accuracy"]
    rounds = round_records(cell.directory(root))
    last = rounds[-1] if rounds else {}
    rewards = [value for record in rounds for value in record["rewards"].values()]
    stderrs = [value for record in rounds for value in (record.get("reward_stderr") or {}).values()
               if value is not None]
    _, shadow_z = shadow_predictiveness(rounds)
    cost = cell_cost(cell.directory(root))
    return {
        TOTAL: 100 * final[TOTAL], "tasks": {label: 100 * value for label, value in final.items() if label != TOTAL},
        "reward": _mean(rewards), "reward_stderr": _mean(stderrs),
        "run": _number(last.get("gain_predictiveness_run")), "null": _number(last.get("gain_predictiveness_null")),
        "z": _number(last.get("gain_predictiveness_z")), "paper_z": _number(shadow_z),
        "cost": cost, "rounds_wall_hours": cost["rounds_wall_seconds"] / 3600,
    }


def no_information_lines(root: Path, results: dict[Cell, dict]) -> list[str]:
    """The report's "What no information scores" section (`no_information_section`), none before a base evaluation."""
    section, _ = no_information_section(root, {f"{cell.method} seed {cell.seed}": result
                                               for cell, result in results.items()})
    return [section] if section else []


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _number(value: float | None) -> float:
    return math.nan if value is None else value


def _text(value: float, spec: str = ".2f") -> str:
    return "–" if math.isnan(value) else format(value, spec)


def write_report(root: Path, cells: list[Cell], command: str) -> str:
    """premise-balanced.md and .json from the finished cells; the gate's status PENDING until every cell finished."""
    results = finished_results(cells, root)
    rows = {cell: cell_row(cell, result, root) for cell, result in results.items()}
    tasks = sorted({task for row in rows.values() for task in row["tasks"]})
    gate = {}
    for method in CELL_METHODS:
        values = [rows[cell]["z"] for cell in rows if cell.method == method]
        if METHODS[method].aggregation == "rpg" and values:
            gate[method] = {"mean_z": _mean(values), "seeds": len(values)}
    paired = {}
    for method in CELL_METHODS[1:]:
        differences = {cell.seed: rows[cell][TOTAL] - rows[baseline][TOTAL]
                       for cell in sorted(rows, key=lambda cell: cell.seed) if cell.method == method
                       for baseline in rows if baseline.method == BASELINE and baseline.seed == cell.seed}
        if differences:
            paired[method] = {"by_seed": differences, "mean": _mean(list(differences.values()))}
    status = "PENDING" if len(results) < len(cells) else (
        "PASS" if any(record["mean_z"] > GATE_Z for record in gate.values()) else "FAIL")
    lines = [f"# The premise pilot on the balanced benchmark ({status})", "", f"Command: `{command}`; the report "
             "regenerates from the committed cells with `--report_only`.", "",
             "Setting: `examples/configs/premise-balanced.yaml`: 4 clients, one task each (basic_arithmetic, "
             "chain_sum, gcd, products), equal data volumes, 12 rounds × 4 local steps, R̄ over the whole round "
             "(fedavg, fgrpo) or measured greedily on 160 held-out items of each client's partition "
             "(fgrpo-held-out).", "",
             f"Gate, named before the cells ran: {GATE}. Reported, not gated: final accuracy, and each RPG variant's "
             "total minus FedAvg's paired by seed.", ""]
    lines += no_information_lines(root, results)
    table = [[cell.method, str(cell.seed), _text(row[TOTAL]),
              *(_text(row["tasks"].get(task, math.nan)) for task in tasks),
              _text(row["reward"], ".3f"), _text(row["reward_stderr"], ".3f"), _text(row["run"], "+.2f"),
              _text(row["null"], "+.2f"), _text(row["z"], "+.2f"), _text(row["paper_z"], "+.2f"),
              cpu_text([row["cost"]]), _text(row["rounds_wall_hours"])]
             for cell, row in sorted(rows.items(), key=lambda item: (item[0].seed, CELL_METHODS.index(item[0].method)))]
    lines += ["## Cells", "", markdown(["method", "seed", "total", *tasks, "mean R̄", "se(R̄)", "corr(h, next ΔR̄)",
                                        "its null", "z", "paper's h on its R̄: z", "CPU h", "rounds' wall h"],
                                       table), "",
              "`corr(h, next ΔR̄)`, `its null`, `z`: the run's own RPG (`gain_predictiveness_run`, `_null`, `_z` of its "
              "last round; none for FedAvg); `paper's h on its R̄`: RPG's formula with its defaults applied to the R̄ "
              "the cell's clients reported, whatever weighed them, z against the same permutation null. `CPU h`: the "
              "attempts its cost.json records; `≥` where an attempt it resumed from was killed with its machine and "
              "recorded none. `rounds' wall h`: the wall time of its rounds, whichever attempt ran them (one thread "
              "each, so about its CPU time where nothing paused it).", "",
              "## Gate", ""]
    lines += [f"- {method}: mean z {record['mean_z']:+.2f} over {record['seeds']} of {len(SEEDS)} seeds"
              for method, record in gate.items()] or ["- no RPG cell has finished"]
    lines += ["", f"## Total accuracy, method − {BASELINE}, paired by seed (points)", ""]
    lines += [f"- {method}: " + ", ".join(f"seed {seed} {value:+.2f}" for seed, value in record["by_seed"].items())
              + f"; mean {record['mean']:+.2f}" for method, record in paired.items()] or ["- no pair has finished"]
    records, _ = machines(root, results)
    lines += ["", "## Machines", "", *(f"- {json.dumps(record, sort_keys=True)}" for record in records)]
    text = "\n".join(lines) + "\n"
    (root / f"{REPORT}.md").write_text(text, encoding="utf-8")
    (root / f"{REPORT}.json").write_text(json.dumps({
        "status": status, "gate": gate, "paired": paired, "command": command,
        "cells": {f"{cell.method}/seed{cell.seed}": row for cell, row in rows.items()},
    }, indent=1, sort_keys=True, default=str) + "\n", encoding="utf-8")
    return text


def report_paths(root: Path) -> list[Path]:
    """The reports' files a finished cell commits with it, and the grid folder's budget."""
    return [*(path for name in (REPORT, FOLLOWUP) for path in (root / f"{name}.md", root / f"{name}.json")
              if path.is_file()), *report_files(root)]


def followup_plan(pilot: dict) -> tuple[str, list[int]]:
    """(the RPG variant the follow-up pairs with FedAvg, its seeds) from the pilot's report (premise-balanced.json):
    of the variants whose mean z passed the gate, the one with the larger mean accuracy difference from FedAvg; 6
    seeds, or 13 where that difference is under `SMALL_EFFECT` points. ValueError unless the pilot passed."""
    if pilot.get("status") != "PASS":
        raise ValueError(f"the pilot's gate has not passed (status {pilot.get('status')}): the follow-up runs only "
                         "after it passes")
    passed = [method for method, record in pilot["gate"].items() if record["mean_z"] > GATE_Z]
    variant = max(passed, key=lambda method: (pilot["paired"][method]["mean"], pilot["gate"][method]["mean_z"]))
    small = abs(pilot["paired"][variant]["mean"]) < SMALL_EFFECT
    return variant, list(range(FOLLOWUP_SEEDS_SMALL_EFFECT if small else FOLLOWUP_SEEDS))


def write_followup_report(root: Path, cells: list[Cell], command: str) -> str:
    """premise-balanced-followup.md and .json from the follow-up's finished cells: the endpoints named in the module's
    docstring, over the seeds both methods finished."""
    results = finished_results(cells, root)
    variant = next(cell.method for cell in cells if cell.method != BASELINE)
    values = {}
    for cell, result in results.items():
        row = cell_row(cell, result, root)
        values[cell] = {TOTAL: row[TOTAL], WORST: min(row["tasks"].values()), **row["tasks"]}
    seeds = sorted({cell.seed for cell in values if cell.method == variant}
                   & {cell.seed for cell in values if cell.method == BASELINE})
    pairs = [(values[Cell(variant, seed, NUM_CLIENTS, None)], values[Cell(BASELINE, seed, NUM_CLIENTS, None)])
             for seed in seeds]
    endpoints = [TOTAL, WORST, *sorted({task for row in values.values() for task in row} - {TOTAL, WORST})]
    rows = paired_endpoints(pairs, endpoints, TOTAL) if len(pairs) >= 2 else {}
    status = f"{'complete' if len(results) == len(cells) else 'PARTIAL'}: {len(results)} of {len(cells)} cells finished"
    lines = [f"# The premise follow-up on the balanced benchmark: {variant} against {BASELINE}", "",
             f"Status: {status}. Command: `{command}`; the report regenerates from the committed cells with "
             "`--report_only`.", "",
             "Endpoints, named before any cell ran: **primary** total accuracy of the final adapter, paired by seed "
             f"({variant} − {BASELINE}, 95% t-interval); **secondary** the worst task's and each task's accuracy, "
             "paired t p-values Holm-corrected.", "", *no_information_lines(root, results),
             f"## {variant} − {BASELINE}, seeds {seeds} (points)", ""]
    lines += [markdown(["Endpoint", "Mean [95% CI]", "p", "p (Holm)"], [
        [f"{name}{' (primary)' if name == TOTAL else ''}",
         points(row),
         _text(row["p"], ".3f"), _text(row.get("p_holm", math.nan), ".3f")] for name, row in rows.items()])
        if rows else "Fewer than 2 paired seeds have finished."]
    lines += ["", "## Cells", "", markdown(["method", "seed", *endpoints], [
        [cell.method, str(cell.seed), *(_text(row[name]) for name in endpoints)]
        for cell, row in sorted(values.items(), key=lambda item: (item[0].seed, item[0].method))])]
    text = "\n".join(lines) + "\n"
    (root / f"{FOLLOWUP}.md").write_text(text, encoding="utf-8")
    (root / f"{FOLLOWUP}.json").write_text(json.dumps({
        "status": status, "variant": variant, "seeds": seeds, "command": command, "endpoints": rows,
        "cells": {f"{cell.method}/seed{cell.seed}": row for cell, row in values.items()},
    }, indent=1, sort_keys=True, default=str) + "\n", encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_run_arguments(parser, DEFAULT_OUTPUT_DIR)
    parser.set_defaults(config=DEFAULT_CONFIG)
    parser.add_argument("--followup", action="store_true",
                        help="Run (or report) the follow-up the passed gate calls for: the better RPG variant against "
                        "FedAvg at 6 or 13 paired seeds (the module's docstring).")
    args, extra = parser.parse_known_args(argv)
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/premise_balanced.py " + " ".join(
        arg for arg in argv if arg not in ("--report_only", "--commit"))
    if not args.followup:
        cells = grid_cells(CELL_METHODS, SEEDS, {}, [NUM_CLIENTS], [None])
        return grid_main(parser, cells, args, extra, lambda: write_report(root, cells, command.strip()), REPORT,
                         report_paths)
    pilot = root / f"{REPORT}.json"
    try:
        variant, seeds = followup_plan(json.loads(pilot.read_text(encoding="utf-8")) if pilot.is_file() else {})
    except ValueError as error:
        parser.error(f"--followup: {error} ({pilot}).")
    cells = grid_cells([BASELINE, variant], seeds, {}, [NUM_CLIENTS], [None])
    return grid_main(parser, cells, args, extra, lambda: write_followup_report(root, cells, command.strip()), FOLLOWUP,
                     report_paths)


if __name__ == "__main__":
    sys.exit(main())
