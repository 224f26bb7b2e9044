"""Does FGRPO beat the baselines? Gains over the base model with 95% intervals over seeds, and paired differences.

Every (method, seed) cell is one `trl-federated run` of the same base config (`examples/configs/verdict.yaml`:
the embedded SmolLM2-135M, the reasoning-gym benchmark, Dirichlet μ over difficulty), so all methods see the same
benchmark, the same partition for a given seed (the partition follows `seed`) and the same local budget
(rounds × local steps × batch). Cells run one after another through `trl_federated.compare.run_cell`: a cell
whose `result.json` exists is skipped, an interrupted one resumes from its last round checkpoint, so rerunning
the same command resumes an interrupted grid. After every cell the report is rewritten from the cells finished
so far, marked PARTIAL until the grid is complete.

Per method: the gain of the final global adapter over the base model (round -1's evaluation, the same LoRA-free
model for every cell) in total and hard-tier accuracy, mean and 95% t-interval over seeds; the paired difference
FGRPO − method (same seed, hence same partition) with its t-interval; reward curves (mean client R̄ per round);
the wall and CPU time per cell.

    python benchmarks/verdict.py [--output_dir benchmarks/results/verdict] [--seeds 0 1 2] [--num_clients 3 5]
        [--report_only] [--key value ...]   # unknown flags go to every cell, e.g. --num_rounds 4
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from trl_federated.compare import Cell, load_result, markdown, run_cell
from trl_federated.methods import METHODS

DEFAULT_METHODS = [name for name, method in METHODS.items() if method.algorithm == "grpo"]  # FGRPO and its baselines
REFERENCE = "fgrpo"
METRICS = {"total": "Total", "hard": "hard"}  # reported name -> accuracy key of an evaluation
COST_FILE = "cost.json"  # per cell: CPU and wall seconds of every attempt that ran to its end


# Statistics ------------------------------------------------------------------------------------------------


def t_cdf(x: float, df: int) -> float:
    """Student's t cumulative distribution, by Simpson's rule on the density (scipy is not a dependency)."""
    if x < 0:
        return 1.0 - t_cdf(-x, df)
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(t: float) -> float:
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(t * t / df))

    steps = 4000
    width = x / steps
    total = density(0.0) + density(x)
    total += sum((4 if i % 2 else 2) * density(i * width) for i in range(1, steps))
    return 0.5 + total * width / 3


def t_quantile(probability: float, df: int) -> float:
    """The `probability` quantile of Student's t with `df` degrees of freedom (0.975, 2 -> 4.303), by bisection."""
    if df < 1:
        raise ValueError(f"t_quantile needs df >= 1, got {df}.")
    if not 0.5 <= probability < 1:
        raise ValueError(f"t_quantile takes a probability in [0.5, 1), got {probability}.")
    low, high = 0.0, 1.0
    while t_cdf(high, df) < probability:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, df) < probability else (low, middle)
    return (low + high) / 2


def t_interval(values: list[float], confidence: float = 0.95) -> dict[str, float]:
    """Mean and two-sided t-interval of `values` (one seed: no interval, `low`/`high` are NaN)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return {"mean": mean, "low": math.nan, "high": math.nan, "n": len(values)}
    half = t_quantile(0.5 + confidence / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(values)}


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


# Cells -----------------------------------------------------------------------------------------------------


def cell_metrics(result: dict) -> dict[str, float]:
    """Accuracy gains of a finished cell over the base model (round -1), in points."""
    evaluations = result["evaluations"]
    base, final = evaluations["-1"]["accuracy"], evaluations[max(evaluations, key=int)]["accuracy"]
    metrics = {}
    for name, key in METRICS.items():
        metrics[f"{name}_base"] = 100 * base[key]
        metrics[f"{name}_final"] = 100 * final[key]
        metrics[f"{name}_gain"] = 100 * (final[key] - base[key])
    return metrics


def with_shared_base(results: dict[Any, dict]) -> dict[Any, dict]:
    """The finished cells (keyed by `Cell`, or by anything that names a cell), each with the base model's evaluation
    (round -1): the grid evaluates it in its first cell only (the same model and test split in every cell), so a cell
    without one takes that cell's. Cells are left out until a base evaluation exists."""
    base = next((result["evaluations"]["-1"] for result in results.values() if "-1" in result["evaluations"]), None)
    if base is None:
        return {}
    for result in results.values():
        result["evaluations"].setdefault("-1", base)
    return results


