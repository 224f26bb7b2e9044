"""Does FGRPO beat the baselines? Gains over the base model with 95% intervals over seeds, and paired differences.

Every (method, seed) cell is one `trl-federated run` of the same base config (`examples/configs/grid.yaml`: the
embedded SmolLM2-135M, the reasoning-gym benchmark, Dirichlet μ over difficulty; the old grid's was
`examples/configs/verdict.yaml`), so all methods see the same benchmark, the same partition for a given seed (the
partition follows `seed`) and the same local budget (rounds × local steps × batch). Cells run through
`trl_federated.compare.cell_command`: a cell whose `result.json` exists is skipped, an interrupted one resumes from
its last round checkpoint, so rerunning the same command resumes an interrupted grid. `--parallel 2` runs two cells
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
import contextlib
import csv
import itertools
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from scipy import optimize, stats

# This checkout's package first, also where another checkout is installed (a worktree running a grid): the harness
# then reads the same methods table as the cells it runs (`cell_command` runs them from this checkout).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trl_federated.callbacks import read_metrics  # noqa: E402
from trl_federated.compare import Cell, cell_command, load_result, markdown  # noqa: E402
from trl_federated.methods import ABLATIONS, METHODS  # noqa: E402

DEFAULT_CONFIG = "examples/configs/grid.yaml"
DEFAULT_OUTPUT_DIR = "benchmarks/results/grid"
# FGRPO and its baselines (with FGRPO's averaging step, its "w/o RPG" ablation is FedAvg), then the paper's literal
# step and its ablation, whose committed cells stay as rows of their own
DEFAULT_METHODS = ["fgrpo", "fedavg", "fedprox", "scaffold", "fgrpo-paper", "fgrpo-paper-wo-rpg"]
REFERENCE = "fgrpo"
# Reported name -> accuracy key of an evaluation. The endpoints, named before the cells ran: total accuracy (primary),
# the hard tier, and the arithmetic tasks against the others (secondary: where the paper-literal server step
# collapsed), the last two from the per-item scores (`with_task_groups`).
METRICS = {"total": "Total", "hard": "hard", "arith": "arithmetic", "other": "other tasks"}
PRIMARY = "total"
# Added after the grid ran (exploratory, not named before the cells): the simple tier, where SCAFFOLD looked ahead.
# Corrected for multiplicity with the secondary endpoints (`holm`).
EXPLORATORY = {"simple": "simple"}
TASK_GROUPS = {"arithmetic": ("chain_sum", "products")}  # the rest: "other tasks"
TARGET_HALF_WIDTH = 3.0  # points: the resolution the verdict aims at for FGRPO − FedAvg (issue 34)
TEST_ITEMS_FILE = "test-items.json"  # per grid folder: the task of every test item, in evaluation order
COST_FILE = "cost.json"  # per cell: CPU and wall seconds of every attempt that ran to its end
BUDGET_FILE = "budget.json"  # per grid folder: the config and flags its cells ran with
# A finished cell's files that are committed (`--commit`): small, and enough to recheck every figure of the report
# and each client's curves. Adapters (`adapter_model.safetensors`, `round-<t>/`) and checkpoints stay out.
CELL_FILES = ("result.json", "metrics.jsonl", COST_FILE, "summary.md", "rewards.png", "weights.png", "accuracy.png",
              "validation.json")
REPORT_FILES = ("verdict.md", "verdict.csv", "paired.csv", "verdict.json", BUDGET_FILE, TEST_ITEMS_FILE)
MAX_COMMITTED_BYTES = 5 * 2**20  # a cell file larger than this is not committed (and said so)
# What limits a cell process to its share of the cores under `--parallel`: torch's intra-op threads follow OMP.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# Recorded with every cell attempt (`machine_record`): the CPU flags that choose torch's kernels, and the libraries
# whose versions change what a cell computes.
KERNEL_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8"})
KERNEL_PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "numpy")


# Statistics ------------------------------------------------------------------------------------------------


def t_quantile(probability: float, df: int) -> float:
    """The `probability` quantile of Student's t with `df` degrees of freedom (0.975, 2 -> 4.303)."""
    if df < 1:
        raise ValueError(f"t_quantile needs df >= 1, got {df}.")
    return float(stats.t.ppf(probability, df))


