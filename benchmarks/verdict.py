"""Does FGRPO beat the baselines? Gains over the base model with 95% intervals over seeds, and paired differences.

Every (method, seed) cell is one `trl-federated run` of the same base config (`examples/configs/grid.yaml`: the
embedded SmolLM2-135M, the reasoning-gym benchmark, Dirichlet μ over difficulty; the old grid's was
`examples/configs/verdict.yaml`), so all methods see the same benchmark, the same partition for a given seed (the
partition follows `seed`) and the same local budget (rounds × local steps × batch). Cells run through
`trl_federated.reports.compare.cell_command`: a cell whose `result.json` exists is skipped, an interrupted one resumes
from its last round checkpoint, so rerunning the same command resumes an interrupted grid. `--parallel 2` runs two cells
at a time, each a process limited to its share of the cores (`OMP_NUM_THREADS` and the like); after every cell the
report is rewritten from the cells finished so far, marked PARTIAL until the grid is complete, and with `--commit`
the cell's small files (`CELL_FILES`: result, metrics, reports, per-client curves, cost; never adapters or
checkpoints) and the report are committed. The folder's `budget.json` records the config and flags its cells ran
with: a rerun with another budget is refused (its finished cells would be skipped, not rerun).

Per method: the gain of the final global adapter over the base model (round -1's evaluation, the same LoRA-free
model for every cell) in total and hard-tier accuracy, mean and 95% t-interval over seeds (scipy's t
distribution); the paired difference FGRPO − method (same seed, hence same partition) with its t-interval, the
half-width that interval has at the observed spread (the smallest difference the grid resolves) and the minimum
difference detected with 80% power; per seed, FGRPO's final adapter against each baseline's item by item over the
test split (`paired_gain`: interval over items, McNemar's exact test), which separates two adapters from the test
items' sampling but not two methods from the seeds' spread; reward curves (mean client R̄ per round); the wall and
CPU time per cell.

    python benchmarks/verdict.py [--config examples/configs/grid.yaml] [--output_dir benchmarks/results/grid]
        [--seeds 0 1 2] [--extra_seeds fgrpo,fedavg:3,4,5] [--num_clients 3] [--dirichlet_alpha 0.05]
        [--parallel 2] [--commit] [--report_only] [--key value ...]   # unknown flags go to every cell
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

from harness.cells import (
    EXPLORATORY,
    METRICS,
    PRIMARY,
    cell_cost,
    cell_diagnostics,
    cell_metrics,
    cpu_text,
    finished_results,
    machines,
    no_information_section,
    points,
    round_records,
    test_item_tasks,
    with_task_groups,
)
from harness.grid import add_run_arguments, extra_seeds_argument, grid_cells, grid_main
from harness.significance import holm, minimum_detectable, paired_gain, paired_p, seeds_for, t_interval
from trl_federated.methods import ABLATIONS, METHODS
from trl_federated.reports.compare import Cell, markdown

# FGRPO and its baselines (with FGRPO's averaging step, its "w/o RPG" ablation is FedAvg), then the paper's literal
# step and its ablation, whose committed cells stay as rows of their own
DEFAULT_METHODS = ["fgrpo", "fedavg", "fedprox", "scaffold", "fgrpo-paper", "fgrpo-paper-wo-rpg"]
REFERENCE = "fgrpo"
TARGET_HALF_WIDTH = 3.0  # points: the resolution the verdict aims at for FGRPO − FedAvg (issue 34)


def reading(interval: dict[str, float]) -> str:
    """What a paired interval of FGRPO − baseline says."""
    if math.isnan(interval["low"]):
        return "one seed: no interval"
    if interval["low"] == interval["high"]:
        # Accuracies move in whole test items, so a few seeds can agree exactly: a spread of 0 estimated from
        # them is not a measured certainty.
        return "not resolved (every seed gave the same difference: no spread to estimate)"
    if interval["low"] > 0:
        return "FGRPO better"
    if interval["high"] < 0:
        return "baseline better"
    return "not resolved (interval holds 0)"




def reward_curve(result: dict) -> list[float]:
    """Mean client R̄ per round."""
    return [statistics.fmean(record["rewards"].values()) for record in result["rounds"]]


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _optional(value: float, spec: str = ".2f") -> str:
    return "—" if math.isnan(value) else format(value, spec)


def summarize(results: dict[Cell, dict], costs: dict[Cell, dict[str, float]],
              diagnostics: dict[Cell, dict[str, float]]) -> dict:
    """Per (setting, method): gain intervals, base and final accuracy, cost, the per-round diagnostics averaged over
    seeds (`cell_diagnostics`); per baseline: paired intervals, the smallest difference they resolve (their
    half-width), the minimum difference detected with 80% power, and each seed's item-by-item comparison."""
    settings = sorted({cell.setting for cell in results})
    methods = [method for method in METHODS if any(cell.method == method for cell in results)]
    summary = {"methods": [], "paired": []}
    for setting, method in itertools.product(settings, methods):
        cells = sorted((c for c in results if c.setting == setting and c.method == method), key=lambda c: c.seed)
        if not cells:
            continue
        metrics = [cell_metrics(results[cell]) for cell in cells]
        row = {"setting": setting, "method": method, "seeds": [cell.seed for cell in cells]}
        for key in metrics[0]:
            row[key] = t_interval([m[key] for m in metrics])
        row["cpu_seconds_per_cell"] = statistics.fmean(costs[cell]["cpu_seconds"] for cell in cells)
        row["cpu_per_cell_text"] = cpu_text((costs[cell] for cell in cells), 60.0, ".1f")
        row["wall_seconds_per_cell"] = statistics.fmean(costs[cell]["wall_seconds"] for cell in cells)
        row["run_wall_seconds_per_cell"] = statistics.fmean(results[cell]["wall_time"] for cell in cells)
        curves = [reward_curve(results[cell]) for cell in cells]
        row["reward_curve"] = [statistics.fmean(values) for values in zip(*curves)]
        row["diagnostics"] = {key: _mean([diagnostics[cell][key] for cell in cells]) for key in diagnostics[cells[0]]}
        summary["methods"].append(row)
        if method == REFERENCE:
            continue
        reference = {c.seed: results[c] for c in results if c.setting == setting and c.method == REFERENCE}
        common = [cell for cell in cells if cell.seed in reference]
        if not common:
            continue
        paired = {"setting": setting, "baseline": method, "seeds": [cell.seed for cell in common]}
        p_values = {}
        for name in {**METRICS, **EXPLORATORY}:
            differences = [
                cell_metrics(reference[cell.seed])[f"{name}_gain"] - cell_metrics(results[cell])[f"{name}_gain"]
                for cell in common
            ]
            paired[name] = t_interval(differences)
            paired[f"{name}_reading"] = reading(paired[name])
            paired[f"{name}_detectable_80"] = minimum_detectable(paired[name]["sd"], len(differences))
            paired[f"{name}_seeds_for_target"] = seeds_for(paired[name]["sd"], TARGET_HALF_WIDTH)
            p_values[name] = paired_p(differences)
        # the secondary (and exploratory) endpoints of one baseline, corrected together; the primary stands alone
        secondary = holm({name: p for name, p in p_values.items() if name != PRIMARY})
        paired["p"] = {name: {"p": p, "p_holm": secondary.get(name)} for name, p in p_values.items()}
        paired["items"] = {cell.seed: item_difference(reference[cell.seed], results[cell]) for cell in common}
        summary["paired"].append(paired)
    return summary