def reward_curve(result: dict) -> list[float]:
    """Mean client R̄ per round."""
    return [statistics.fmean(record["rewards"].values()) for record in result["rounds"]]


def run_timed_cell(cell: Cell, config: str, root: Path, extra: list[str]) -> None:
    """`compare.run_cell`, recording the CPU and wall seconds of the attempt in the cell's cost.json; an attempt
    that is killed records nothing, so an interrupted cell's cost is a lower bound."""
    directory = cell.directory(root)
    if (directory / "result.json").exists():
        run_cell(cell, config, root, extra)  # prints that it is skipped
        return
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    run_cell(cell, config, root, extra)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    attempt = {
        "cpu_seconds": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "wall_seconds": time.perf_counter() - started,
    }
    path = directory / COST_FILE
    attempts = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
    path.write_text(json.dumps([*attempts, attempt], indent=1), encoding="utf-8")


def cell_cost(directory: Path) -> dict[str, float]:
    path = directory / COST_FILE
    attempts = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
    return {key: sum(attempt[key] for attempt in attempts) for key in ("cpu_seconds", "wall_seconds")}


# Report ----------------------------------------------------------------------------------------------------


def _points(interval: dict[str, float]) -> str:
    if math.isnan(interval["low"]):
        return f"{interval['mean']:+.2f}"
    return f"{interval['mean']:+.2f} [{interval['low']:+.2f}, {interval['high']:+.2f}]"


def summarize(results: dict[Cell, dict], costs: dict[Cell, dict[str, float]]) -> dict:
    """Per (setting, method): gain intervals, base and final accuracy, cost; per baseline: paired intervals."""
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
        row["wall_seconds_per_cell"] = statistics.fmean(costs[cell]["wall_seconds"] for cell in cells)
        row["run_wall_seconds_per_cell"] = statistics.fmean(results[cell]["wall_time"] for cell in cells)
        curves = [reward_curve(results[cell]) for cell in cells]
        row["reward_curve"] = [statistics.fmean(values) for values in zip(*curves)]
        summary["methods"].append(row)
        if method == REFERENCE:
            continue
        reference = {c.seed: results[c] for c in results if c.setting == setting and c.method == REFERENCE}
        common = [cell for cell in cells if cell.seed in reference]
        if not common:
            continue
        paired = {"setting": setting, "baseline": method, "seeds": [cell.seed for cell in common]}
        for name in METRICS:
            differences = [
                cell_metrics(reference[cell.seed])[f"{name}_gain"] - cell_metrics(results[cell])[f"{name}_gain"]
                for cell in common
            ]
            paired[name] = t_interval(differences)
            paired[f"{name}_reading"] = reading(paired[name])
        summary["paired"].append(paired)
    return summary