def t_interval(values: list[float], confidence: float = 0.95) -> dict[str, float]:
    """Mean and two-sided t-interval of `values`, with their standard deviation and the interval's half-width
    (one value: no interval, `low`, `high`, `sd` and `half_width` are NaN)."""
    mean = statistics.fmean(values)
    if len(values) < 2 or math.isnan(mean):  # one value, or an endpoint some cell lacks
        return {"mean": mean, "low": math.nan, "high": math.nan, "n": len(values), "sd": math.nan,
                "half_width": math.nan}
    sd = statistics.stdev(values)
    half = t_quantile(0.5 + confidence / 2, len(values) - 1) * sd / math.sqrt(len(values))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(values), "sd": sd, "half_width": half}


def minimum_detectable(sd: float, n: int, confidence: float = 0.95, power: float = 0.8) -> float:
    """The smallest true mean difference that a two-sided one-sample t-test of `n` paired differences with standard
    deviation `sd` detects at level 1 − `confidence` with probability `power` (exact, by the noncentral t); NaN
    without a spread (fewer than 2 values, or `sd` 0)."""
    if n < 2 or not sd > 0:
        return math.nan
    df, critical = n - 1, t_quantile(0.5 + confidence / 2, n - 1)

    def shortfall(delta: float) -> float:
        shift = delta * math.sqrt(n) / sd
        # The wrong-sign tail is negligible where scipy's noncentral t returns NaN for it (large shifts).
        wrong_sign = float(stats.nct.cdf(-critical, df, shift))
        return float(stats.nct.sf(critical, df, shift)) + (0.0 if math.isnan(wrong_sign) else wrong_sign) - power

    high = sd
    while shortfall(high) < 0:
        high *= 2
    return float(optimize.brentq(shortfall, 0.0, high, xtol=1e-10))


def paired_gain(base: list[float], final: list[float], confidence: float = 0.95) -> dict:
    """The gain of `final` over `base`, per-item scores of the same test items in the same order, in points: the
    mean difference with its two-sided t-interval, the paired t-test's p-value, and for binary scores McNemar's exact
    test (two-sided binomial test of the items that went right against those that went wrong; None otherwise).
    `passed`: the interval lies above 0 and McNemar's p (where there is one) is below 1 − `confidence`."""
    if len(base) != len(final) or len(base) < 2:
        raise ValueError(
            f"A paired test needs the same items, at least 2, in both evaluations: got {len(base)} "
            f"base and {len(final)} final scores."
        )
    differences = [100 * (after - before) for before, after in zip(base, final)]
    interval = t_interval(differences, confidence)
    if interval["sd"] > 0:
        p_value = float(stats.ttest_rel(final, base).pvalue)
    else:  # every item moved by the same amount: no spread, and a t-test is undefined
        p_value = 1.0 if interval["mean"] == 0 else 0.0
    improved = sum(after > before for before, after in zip(base, final))
    worsened = sum(after < before for before, after in zip(base, final))
    binary = all(value in (0.0, 1.0) for value in (*base, *final))
    mcnemar = None
    if binary:
        mcnemar = float(stats.binomtest(improved, improved + worsened, 0.5).pvalue) if improved + worsened else 1.0
    passed = interval["low"] > 0 and (mcnemar is None or mcnemar < 1 - confidence)
    return {
        "items": len(base),
        "base": 100 * statistics.fmean(base),
        "final": 100 * statistics.fmean(final),
        "gain": interval["mean"],
        "low": interval["low"],
        "high": interval["high"],
        "p_value": p_value,
        "improved": improved,
        "worsened": worsened,
        "mcnemar_p": mcnemar,
        "passed": passed,
    }


def paired_p(differences: list[float]) -> float:
    """The two-sided p-value of a paired t-test that the differences' mean is 0 (scipy's `ttest_1samp`); NaN with
    fewer than 2 differences or none of them apart."""
    if len(differences) < 2 or any(math.isnan(value) for value in differences) or min(differences) == max(differences):
        return math.nan  # too few, an endpoint some cell lacks, or no spread
    return float(stats.ttest_1samp(differences, 0.0).pvalue)