def item_difference(reference: dict, baseline: dict) -> dict | None:
    """FGRPO's final adapter against the baseline's of the same seed, item by item over the test split
    (`paired_gain` of their final evaluations' `row_rewards`): whether these two adapters differ beyond the test
    items' sampling, not whether the methods do (that is the seeds' spread). None where either lacks per-item scores
    or they scored different numbers of items."""
    finals = [result["evaluations"][max(result["evaluations"], key=int)] for result in (reference, baseline)]
    rows = [final.get("row_rewards") for final in finals]
    if None in rows or len(rows[0]) != len(rows[1]):
        return None
    return paired_gain(rows[1], rows[0])


def test_items(results: dict[Cell, dict]) -> int | None:
    """The number of test items every evaluation scored (their base evaluation's count)."""
    counts = {result["evaluations"]["-1"].get("count", {}).get("Total") for result in results.values()}
    counts.discard(None)
    return counts.pop() if len(counts) == 1 else None


def ablation_note() -> str:
    """The report's word on FGRPO's "w/o RPG" ablation (the paper's Table 3): the method with FGRPO's server step and
    FedAvg's data-volume weights, which with the averaging step is FedAvg itself."""
    reference = METHODS[REFERENCE]
    _, ablation = ABLATIONS[reference.display_name]
    return (f" {reference.display_name} w/o RPG (its server step with FedAvg's data-volume weights in place of RPG's) "
            f"is the method `{ablation}`: {reference.display_name} − {ablation} is the paper's RPG ablation.")