def write_report(results: dict[Cell, dict], costs: dict[Cell, dict[str, float]], expected: int, root: Path,
                 command: str) -> str:
    """verdict.md, verdict.csv, paired.csv, verdict.json and curves-<setting>.png from the finished cells."""
    summary = summarize(results, costs)
    status = "complete" if len(results) == expected else f"PARTIAL: {len(results)} of {expected} cells finished"
    header = ["Setting", "Method", "Seeds", "Base total", "Final total", "Total gain [95% CI]", "Base hard",
              "Final hard", "Hard gain [95% CI]", "CPU min/cell", "Wall min/cell"]
    rows = [
        [row["setting"], row["method"], str(len(row["seeds"])), f"{row['total_base']['mean']:.2f}",
         f"{row['total_final']['mean']:.2f}", _points(row["total_gain"]), f"{row['hard_base']['mean']:.2f}",
         f"{row['hard_final']['mean']:.2f}", _points(row["hard_gain"]), f"{row['cpu_seconds_per_cell'] / 60:.1f}",
         f"{row['wall_seconds_per_cell'] / 60:.1f}"]
        for row in summary["methods"]
    ]
    paired_header = ["Setting", "Baseline", "Seeds", "FGRPO − baseline, total [95% CI]", "Reading (total)",
                     "FGRPO − baseline, hard [95% CI]", "Reading (hard)"]
    paired_rows = [
        [row["setting"], row["baseline"], str(len(row["seeds"])), _points(row["total"]), row["total_reading"],
         _points(row["hard"]), row["hard_reading"]]
        for row in summary["paired"]
    ]
    cpu_total = sum(cost["cpu_seconds"] for cost in costs.values())
    wall_total = sum(cost["wall_seconds"] for cost in costs.values())
    report = (
        f"# Verdict: FGRPO against the baselines ({status})\n\n"
        f"Command: `{command}`\n\n"
        "Accuracy in % on the test split, greedy; gain = final − base model, in points; 95% t-intervals over "
        "seeds. Paired: FGRPO's gain minus the baseline's, seed by seed (same seed = same partition).\n\n"
        f"## Gains over the base model\n\n{markdown(header, rows)}\n\n"
        f"## Paired differences against FGRPO\n\n{markdown(paired_header, paired_rows)}\n\n"
        f"Compute: {cpu_total / 3600:.2f} CPU hours, {wall_total / 3600:.2f} wall hours over {len(results)} cells "
        "(attempts that were killed are not counted).\n"
    )
    (root / "verdict.md").write_text(report, encoding="utf-8")
    for name, table in (("verdict.csv", [header, *rows]), ("paired.csv", [paired_header, *paired_rows])):
        with (root / name).open("w", newline="", encoding="utf-8") as stream:
            csv.writer(stream).writerows(table)
    (root / "verdict.json").write_text(
        json.dumps({"status": status, "command": command, "cpu_seconds": cpu_total, "wall_seconds": wall_total,
                    **summary}, indent=1),
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


# Command line ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", default="examples/configs/verdict.yaml", help="Base config of every cell.")
    parser.add_argument("--output_dir", default="benchmarks/results/verdict",
                        help="Grid folder: one sub-folder per cell, and the report; finished cells are skipped.")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--num_clients", nargs="+", type=int, default=[3])
    parser.add_argument("--dirichlet_alpha", nargs="+", default=["0.05"])
    parser.add_argument("--report_only", action="store_true", help="Run nothing: report the cells finished so far.")
    args, extra = parser.parse_known_args(argv)
    if REFERENCE not in args.methods:
        parser.error(f"--methods must include {REFERENCE!r}, the method every baseline is paired with.")
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    # Methods innermost: after each seed every method has a cell, so a partial grid is already a paired comparison.
    cells = [
        Cell(method, seed, num_clients, alpha)
        for num_clients, alpha, seed, method in itertools.product(
            args.num_clients, args.dirichlet_alpha, args.seeds, args.methods
        )
    ]
    # The command that runs the grid: a --report_only rerun reports the same cells.
    command = "python benchmarks/verdict.py " + " ".join(arg for arg in argv if arg != "--report_only")

    def finished() -> dict[Cell, dict]:
        results = {
            cell: load_result(cell.directory(root)) for cell in cells if (cell.directory(root) / "result.json").exists()
        }
        return with_shared_base(results)

    def report() -> str:
        results = finished()
        if not results:
            return "No cell has finished yet.\n"
        costs = {cell: cell_cost(cell.directory(root)) for cell in results}
        return write_report(results, costs, len(cells), root, command.strip())

    if not args.report_only:
        for index, cell in enumerate(cells):
            # Every cell starts from the same base model and is tested on the same split (`benchmark_seed`), so the
            # base model is evaluated once, in the first cell, and the others skip that evaluation.
            shared_base = [] if index == 0 else ["--eval_initial", "false"]
            run_timed_cell(cell, args.config, root, [*extra, *shared_base])
            report()
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