def holm(p_values: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values (Holm 1979): the k-th smallest of m times (m − k + 1), kept monotone;
    NaN stays NaN and is not counted in m."""
    order = sorted((p, name) for name, p in p_values.items() if not math.isnan(p))
    adjusted, running = {}, 0.0
    for rank, (p, name) in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * p))
        adjusted[name] = running
    return {name: adjusted.get(name, math.nan) for name in p_values}


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


def parse_extra_seeds(specs: Iterable[str], methods: list[str]) -> dict[str, list[int]]:
    """`["fgrpo,fedavg:3,4,5"]` -> `{"fgrpo": [3, 4, 5], "fedavg": [3, 4, 5]}`: seeds that only some methods run,
    on top of `--seeds`; every named method must be among `methods`."""
    extra: dict[str, list[int]] = {}
    for spec in specs:
        names, colon, seeds = spec.partition(":")
        try:
            values = [int(seed) for seed in seeds.split(",") if seed.strip()]
        except ValueError:
            values = []
        if not colon or not values or not names.strip():
            raise ValueError(f"--extra_seeds takes METHOD[,METHOD...]:SEED[,SEED...] (e.g. fgrpo,fedavg:3,4,5), "
                             f"got {spec!r}.")
        for name in (name.strip() for name in names.split(",")):
            if name not in methods:
                raise ValueError(f"--extra_seeds names {name!r}, which is not among --methods ({', '.join(methods)}).")
            extra[name] = [*extra.get(name, []), *(seed for seed in values if seed not in extra.get(name, []))]
    return extra


def grid_cells(methods: list[str], seeds: list[int], extra_seeds: dict[str, list[int]], num_clients: list[int],
               alphas: list[str]) -> list[Cell]:
    """Every (setting, seed, method) cell, methods innermost: after each seed every method that runs it has its
    cell, so a partial grid is already a paired comparison, and the seeds only some methods run come last."""
    method_seeds = {method: list(dict.fromkeys([*seeds, *extra_seeds.get(method, [])])) for method in methods}
    all_seeds = list(dict.fromkeys(seed for method in methods for seed in method_seeds[method]))
    return [
        Cell(method, seed, clients, alpha)
        for clients, alpha, seed in itertools.product(num_clients, alphas, all_seeds)
        for method in methods
        if seed in method_seeds[method]
    ]


def cell_metrics(result: dict) -> dict[str, float]:
    """Accuracy gains of a finished cell over the base model (round -1), in points; NaN for an endpoint its
    evaluations lack (the task groups without per-item scores)."""
    evaluations = result["evaluations"]
    base, final = evaluations["-1"]["accuracy"], evaluations[max(evaluations, key=int)]["accuracy"]
    metrics = {}
    for name, key in {**METRICS, **EXPLORATORY}.items():
        if key not in base or key not in final:
            metrics.update(dict.fromkeys((f"{name}_base", f"{name}_final", f"{name}_gain"), math.nan))
            continue
        metrics[f"{name}_base"] = 100 * base[key]
        metrics[f"{name}_final"] = 100 * final[key]
        metrics[f"{name}_gain"] = 100 * (final[key] - base[key])
    return metrics


def test_item_tasks(root: Path) -> list[str]:
    """The task (`category`) of every test item in the order evaluations score them, built once from the budget the
    grid folder's cells ran (`BUDGET_FILE`) and cached in its `TEST_ITEMS_FILE`; [] for a folder without either."""
    path, budget = root / TEST_ITEMS_FILE, root / BUDGET_FILE
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    if not budget.exists():
        return []
    import tempfile

    from trl_federated.arguments import parse_run_args
    from trl_federated.data.loading import load_benchmark

    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "budget.yaml"
        config.write_text(yaml.safe_dump(json.loads(budget.read_text(encoding="utf-8"))["config"]), encoding="utf-8")
        _, _, data_args = parse_run_args(["--config", str(config)])
    _, test = load_benchmark(data_args)
    tasks = list(test["category"]) if "category" in test.column_names else []
    path.write_text(json.dumps(tasks) + "\n", encoding="utf-8")
    return tasks


def with_task_groups(results: dict[Any, dict], tasks: list[str]) -> dict[Any, dict]:
    """Each evaluation of `results` with the accuracy of every `TASK_GROUPS` group and of the other tasks, from its
    per-item scores (`row_rewards`, in the order of `tasks`); an evaluation without them is left as it is."""
    groups = {name: {index for index, task in enumerate(tasks) if task in members}
              for name, members in TASK_GROUPS.items()}
    groups["other tasks"] = set(range(len(tasks))) - set().union(*groups.values())
    for result in results.values():
        for evaluation in result["evaluations"].values():
            rows = evaluation.get("row_rewards")
            if rows is None or len(rows) != len(tasks):
                continue
            for name, indices in groups.items():
                if indices:
                    evaluation["accuracy"][name] = statistics.fmean(rows[index] for index in indices)
    return results


def seeds_for(sd: float, half_width: float = TARGET_HALF_WIDTH, confidence: float = 0.95,
              limit: int = 1000) -> int | None:
    """The fewest paired seeds whose 95% t-interval is at most ±`half_width` at the spread `sd` (None without a
    spread, or beyond `limit`)."""
    if not sd > 0:
        return None
    for n in range(2, limit + 1):
        if t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n) <= half_width:
            return n
    return None


