"""What a grid folder's finished cells hold, read back for a report: each cell's result with the base model's
evaluation shared between cells, its round records (metrics.jsonl) and the diagnostics averaged over them, its cost
and the machines it ran on, its accuracy gains on the grid's endpoints, and the test split's items rebuilt from the
folder's budget.

A grid folder: `budget.json` (`BUDGET_FILE`: the config and flags every cell ran with), one folder per cell
(`compare.Cell.directory`: `N<clients>-mu<α>/<method>/seed<s>/`) with its `result.json`, `metrics.jsonl` and
`cost.json` (`COST_FILE`), and the reports written from them."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from trl_federated.aggregation.rpg import RPGAggregator
from trl_federated.aggregation.update import ClientUpdate
from trl_federated.core.callbacks import read_metrics
from trl_federated.reports.compare import Cell, load_result

TEST_ITEMS_FILE = "test-items.json"  # per grid folder: the task of every test item, in evaluation order
COST_FILE = "cost.json"  # per cell: CPU and wall seconds of every attempt that ended or was stopped
BUDGET_FILE = "budget.json"  # per grid folder: the config and flags its cells ran with
# Reported name -> accuracy key of an evaluation. The endpoints, named before the cells ran: total accuracy (primary),
# the hard tier, and the arithmetic tasks against the others (secondary: where the paper-literal server step
# collapsed), the last two from the per-item scores (`with_task_groups`).
METRICS = {"total": "Total", "hard": "hard", "arith": "arithmetic", "other": "other tasks"}
PRIMARY = "total"
# Added after the grid ran (exploratory, not named before the cells): the simple tier, where SCAFFOLD looked ahead.
# Corrected for multiplicity with the secondary endpoints (`holm`).
EXPLORATORY = {"simple": "simple"}
TASK_GROUPS = {"arithmetic": ("chain_sum", "products")}  # the rest: "other tasks"


def finished_results(cells: Iterable[Cell], root: Path) -> dict[Cell, dict]:
    """The results of the `cells` that finished in the grid folder `root` (their `result.json`), each with the base
    model's evaluation (`with_shared_base`)."""
    results = {cell: load_result(cell.directory(root)) for cell in cells
               if (cell.directory(root) / "result.json").exists()}
    return with_shared_base(results, base_evaluation(root))


def round_records(directory: Path) -> list[dict]:
    """A cell's round records from its metrics.jsonl in round order (torn lines skipped), the last line of each
    round (a resumed run may repeat one)."""
    return _last_of_each_round(read_metrics(directory / "metrics.jsonl"))


def _last_of_each_round(records: Iterable[dict]) -> list[dict]:
    rounds = {record["round_idx"]: record for record in records if record.get("event") == "round"}
    return [rounds[key] for key in sorted(rounds)]


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
    test = test_split(root)
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


def cell_cost(directory: Path) -> dict[str, Any]:
    """A cell's CPU and wall seconds over the attempts its cost.json records, and whether those are all the attempts
    its result came from (`complete`): each resume from a round checkpoint is one attempt more (a "resumed" line in
    metrics.jsonl), and an attempt killed with its machine records nothing, so an incomplete figure is a lower bound.
    `rounds_wall_seconds`: the wall time its round records sum to, whichever attempt ran them."""
    path = directory / COST_FILE
    attempts = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
    records = list(read_metrics(directory / "metrics.jsonl"))
    resumes = sum(record.get("event") == "resumed" for record in records)
    return {**{key: sum(attempt[key] for attempt in attempts) for key in ("cpu_seconds", "wall_seconds")},
            "complete": len(attempts) > resumes,
            "rounds_wall_seconds": sum(record.get("wall_time") or 0.0 for record in _last_of_each_round(records))}


def cpu_text(costs: Iterable[dict[str, Any]], unit_seconds: float = 3600.0, spec: str = ".2f") -> str:
    """The mean CPU time of cells' `cell_cost`s in `unit_seconds` units, marked `≥` where any of them is a lower
    bound (an attempt killed with its machine recorded none)."""
    costs = list(costs)
    mean = statistics.fmean(cost["cpu_seconds"] for cost in costs) / unit_seconds
    return ("" if all(cost["complete"] for cost in costs) else "≥") + format(mean, spec)


def cell_diagnostics(rounds: list[dict]) -> dict[str, float]:
    """Per-round diagnostics of a cell from its round records (`round_records`; NaN where a cell predates them): the
    server step against the clients' mean change (`server_step_ratio`, median and maximum over rounds), ‖Δ‖, the
    cosine of each client's update with Δ, the fraction of GRPO groups whose rewards were all equal (no learning
    signal) and the spread of the aggregation weights (max ω − min ω), each averaged over rounds (and clients)."""
    ratios, deltas, cosines, zero_std, spreads, entropies = [], [], [], [], [], []
    step_cosines, momentum_cosines, norms_a, norms_b = [], [], [], []
    for record in rounds:
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
        "last_entropy": _mean([metrics["entropy"] for metrics in (rounds[-1].get("client_metrics") or {}).values()
                               if metrics.get("entropy") is not None]) if rounds else math.nan,
        "step_cosine": _mean(step_cosines),
        "momentum_cosine": _mean(momentum_cosines),
        "step_norm_a": _mean(norms_a),
        "step_norm_b": _mean(norms_b),
    }


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan




def points(interval: dict[str, float]) -> str:
    """A mean in points with its interval where it has one: "+1.23 [-0.45, +2.91]"."""
    if math.isnan(interval["low"]):
        return f"{interval['mean']:+.2f}"
    return f"{interval['mean']:+.2f} [{interval['low']:+.2f}, {interval['high']:+.2f}]"