def write_report(results: dict[Cell, dict], costs: dict[Cell, dict[str, float]],
                 diagnostics: dict[Cell, dict[str, float]], expected: int, root: Path, command: str) -> str:
    """verdict.md, verdict.csv, paired.csv, verdict.json and curves-<setting>.png from the finished cells."""
    summary = summarize(results, costs, diagnostics)
    status = f"{'complete' if len(results) == expected else 'PARTIAL'}: {len(results)} of {expected} cells finished"
    header = ["Setting", "Method", "Seeds", "Base total", "Final total", "Total gain [95% CI]", "Base hard",
              "Final hard", "Hard gain [95% CI]", "CPU min/cell", "Wall min/cell"]
    rows = [
        [row["setting"], row["method"], str(len(row["seeds"])), f"{row['total_base']['mean']:.2f}",
         f"{row['total_final']['mean']:.2f}", points(row["total_gain"]), f"{row['hard_base']['mean']:.2f}",
         f"{row['hard_final']['mean']:.2f}", points(row["hard_gain"]), row["cpu_per_cell_text"],
         f"{row['wall_seconds_per_cell'] / 60:.1f}"]
        for row in summary["methods"]
    ]
    paired_header = ["Setting", "Baseline", "Seeds", "FGRPO − baseline, total [95% CI]", "Reading (total)",
                     "Resolved beyond ±, total", "Detectable (80% power), total",
                     f"Seeds for ±{TARGET_HALF_WIDTH:g}, total", "FGRPO − baseline, hard [95% CI]", "Reading (hard)",
                     "Resolved beyond ±, hard"]
    paired_rows = [
        [row["setting"], row["baseline"], str(len(row["seeds"])), points(row["total"]), row["total_reading"],
         _optional(row["total"]["half_width"]), _optional(row["total_detectable_80"]),
         "—" if row["total_seeds_for_target"] is None else str(row["total_seeds_for_target"]), points(row["hard"]),
         row["hard_reading"], _optional(row["hard"]["half_width"])]
        for row in summary["paired"]
    ]
    task_header = ["Setting", "Method or baseline", "Seeds", "Arithmetic gain [95% CI]", "Other tasks gain [95% CI]"]
    task_rows = [
        [row["setting"], row["method"], str(len(row["seeds"])), points(row["arith_gain"]),
         points(row["other_gain"])]
        for row in summary["methods"]
    ] + [
        [row["setting"], f"FGRPO − {row['baseline']}", str(len(row["seeds"])), points(row["arith"]),
         points(row["other"])]
        for row in summary["paired"]
    ]
    holm_header = ["Setting", "FGRPO − baseline", "Seeds", "Endpoint", "Difference [95% CI]", "p (paired t)",
                   "p (Holm)"]
    holm_rows = [
        [row["setting"], row["baseline"], str(len(row["seeds"])),
         f"{name}{' (primary)' if name == PRIMARY else ' (exploratory)' if name in EXPLORATORY else ''}",
         points(row[name]), _optional(row["p"][name]["p"], ".3f"),
         "—" if row["p"][name]["p_holm"] is None else _optional(row["p"][name]["p_holm"], ".3f")]
        for row in summary["paired"] for name in {**METRICS, **EXPLORATORY}
    ]
    seen, unrecorded = machines(root, results)
    machine_text = "; ".join(
        f"{record['cpu']} ({', '.join(record['cpu_flags'])}), {record['cores']} core(s) free to the harness, "
        f"{record['threads']} thread(s), torch "
        f"{record['versions'].get('torch', '?')}, transformers {record['versions'].get('transformers', '?')}"
        for record in seen
    )
    diagnostics_header = ["Setting", "Method", "Seeds", "Server step / ‖Δ‖, median of rounds",
                          "Server step / ‖Δ‖, largest", "‖Δ‖", "cos(client update, Δ)",
                          "Groups with equal rewards", "Weight spread (max ω − min ω)", "Clients' entropy",
                          "Entropy, last round", "cos(s, Δ)", "cos(s, s₋₁)", "‖s‖ LoRA A", "‖s‖ LoRA B"]
    diagnostics_rows = [
        [row["setting"], row["method"], str(len(row["seeds"])),
         *(_optional(row["diagnostics"].get(key, math.nan)) for key in (
             "step_ratio_median", "step_ratio_max", "delta_norm", "update_cosine", "zero_std_groups", "weight_spread",
             "entropy", "last_entropy", "step_cosine", "momentum_cosine", "step_norm_a", "step_norm_b"))]
        for row in summary["methods"]
    ]
    item_header = ["Setting", "Baseline", "Seed", "FGRPO final", "Baseline final", "FGRPO − baseline [95% CI]",
                   "Items FGRPO right only / baseline right only", "McNemar exact p"]
    item_rows = [
        [row["setting"], row["baseline"], str(seed), f"{item['final']:.2f}", f"{item['base']:.2f}",
         f"{item['gain']:+.2f} [{item['low']:+.2f}, {item['high']:+.2f}]", f"{item['improved']} / {item['worsened']}",
         "—" if item["mcnemar_p"] is None else f"{item['mcnemar_p']:.2g}"]
        for row in summary["paired"] for seed, item in row["items"].items() if item is not None
    ]
    items = test_items(results)
    item_points = f"one test item is {100 / items:.2f} points of total accuracy ({items} items)" if items else ""
    cpu_total = sum(cost["cpu_seconds"] for cost in costs.values())
    lower_bound = "" if all(cost["complete"] for cost in costs.values()) else "≥ "
    wall_total = sum(cost["wall_seconds"] for cost in costs.values())
    no_information, references = no_information_section(root, {
        f"{cell.method} {cell.setting} seed {cell.seed}": result for cell, result in results.items()})
    report = (
        f"# Verdict: FGRPO against the baselines ({status})\n\n"
        f"Command: `{command}`\n\n"
        "Accuracy in % on the test split, greedy; gain = final − base model, in points; 95% t-intervals over "
        "seeds. Paired: FGRPO's gain minus the baseline's, seed by seed (same seed = same partition).\n\n"
        "Endpoints, named before the cells ran: total accuracy (primary); the hard tier, and the arithmetic tasks "
        "(chain_sum, products) against the other tasks (gcd, letter_counting) (secondary; the per-item scores give "
        f"the task groups). The grid aims at ±{TARGET_HALF_WIDTH:g} points for FGRPO − FedAvg: \"Seeds for "
        f"±{TARGET_HALF_WIDTH:g}\" is how many paired seeds reach it at the spread seen so far.{ablation_note()}\n\n"
        f"Machines: {len(seen)} recorded ({machine_text or 'none'}); {unrecorded} cell(s) ran before cells recorded "
        "their machine. bf16 kernels differ between CPUs and threaded kernels between thread counts, so a seed need "
        "not give the same numbers on another machine.\n\n"
        f"## Gains over the base model\n\n{markdown(header, rows)}\n\n"
        + (f"{no_information}\n" if no_information else "") +
        f"## Paired differences against FGRPO\n\n{markdown(paired_header, paired_rows)}\n\n"
        "What the grid resolves: a paired difference is told from 0 only beyond the half-width of its 95% interval "
        "(\"Resolved beyond ±\": t(0.975, n − 1) × sd / √n at the spread sd the seeds showed), and a true difference "
        "is found with 80% probability from \"Detectable\" on (noncentral t, same spread); more seeds shrink both by "
        f"about √n. Below these, the grid says nothing either way{'; ' + item_points if item_points else ''}.\n\n"
        f"## Secondary endpoints: arithmetic and other tasks\n\n{markdown(task_header, task_rows)}\n\n"
        "## Every endpoint, corrected for multiplicity\n\n"
        "Per baseline, the paired t-test's p-value of each endpoint, and for the secondary endpoints (hard tier, "
        "arithmetic, other tasks) and the exploratory one (the simple tier, added after the grid ran, where SCAFFOLD "
        "looked ahead) Holm's adjusted p-value over those four together; the primary endpoint stands alone. Only an "
        f"adjusted p below 0.05 says a secondary difference is there.\n\n{markdown(holm_header, holm_rows)}\n\n"
        "## Diagnostics per round, averaged over rounds and seeds (metrics.jsonl)\n\n"
        "Server step / ‖Δ‖: how far the server moved the global adapter against the clients' weighted mean change "
        "(1 for FedAvg's SGD at 1.0); cos: each client's update against Δ; groups with equal rewards: the share of "
        "GRPO groups whose K completions all scored alike (no learning signal); weight spread: how unequal the "
        f"aggregation weights were.\n\n{markdown(diagnostics_header, diagnostics_rows)}\n\n"
        "## Item by item, seed by seed\n\n"
        "FGRPO's final adapter against the baseline's of the same seed on the same test items: the mean difference "
        "with its 95% t-interval over items and McNemar's exact test on the items only one of them gets right. It "
        "tells whether two adapters differ beyond the test split's sampling, not whether the methods do: a method "
        "difference is the paired interval over seeds above, which also holds the training's seed-to-seed spread."
        f"\n\n{markdown(item_header, item_rows) if item_rows else 'No pair with per-item scores yet.'}\n\n"
        f"Compute: {lower_bound}{cpu_total / 3600:.2f} CPU hours, {wall_total / 3600:.2f} wall hours over "
        f"{len(results)} cells (attempts that were killed are not counted; `≥` where a cell resumed from one); CPU "
        "min/cell `≥` where one of its cells did.\n"
    )
    (root / "verdict.md").write_text(report, encoding="utf-8")
    for name, table in (("verdict.csv", [header, *rows]), ("paired.csv", [paired_header, *paired_rows])):
        with (root / name).open("w", newline="", encoding="utf-8") as stream:
            csv.writer(stream).writerows(table)
    (root / "verdict.json").write_text(
        json.dumps({"status": status, "command": command, "cpu_seconds": cpu_total, "wall_seconds": wall_total,
                    "test_items": items, "references": references, **summary}, indent=1),
        encoding="utf-8",
    )
    plot(summary, root, status)
    return report