def machines(root: Path, cells: Iterable[Cell]) -> tuple[list[dict], int]:
    """The distinct machines (`machine_record`) the finished attempts of `cells` ran on, and how many cells have
    no record (they ran before cells recorded it)."""
    seen, unrecorded = [], 0
    for cell in cells:
        path = cell.directory(root) / COST_FILE
        attempts = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
        records = [attempt["machine"] for attempt in attempts if "machine" in attempt]
        unrecorded += not records
        seen += [record for record in records if record not in seen]
    return seen, unrecorded


def base_evaluation(root: Path) -> dict | None:
    """The base model's evaluation (round -1) of any finished cell in the grid folder `root` (the gate's cells
    included), or None: every cell of a folder runs one budget (`check_budget`), so one model and one test split."""
    for path in sorted(root.glob("*/*/seed*/result.json")):
        evaluation = load_result(path.parent)["evaluations"].get("-1")
        if evaluation is not None:
            return evaluation
    return None


def with_shared_base(results: dict[Any, dict], base: dict | None = None) -> dict[Any, dict]:
    """The finished cells (keyed by `Cell`, or by anything that names a cell), each with the base model's evaluation
    (round -1): the grid evaluates it in one cell only (the same model and test split in every cell), so a cell
    without one takes that cell's, else `base`. Cells are left out until a base evaluation exists."""
    base = next((result["evaluations"]["-1"] for result in results.values() if "-1" in result["evaluations"]), base)
    if base is None:
        return {}
    for result in results.values():
        result["evaluations"].setdefault("-1", base)
    return results


def reward_curve(result: dict) -> list[float]:
    """Mean client R̄ per round."""
    return [statistics.fmean(record["rewards"].values()) for record in result["rounds"]]


class BudgetError(ValueError):
    """A grid folder holds cells of another budget (`check_budget`)."""


def check_budget(root: Path, config: str, extra: list[str]) -> None:
    """Record in `root/budget.json` the config (its values) and the flags the cells of `root` run with, or refuse
    with a `BudgetError`, naming the differences, when the folder already holds cells of another budget: their finished
    cells would be skipped, not rerun, and mixed into the report."""
    with open(config, encoding="utf-8") as stream:
        budget = json.loads(json.dumps({"config": yaml.safe_load(stream) or {}, "flags": list(extra)}))
    path = root / BUDGET_FILE
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(budget, indent=1) + "\n", encoding="utf-8")
        return
    saved = json.loads(path.read_text(encoding="utf-8"))
    if saved == budget:
        return
    keys = sorted(key for key in saved["config"].keys() | budget["config"].keys()
                  if saved["config"].get(key) != budget["config"].get(key))
    changes = [f"{key}: {saved['config'].get(key)!r} -> {budget['config'].get(key)!r}" for key in keys]
    if saved["flags"] != budget["flags"]:
        changes.append(f"flags: {saved['flags']} -> {budget['flags']}")
    raise BudgetError(
        f"{root} holds cells of another budget ({'; '.join(changes)}; recorded in {path}): give this budget its own "
        "--output_dir, or delete that file if the change cannot alter any result."
    )