def test_split(root: Path):
    """The test split of the grid folder's budget (`BUDGET_FILE`), built as its cells built it."""
    import tempfile

    from trl_federated.arguments import parse_run_args
    from trl_federated.data.loading import load_benchmark

    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "budget.yaml"
        config.write_text(yaml.safe_dump(json.loads((root / BUDGET_FILE).read_text(encoding="utf-8"))["config"]),
                          encoding="utf-8")  # fmt: skip
        _, _, data_args = parse_run_args(["--config", str(config)])
    return load_benchmark(data_args)[1]


def gold_answers(root: Path, evaluation: dict | None = None) -> tuple[list[str], list[str]]:
    """The (task, gold answer) of every test item in evaluation order: as `evaluation` recorded them (`row_labels`,
    `row_gold`), else rebuilt from the grid folder's budget (`test_split`) for cells run before they were recorded."""
    if evaluation is not None and evaluation.get("row_gold") is not None and evaluation.get("row_labels") is not None:
        return list(evaluation["row_labels"]), list(evaluation["row_gold"])
    test = test_split(root)
    return list(test["category"]), [str(answer) for answer in test["answer"]]


def task_items(tasks: list[str]) -> dict[str, list[int]]:
    """Task -> the indices of its test items, tasks sorted."""
    return {task: [index for index, name in enumerate(tasks) if name == task] for task in sorted(set(tasks))}


def references(tasks: list[str], gold: list[str], base: list[float]) -> dict[str, dict]:
    """What no information scores, per task and in total ("Total"), in %: the best constant answer (the task's most
    common gold answer, answered to every item) and the reference policy (per task the better of that constant and the
    base model's own answers), beside the base model."""
    table, constant_right, reference_right = {}, 0, 0
    for task, items in task_items(tasks).items():
        answer, count = Counter(gold[index] for index in items).most_common(1)[0]
        base_right = sum(base[index] for index in items)
        table[task] = {"items": len(items), "constant": answer, "constant_accuracy": 100 * count / len(items),
                       "base": 100 * base_right / len(items),
                       "reference": 100 * max(count, base_right) / len(items)}  # fmt: skip
        constant_right += count
        reference_right += max(count, base_right)
    table["Total"] = {"items": len(gold), "constant_accuracy": 100 * constant_right / len(gold),
                      "base": 100 * sum(base) / len(gold), "reference": 100 * reference_right / len(gold)}  # fmt: skip
    return table


def no_information_section(root: Path, results: dict[Any, dict]) -> tuple[str, dict | None]:
    """The report section every grid prints (issue 56): per task the best constant answer's accuracy, the base model's
    and the reference policy's (`references`), then each finished cell's final total against the reference policy,
    marking those that do not beat it; with the references as a record. ("", None) before a base evaluation with
    per-item scores, or where neither the evaluation nor the folder's budget says the items' gold answers."""
    results = with_shared_base(dict(results))
    if not results:
        return "", None
    base = next(iter(results.values()))["evaluations"]["-1"]
    recorded = base.get("row_gold") is not None and base.get("row_labels") is not None
    if base.get("row_rewards") is None or not (recorded or (root / BUDGET_FILE).is_file()):
        return "", None
    tasks, gold = gold_answers(root, base)
    if len(gold) != len(base["row_rewards"]):
        return "", None
    table = references(tasks, gold, base["row_rewards"])
    rows = ["| Task | Items | Best constant | Constant % | Base % | Reference % |", "|---|---|---|---|---|---|"]
    rows += [f"| {task} | {row['items']} | {row.get('constant', '—')} | {row['constant_accuracy']:.2f} | "
             f"{row['base']:.2f} | {row['reference']:.2f} |" for task, row in table.items()]  # fmt: skip
    reference = table["Total"]["reference"]
    cells = []
    for name, result in sorted(results.items(), key=lambda item: str(item[0])):
        evaluations = result["evaluations"]
        final = 100 * evaluations[max(evaluations, key=int)]["accuracy"]["Total"]
        mark = "beats it" if final > reference else "**does not beat it**"
        cells.append(f"- {name}: {final:.2f} ({mark})")
    text = "\n".join([
        "## What no information scores", "",
        "Per task: the best constant answer (the task's most common gold answer, answered to every item) and its "
        "accuracy, the base model's, and the reference policy's (per task the better of the two), on the test items. "
        f"Each cell's final total against the reference policy's {reference:.2f}:", "",
        *rows, "", *cells,
    ])  # fmt: skip
    return text + "\n", table


def shadow_predictiveness(rounds: list[dict], gain: str = "paper") -> tuple[float | None, float | None]:
    """The correlation of RPG's gain with the next change of R̄ over a run's client-rounds, and its z against the
    permutation null (`RPGAggregator.predictiveness_z`): RPG's formula (default settings) applied to the R̄ and step
    rewards the run's clients reported, whatever weighed them (what RPG would have read in a FedAvg run). The
    noise-aware gain's standard error reads all the step rewards a client sent: the premise config's window is its
    whole round, which is what they are."""
    aggregator = RPGAggregator(gain=gain)
    for record in rounds:
        updates = [
            ClientUpdate(client_id, {}, 1, reward, metrics=record.get("client_metrics", {}).get(client_id, {}))
            for client_id, reward in record["rewards"].items()
        ]
        aggregator.client_weights(updates, record["round_idx"])
    return aggregator.prediction_sums.correlation(), aggregator.last_z