def plot(summary: dict, root: Path, status: str) -> None:
    """Per setting: mean client R̄ per round by method, and the gains with their intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for setting in sorted({row["setting"] for row in summary["methods"]}):
        rows = [row for row in summary["methods"] if row["setting"] == setting]
        figure, (curve_axis, gain_axis) = plt.subplots(1, 2, figsize=(12, 4.2))
        for row in rows:
            curve = row["reward_curve"]
            curve_axis.plot(range(len(curve)), curve, marker="o", label=f"{row['method']} ({len(row['seeds'])} seeds)")
        curve_axis.set(xlabel="round", ylabel="mean client R̄ (training reward)", title=f"Reward per round ({setting})")
        curve_axis.xaxis.get_major_locator().set_params(integer=True)
        curve_axis.legend(fontsize="small")
        for offset, (name, color) in enumerate((("total_gain", "tab:blue"), ("hard_gain", "tab:red"))):
            for index, row in enumerate(rows):
                interval = row[name]
                error = None
                if not math.isnan(interval["low"]):
                    error = [[interval["mean"] - interval["low"]], [interval["high"] - interval["mean"]]]
                gain_axis.errorbar(index + (offset - 0.5) * 0.25, interval["mean"], yerr=error, fmt="o", color=color,
                                   capsize=4, label=name.replace("_", " ") if index == 0 else None)
        gain_axis.axhline(0, color="grey", linewidth=0.8)
        gain_axis.set_xticks(range(len(rows)), [row["method"] for row in rows], rotation=20)
        gain_axis.set(ylabel="points over the base model", title=f"Gain, 95% CI over seeds ({status.split(':')[0]})")
        gain_axis.legend(fontsize="small")
        figure.tight_layout()
        figure.savefig(root / f"curves-{setting.replace('=', '').replace(',', '-')}.png", dpi=110)
        plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_run_arguments(parser)
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="Seeds every method runs.")
    parser.add_argument("--extra_seeds", nargs="+", default=[], metavar="METHODS:SEEDS",
                        help="Seeds only some methods run, after the others, e.g. fgrpo,fedavg:3,4,5.")
    parser.add_argument("--num_clients", nargs="+", type=int, default=[3])
    parser.add_argument("--dirichlet_alpha", nargs="+", default=["0.05"])
    args, extra = parser.parse_known_args(argv)
    if REFERENCE not in args.methods:
        parser.error(f"--methods must include {REFERENCE!r}, the method every baseline is paired with.")
    if args.parallel < 1:
        parser.error(f"--parallel must be at least 1, got {args.parallel}.")
    extra_seeds = extra_seeds_argument(parser, args.extra_seeds, args.methods)
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    cells = grid_cells(args.methods, args.seeds, extra_seeds, args.num_clients, args.dirichlet_alpha)
    # The command that runs the grid: a --report_only rerun reports the same cells.
    command = "python benchmarks/verdict.py " + " ".join(arg for arg in argv if arg != "--report_only")

    def report() -> str:
        results = with_task_groups(finished_results(cells, root), test_item_tasks(root))
        if not results:
            return "No cell has finished yet.\n"
        costs = {cell: cell_cost(cell.directory(root)) for cell in results}
        diagnostics = {cell: cell_diagnostics(round_records(cell.directory(root))) for cell in results}
        return write_report(results, costs, diagnostics, len(cells), root, command.strip())

    return grid_main(parser, cells, args, extra, report, "grid")


if __name__ == "__main__":
    sys.exit(main())