def cell_environment(parallel: int) -> dict[str, str] | None:
    """The environment of a cell process when `parallel` cells share the machine: each gets its share of the cores
    (`THREAD_VARIABLES`); None (inherit) for one cell at a time."""
    if parallel <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {**os.environ, **dict.fromkeys(THREAD_VARIABLES, str(max(1, cores // parallel)))}


def machine_record(environment: dict[str, str] | None = None) -> dict[str, Any]:
    """The machine a cell attempt runs on: bf16 kernels (AVX512-BF16, AMX) differ between CPUs, and threaded kernels
    between thread counts, so the same seed need not give the same numbers elsewhere. CPU model and the flags that pick
    kernels (/proc/cpuinfo), the cell's threads (`THREAD_VARIABLES` of `environment`, else the cores) and the versions
    of the libraries that compute."""
    from importlib import metadata

    info: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as stream:
        for line in stream:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = (environment or os.environ).get(THREAD_VARIABLES[0])
    versions = {}
    for package in KERNEL_PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return {
        "cpu": info.get("model name", platform.processor() or "unknown"),
        "cpu_flags": sorted(set(info.get("flags", "").split()) & KERNEL_FLAGS),
        "cores": cores,
        "threads": int(threads) if threads and threads.isdigit() else cores,
        "python": platform.python_version(),
        "versions": versions,
    }


def record_cost(
    directory: Path, cpu_seconds: float, wall_seconds: float, machine: dict[str, Any] | None = None
) -> None:
    path = directory / COST_FILE
    attempts = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
    attempts.append({"cpu_seconds": cpu_seconds, "wall_seconds": wall_seconds,
                     **({"machine": machine} if machine else {})})
    path.write_text(json.dumps(attempts, indent=1), encoding="utf-8")


def cell_cost(directory: Path) -> dict[str, float]:
    path = directory / COST_FILE
    attempts = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
    return {key: sum(attempt[key] for attempt in attempts) for key in ("cpu_seconds", "wall_seconds")}


def cell_diagnostics(directory: Path) -> dict[str, float]:
    """Per-round diagnostics of a cell from its metrics.jsonl ("round" lines; NaN where a cell predates them): the
    server step against the clients' mean change (`server_step_ratio`, median and maximum over rounds), ‖Δ‖, the
    cosine of each client's update with Δ, the fraction of GRPO groups whose rewards were all equal (no learning
    signal) and the spread of the aggregation weights (max ω − min ω), each averaged over rounds (and clients)."""
    rounds: dict[int, dict] = {}
    for record in read_metrics(directory / "metrics.jsonl"):  # torn lines skipped
        if record.get("event") == "round":
            rounds[record["round_idx"]] = record  # the last line of a round counts (a resumed run may repeat one)
    ratios, deltas, cosines, zero_std, spreads, entropies = [], [], [], [], [], []
    step_cosines, momentum_cosines, norms_a, norms_b = [], [], [], []
    for record in rounds.values():
        for name, values in (("server_step_cosine", step_cosines), ("server_step_momentum_cosine", momentum_cosines),
                             ("server_step_norm_a", norms_a), ("server_step_norm_b", norms_b)):
            if record.get(name) is not None:  # a cell from before the step's diagnostics has none
                values.append(record[name])
        if record.get("server_step_ratio") is not None:
            ratios.append(record["server_step_ratio"])
        if record.get("delta_norm") is not None:
            deltas.append(record["delta_norm"])
        # None: no cosine (a zero update or Δ)
        cosines.extend(value for value in (record.get("update_cosines") or {}).values() if value is not None)
        for metrics in (record.get("client_metrics") or {}).values():
            if metrics.get("frac_reward_zero_std") is not None:
                zero_std.append(metrics["frac_reward_zero_std"])
            if metrics.get("entropy") is not None:
                entropies.append(metrics["entropy"])
        if record.get("weights"):
            spreads.append(max(record["weights"].values()) - min(record["weights"].values()))
    return {
        "step_ratio_median": statistics.median(ratios) if ratios else math.nan,
        "step_ratio_max": max(ratios, default=math.nan),
        "delta_norm": _mean(deltas),
        "update_cosine": _mean(cosines),
        "zero_std_groups": _mean(zero_std),
        "weight_spread": _mean(spreads),
        "entropy": _mean(entropies),
        "last_entropy": _mean([metrics["entropy"] for metrics in (rounds[max(rounds)].get("client_metrics") or {})
                               .values() if metrics.get("entropy") is not None]) if rounds else math.nan,
        "step_cosine": _mean(step_cosines),
        "momentum_cosine": _mean(momentum_cosines),
        "step_norm_a": _mean(norms_a),
        "step_norm_b": _mean(norms_b),
    }


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def run_cells(
    cells: list[Cell],
    root: Path,
    command: Callable[[Cell], list[str] | None],
    parallel: int = 1,
    on_finish: Callable[[Cell, bool], None] | None = None,
) -> list[tuple[Cell, int]]:
    """Run `command(cell)` for every cell, at most `parallel` processes at a time (`cell_environment`), in order; a
    None command is a finished cell, skipped. Each attempt that exits 0 appends its CPU seconds (the process's and
    its children's, `os.wait4`) and wall seconds to the cell's cost.json; an attempt that is killed records nothing,
    so an interrupted cell's cost is a lower bound. `on_finish(cell, ran)` follows every finished cell, skipped ones
    included (`ran` False). A failing cell stops the launch of further cells; those running are waited for. Returns
    the failures, (cell, exit status). Stopped (SIGTERM, or Ctrl-C), it stops the running cells with SIGTERM, waits
    for them (each resumes from its last round checkpoint on the next run) and exits (status 143 for SIGTERM)."""
    environment = cell_environment(parallel)
    pending, running, failures = list(cells), {}, []
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop) if main_thread else None
    try:
        _run_cells(pending, running, failures, root, command, parallel, on_finish, environment)
    except (_Stopped, KeyboardInterrupt) as stop:
        for cell, process, _ in running.values():
            print(f"[verdict] stopping {cell.method} {cell.setting} seed {cell.seed}", flush=True)
            process.terminate()
        for _, process, _ in running.values():
            process.wait()
        if isinstance(stop, _Stopped):
            raise SystemExit(128 + stop.signum) from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return failures


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame) -> None:
    raise _Stopped(signum)


def _run_cells(pending, running, failures, root, command, parallel, on_finish, environment) -> None:
    while pending or running:
        while pending and len(running) < max(1, parallel) and not failures:
            cell = pending.pop(0)
            argv = command(cell)
            if argv is None:
                if on_finish is not None:
                    on_finish(cell, False)
                continue
            cell.directory(root).mkdir(parents=True, exist_ok=True)
            process = subprocess.Popen(argv, env=environment)
            running[process.pid] = (cell, process, time.perf_counter())
        if not running:
            break
        pid, status, usage = os.wait4(-1, 0)
        if pid not in running:  # not a cell of this grid
            continue
        cell, process, started = running.pop(pid)
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen.wait
        if process.returncode != 0:
            print(f"[verdict] {cell.method} {cell.setting} seed {cell.seed}: failed with exit status "
                  f"{process.returncode}; no further cell is started", flush=True)
            failures.append((cell, process.returncode))
            continue
        record_cost(cell.directory(root), usage.ru_utime + usage.ru_stime, time.perf_counter() - started,
                    machine_record(environment))
        if on_finish is not None:
            on_finish(cell, True)


def run_timed_cell(cell: Cell, config: str, root: Path, extra: list[str]) -> None:
    """One cell (`run_cells`), its cost recorded in its cost.json; raises if it fails."""
    failures = run_cells([cell], root, lambda cell: cell_command(cell, config, root, extra))
    if failures:
        raise subprocess.CalledProcessError(failures[0][1], f"trl-federated run of {cell}")


# Commits ---------------------------------------------------------------------------------------------------


def committed_files(directory: Path) -> list[Path]:
    """A finished cell's files that `--commit` commits: `CELL_FILES` that exist and are at most
    `MAX_COMMITTED_BYTES`; never its adapters, round adapters or checkpoints."""
    files = []
    for name in CELL_FILES:
        path = directory / name
        if not path.is_file():
            continue
        if path.stat().st_size > MAX_COMMITTED_BYTES:
            print(f"[verdict] {path} is {path.stat().st_size / 2**20:.1f} MiB: not committed", flush=True)
            continue
        files.append(path)
    return files


def report_files(root: Path) -> list[Path]:
    """The grid folder's report (`REPORT_FILES`, the gate's report and the curves) that exists."""
    names = [*REPORT_FILES, "gate.md", "gate.json"]
    return [root / name for name in names if (root / name).is_file()] + sorted(root.glob("curves-*.png"))


def commit(paths: list[Path], message: str) -> bool:
    """`git add` and `git commit` exactly `paths` (nothing else staged goes in) in the repository holding them; False
    when there is nothing new to commit or git fails (said on stdout: the grid goes on, and the next run of the
    same command commits what this one could not)."""
    if not paths:
        return False
    cwd = paths[0].parent
    names = [str(path.resolve()) for path in paths]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)

    for args in (("add", "--force", "--", *names), ("diff", "--cached", "--name-only", "--", *names)):
        result = git(*args)
        if result.returncode != 0:
            print(f"[verdict] not committed: git {args[0]} failed ({result.stderr.strip()})", flush=True)
            return False
    if not result.stdout.strip():  # every file is committed as it is
        return False
    result = git("commit", "--quiet", "--only", "-m", message, "--", *names)
    if result.returncode != 0:
        print(f"[verdict] not committed: git commit failed ({(result.stderr or result.stdout).strip()})", flush=True)
        return False
    print(f"[verdict] committed: {message}", flush=True)
    return True


# Report ----------------------------------------------------------------------------------------------------


def _points(interval: dict[str, float]) -> str:
    if math.isnan(interval["low"]):
        return f"{interval['mean']:+.2f}"
    return f"{interval['mean']:+.2f} [{interval['low']:+.2f}, {interval['high']:+.2f}]"


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
            paired[f"{name}_seeds_for_target"] = seeds_for(paired[name]["sd"])
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
         f"{row['total_final']['mean']:.2f}", _points(row["total_gain"]), f"{row['hard_base']['mean']:.2f}",
         f"{row['hard_final']['mean']:.2f}", _points(row["hard_gain"]), f"{row['cpu_seconds_per_cell'] / 60:.1f}",
         f"{row['wall_seconds_per_cell'] / 60:.1f}"]
        for row in summary["methods"]
    ]
    paired_header = ["Setting", "Baseline", "Seeds", "FGRPO − baseline, total [95% CI]", "Reading (total)",
                     "Resolved beyond ±, total", "Detectable (80% power), total",
                     f"Seeds for ±{TARGET_HALF_WIDTH:g}, total", "FGRPO − baseline, hard [95% CI]", "Reading (hard)",
                     "Resolved beyond ±, hard"]
    paired_rows = [
        [row["setting"], row["baseline"], str(len(row["seeds"])), _points(row["total"]), row["total_reading"],
         _optional(row["total"]["half_width"]), _optional(row["total_detectable_80"]),
         "—" if row["total_seeds_for_target"] is None else str(row["total_seeds_for_target"]), _points(row["hard"]),
         row["hard_reading"], _optional(row["hard"]["half_width"])]
        for row in summary["paired"]
    ]
    task_header = ["Setting", "Method or baseline", "Seeds", "Arithmetic gain [95% CI]", "Other tasks gain [95% CI]"]
    task_rows = [
        [row["setting"], row["method"], str(len(row["seeds"])), _points(row["arith_gain"]),
         _points(row["other_gain"])]
        for row in summary["methods"]
    ] + [
        [row["setting"], f"FGRPO − {row['baseline']}", str(len(row["seeds"])), _points(row["arith"]),
         _points(row["other"])]
        for row in summary["paired"]
    ]
    holm_header = ["Setting", "FGRPO − baseline", "Seeds", "Endpoint", "Difference [95% CI]", "p (paired t)",
                   "p (Holm)"]
    holm_rows = [
        [row["setting"], row["baseline"], str(len(row["seeds"])),
         f"{name}{' (primary)' if name == PRIMARY else ' (exploratory)' if name in EXPLORATORY else ''}",
         _points(row[name]), _optional(row["p"][name]["p"], ".3f"),
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
    wall_total = sum(cost["wall_seconds"] for cost in costs.values())
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
        f"Compute: {cpu_total / 3600:.2f} CPU hours, {wall_total / 3600:.2f} wall hours over {len(results)} cells "
        "(attempts that were killed are not counted).\n"
    )
    (root / "verdict.md").write_text(report, encoding="utf-8")
    for name, table in (("verdict.csv", [header, *rows]), ("paired.csv", [paired_header, *paired_rows])):
        with (root / name).open("w", newline="", encoding="utf-8") as stream:
            csv.writer(stream).writerows(table)
    (root / "verdict.json").write_text(
        json.dumps({"status": status, "command": command, "cpu_seconds": cpu_total, "wall_seconds": wall_total,
                    "test_items": items, **summary}, indent=1),
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


def add_run_arguments(parser: argparse.ArgumentParser, output_dir: str = DEFAULT_OUTPUT_DIR) -> None:
    """The flags the grid shares with the gate (`benchmarks/gate.py`): which config, where, how many at a time."""
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="Base config of every cell.")
    parser.add_argument("--output_dir", default=output_dir,
                        help="Grid folder: one sub-folder per cell, and the report; finished cells are skipped.")
    parser.add_argument("--parallel", type=int, default=1,
                        help="Cells run at a time, each a process with its share of the cores (OMP_NUM_THREADS etc.).")
    parser.add_argument("--commit", action="store_true",
                        help="After each finished cell, git-commit its small files (result, metrics, summary, curves, "
                        "cost) and the report; never adapters or checkpoints.")
    parser.add_argument("--report_only", action="store_true", help="Run nothing: report the cells finished so far.")


def run_grid(cells: list[Cell], args: argparse.Namespace, extra: list[str], report: Callable[[], str],
             label: str, reports: Callable[[Path], list[Path]] = report_files) -> int:
    """Run `cells` (`run_cells`) in `args.output_dir` after `check_budget`, rewriting the report after every finished
    cell and committing it and the report's files (`reports`) with `args.commit`; 1 when a cell failed. The base
    model is evaluated in one cell only, the first, unless a finished cell of the folder has evaluated it already
    (`base_evaluation`): every cell starts from the same base model and is tested on the same split."""
    root = Path(args.output_dir)
    check_budget(root, args.config, extra)
    shared_base = base_evaluation(root) is not None

    def command(cell: Cell) -> list[str] | None:
        evaluate_base = cell == cells[0] and not shared_base
        return cell_command(cell, args.config, root, [*extra, *([] if evaluate_base else ["--eval_initial", "false"])])

    def on_finish(cell: Cell, ran: bool) -> None:
        if ran:
            report()
        if args.commit:
            name = f"{cell.method} {cell.setting} seed {cell.seed}"
            commit([*committed_files(cell.directory(root)), *reports(root)], f"{label}: {name} finished")

    failures = run_cells(cells, root, command, args.parallel, on_finish)
    if args.commit:
        report()
        commit(reports(root), f"{label}: report")
    return 1 if failures else 0


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
    try:
        extra_seeds = parse_extra_seeds(args.extra_seeds, args.methods)
    except ValueError as error:
        parser.error(str(error))
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    cells = grid_cells(args.methods, args.seeds, extra_seeds, args.num_clients, args.dirichlet_alpha)
    # The command that runs the grid: a --report_only rerun reports the same cells.
    command = "python benchmarks/verdict.py " + " ".join(arg for arg in argv if arg != "--report_only")

    def report() -> str:
        results = {
            cell: load_result(cell.directory(root)) for cell in cells if (cell.directory(root) / "result.json").exists()
        }
        results = with_task_groups(with_shared_base(results, base_evaluation(root)),
                                   test_item_tasks(root))
        if not results:
            return "No cell has finished yet.\n"
        costs = {cell: cell_cost(cell.directory(root)) for cell in results}
        diagnostics = {cell: cell_diagnostics(cell.directory(root)) for cell in results}
        return write_report(results, costs, diagnostics, len(cells), root, command.strip())

    status = 0
    if not args.report_only:
        try:
            status = run_grid(cells, args, extra, report, "grid")
        except BudgetError as error:
            parser.error(str(error))
    print(report())
    return status


if __name__ == "__main__":
    sys.exit(main())
