"""Comparison harness: methods × seeds (× clients × Dirichlet μ) on the same partitions and local-step budget.

Every cell is one `trl-federated run` in its own process, in its own folder; a cell whose `result.json` exists
is finished and skipped, and an interrupted cell resumes from its last round checkpoint, so an interrupted grid
resumes where it stopped. The methods are `methods.METHODS`; the tables follow the paper's layout:
Table 1 (per-split accuracy, mean ± std over seeds) and Table 3 (each GRPO variant with and without RPG).

    trl-federated compare --config examples/configs/quickstart.yaml --methods fgrpo fedavg --seeds 0 1 \
        --output_dir outputs/compare [--num_clients 3 5 10] [--dirichlet_alpha 0.05 1 inf] [--key value ...]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..methods import ABLATIONS, METHODS


@dataclass(frozen=True)
class Cell:
    method: str
    seed: int
    num_clients: int | None
    dirichlet_alpha: str | None

    @property
    def setting(self) -> str:
        parts = [f"N={self.num_clients}" if self.num_clients else "",
                 f"mu={self.dirichlet_alpha}" if self.dirichlet_alpha else ""]
        return ",".join(part for part in parts if part) or "base"

    def directory(self, root: Path) -> Path:
        return root / self.setting.replace("=", "").replace(",", "-") / self.method / f"seed{self.seed}"

    def overrides(self) -> list[str]:
        values = {**METHODS[self.method].overrides(), "seed": str(self.seed)}
        if self.num_clients:
            values["num_clients"] = str(self.num_clients)
        if self.dirichlet_alpha:
            values["dirichlet_alpha"] = self.dirichlet_alpha
        return [token for key, value in values.items() for token in (f"--{key}", value)]


def cell_command(cell: Cell, config: str, root: Path, extra: list[str]) -> list[str] | None:
    """The `trl-federated run` command of one cell, from its last checkpoint if it has one (else afresh, over
    whatever an interrupted first round left), or None when its `result.json` exists; says which on stdout. A cell
    whose checkpoints are all of a format this version no longer reads (written by an earlier version, interrupted)
    starts afresh: a cell is reproducible at one thread, so it ends where the resume would have."""
    from ..core.checkpoint import CHECKPOINT_FORMAT, checkpoint_format, list_checkpoints  # torch and PEFT: deferred

    directory = cell.directory(root)
    name = f"{cell.method} {cell.setting} seed {cell.seed}"
    if (directory / "result.json").exists():
        print(f"[compare] {name}: done, skipped", flush=True)
        return None
    checkpoints = list_checkpoints(directory)
    resume = any(checkpoint_format(path) == CHECKPOINT_FORMAT for path in checkpoints)
    if checkpoints and not resume:
        print(f"[compare] {name}: its checkpoints are of an earlier format, which this version does not resume: "
              "running it afresh", flush=True)
    print(f"[compare] {name}: {'resuming' if resume else 'running'}", flush=True)
    start = ["--resume_from_checkpoint", "true"] if resume else ["--overwrite_output_dir", "true"]
    return [sys.executable, "-m", "trl_federated.cli", "run", "--config", config, *extra, *cell.overrides(),
            "--output_dir", str(directory), *start]


def run_cell(cell: Cell, config: str, root: Path, extra: list[str]) -> Path:
    """Run one cell unless its `result.json` already exists (`cell_command`); return its folder."""
    command = cell_command(cell, config, root, extra)
    if command is not None:
        subprocess.run(command, check=True)
    return cell.directory(root)


def load_result(directory: Path) -> dict:
    return json.loads((directory / "result.json").read_text(encoding="utf-8"))


def final_accuracy(result: dict) -> dict[str, float]:
    evaluations = result["evaluations"]
    return evaluations[max(evaluations, key=int)]["accuracy"]


def mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{100 * values[0]:.2f}"
    return f"{100 * statistics.mean(values):.2f} ± {100 * statistics.stdev(values):.2f}"


def table1(results: dict[Cell, dict]) -> tuple[str, list[list[str]]]:
    """Per-split final accuracy (%) by setting and method, mean ± std over seeds (the paper's Table 1)."""
    labels: list[str] = []
    for result in results.values():
        labels += [label for label in final_accuracy(result) if label not in labels]
    labels = [label for label in labels if label != "Total"] + ["Total"]
    groups: dict[tuple[str, str], list[dict[str, float]]] = {}
    for cell, result in results.items():
        groups.setdefault((cell.setting, cell.method), []).append(final_accuracy(result))
    header = ["Setting", "Method", *labels, "Seeds"]
    rows = [
        [setting, method, *[mean_std([acc.get(label, float("nan")) for acc in accs]) for label in labels],
         str(len(accs))]
        for (setting, method), accs in sorted(
            groups.items(), key=lambda item: (item[0][0], list(METHODS).index(item[0][1]))
        )
    ]
    return markdown(header, rows), [header, *rows]


def table3(results: dict[Cell, dict]) -> tuple[str, list[list[str]]]:
    """Total accuracy (%) of each GRPO variant with and without RPG weighting (the paper's Table 3)."""
    totals: dict[tuple[str, str], list[float]] = {}
    for cell, result in results.items():
        totals.setdefault((cell.setting, cell.method), []).append(final_accuracy(result)["Total"])
    header = ["Setting", "Variant", "w/ RPG", "w/o RPG"]
    rows = []
    for setting in sorted({setting for setting, _ in totals}):
        for variant, (with_rpg, without_rpg) in ABLATIONS.items():
            if (setting, with_rpg) in totals or (setting, without_rpg) in totals:
                rows.append([
                    setting, variant,
                    *[mean_std(totals[(setting, m)]) if (setting, m) in totals else "-"
                      for m in (with_rpg, without_rpg)],
                ])
    return markdown(header, rows), [header, *rows]


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def plot(results: dict[Cell, dict], root: Path) -> None:
    """Mean client reward per round and test accuracy per round, one line per method (averaged over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for setting in sorted({cell.setting for cell in results}):
        figure, (reward_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(11, 4))
        for method in METHODS:
            cells = [cell for cell in results if cell.setting == setting and cell.method == method]
            if not cells:
                continue
            rewards = [[statistics.mean(r["rewards"].values()) for r in results[c]["rounds"]] for c in cells]
            reward_axis.plot(range(1, len(rewards[0]) + 1), [statistics.mean(v) for v in zip(*rewards)], marker="o",
                             label=method)
            rounds = sorted(results[cells[0]]["evaluations"], key=int)
            accuracy = [[results[c]["evaluations"][r]["accuracy"]["Total"] for r in rounds] for c in cells]
            accuracy_axis.plot([int(r) + 1 for r in rounds], [100 * statistics.mean(v) for v in zip(*accuracy)],
                               marker="o", label=method)
        reward_axis.set(xlabel="round", ylabel="mean client R̄", title=f"Reward per round ({setting})")
        accuracy_axis.set(xlabel="round (0 = before training)", ylabel="test accuracy (%)", title="Accuracy per round")
        reward_axis.legend(fontsize="small")
        figure.tight_layout()
        figure.savefig(root / f"curves-{setting.replace('=', '').replace(',', '-')}.png", dpi=110)
        plt.close(figure)


def write_tables(results: dict[Cell, dict], root: Path) -> str:
    text1, rows1 = table1(results)
    text3, rows3 = table3(results)
    for name, rows in (("table1.csv", rows1), ("table3.csv", rows3)):
        with (root / name).open("w", newline="", encoding="utf-8") as stream:
            csv.writer(stream).writerows(rows)
    report = f"# Comparison\n\n## Table 1: accuracy (%)\n\n{text1}\n\n## Table 3: with and without RPG\n\n{text3}\n"
    (root / "comparison.md").write_text(report, encoding="utf-8")
    plot(results, root)
    return report


def _sets_server_learning_rate(config: str, extra: list[str]) -> bool:
    with open(config, encoding="utf-8") as stream:
        values = yaml.safe_load(stream) or {}
    return values.get("server_learning_rate") is not None or any(
        token.split("=")[0] == "--server_learning_rate" for token in extra
    )


def main(argv: list[str] | None = None) -> int:
    # No abbreviations: `--method` must not pass for `--methods`, nor, forwarded to each cell, `--num_round` for
    # `--num_rounds`.
    parser = argparse.ArgumentParser(
        prog="trl-federated compare", description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Any other `--key value` flag goes to every cell's `trl-federated run` (`trl-federated run --help` "
        "lists them), after the config and before the cell's method and seed.",
    )
    grid = parser.add_argument_group("the grid", "Cells are methods x seeds (x clients x Dirichlet mu).")
    grid.add_argument("--config", required=True, help="Base YAML config shared by every cell.")
    grid.add_argument("--output_dir", required=True, help="Grid folder; cells already finished there are skipped.")
    grid.add_argument("--methods", nargs="+", default=["fgrpo", "fedavg"], choices=list(METHODS), metavar="METHOD",
                      help=f"Methods among {', '.join(METHODS)} (default: fgrpo fedavg).")
    grid.add_argument("--seeds", nargs="+", type=int, default=[0], help="Seeds, one cell each.")
    grid.add_argument("--num_clients", nargs="+", type=int, default=[None],
                      help="Federation sizes, e.g. 3 5 10 (default: the config's).")
    grid.add_argument("--dirichlet_alpha", nargs="+", default=[None],
                      help="Dirichlet concentrations, e.g. 0.05 1 inf (default: the config's).")
    args, extra = parser.parse_known_args(argv)
    optimizers = sorted({METHODS[method].server_optimizer for method in args.methods})
    if len(optimizers) > 1 and _sets_server_learning_rate(args.config, extra):
        parser.error(
            f"the methods use different server optimizers ({', '.join(optimizers)}), but `server_learning_rate` is "
            f"set (in {args.config} or a flag): one rate cannot suit both (Adam's default is 0.5 x local_steps x "
            "learning_rate, SGD's 1.0, plain averaging). Remove it so each method gets its optimizer's default, or "
            "compare one optimizer at a time."
        )
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    cells = [
        Cell(method, seed, num_clients, alpha)
        for num_clients, alpha, method, seed in itertools.product(
            args.num_clients, args.dirichlet_alpha, args.methods, args.seeds
        )
    ]
    results = {cell: load_result(run_cell(cell, args.config, root, extra)) for cell in cells}
    print(write_tables(results, root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
