"""What differential privacy costs (`docs/privacy.md`): FedAvg and FGRPO at ε = ∞, 8 and 1, client- or record-level.

Each (method, ε) is a cell (`compare.Cell`: seed 0, `--num_clients` clients, Dirichlet `--dirichlet_alpha`) of the
quickstart's model and data (`examples/configs/quickstart.yaml`) with `--fraction_train` of the clients sampled a
round for `--num_rounds` rounds, in `benchmarks/results/dp/<method>-eps<ε>/`. For a finite ε the noise multiplier σ
is the one the run's own accountant (`aggregation.privacy.ClientLevelPrivacy`: replace-one, m of N sampled without
replacement, R̄'s release composed with Δ's under RPG, σ_R = σ) spends exactly ε at δ = 1e-5 over those rounds
(`noise_multiplier_for`); ε = ∞ runs without DP. Cells resume and, with `--commit`, are committed as they finish
(`harness.grid`: `run_cells`, `commit`); `report.md` tabulates each cell's base and final test accuracy, the ε its
last round reported, σ, the std of Δ's noise, the clients' update norms against the noised Δ, the seconds a client's
local step took, and the clients' mean R̄ per round, which `curves.png` plots.

With `--level record`, DP is record-level instead (`local.record_privacy`): each cell runs with `--dp_record_epsilon ε`,
every client calibrating its own σ to its data size over the run (σ: the range over the clients' ledgers, committed
with the cell), in `benchmarks/results/dp-record-<N>/` for N clients; ε reached is the worst a client reported. The
committed cells (the quickstart's budget):

    python benchmarks/dp_cost.py [--methods fedavg fgrpo] [--epsilons inf 8 1] [--commit] [--report_only]
    python benchmarks/dp_cost.py --level record --num_clients 3 --dirichlet_alpha 0.05 --fraction_train 1.0 \
        --num_rounds 3 [--commit]
    python benchmarks/dp_cost.py --level record --num_clients 16 --dirichlet_alpha 1.0 --fraction_train 1.0 \
        --num_rounds 3 [--commit]

Run it with one thread per cell (`OMP_NUM_THREADS=1`, as the grid's cells): the cells are then reproducible.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from scipy import optimize

from harness.cells import BUDGET_FILE, round_records
from harness.grid import check_budget, commit, committed_files, run_cells
from trl_federated.aggregation.privacy import ClientLevelPrivacy
from trl_federated.local.record_privacy import RECORD_LEDGER, read_ledger
from trl_federated.methods import METHODS
from trl_federated.reports.compare import Cell, cell_command, final_accuracy, load_result
from trl_federated.sampling import clients_per_round

DEFAULT_CONFIG = "examples/configs/quickstart.yaml"
DEFAULT_OUTPUT_DIR = "benchmarks/results/dp"
TARGET_DELTA = 1e-5  # `FedGRPOConfig.dp_target_delta`'s default
REPORT_FILE = "report.md"
CURVES_FILE = "curves.png"
SIGMA_FLAG = "--dp_noise_multiplier"  # the flag that carries σ, recorded in each cell folder's budget.json
RECORD_EPSILON_FLAG = "--dp_record_epsilon"  # record-level: each client calibrates its σ to this budget


def noise_multiplier_for(epsilon: float, rounds: int, num_clients: int, sample_size: int, releases_rewards: bool,
                         delta: float = TARGET_DELTA) -> float:
    """σ whose `rounds` rounds spend exactly `epsilon` at `delta` under the run's accounting (with `releases_rewards`,
    R̄ released at σ_R = σ in every round as well, as RPG does)."""

    def spent(sigma: float) -> float:
        mechanism = ClientLevelPrivacy(
            noise_multiplier=sigma, clip_norm=1.0, num_clients=num_clients, sample_size=sample_size,
            reward_range=(0.0, 1.0) if releases_rewards else None, reward_noise_multiplier=sigma,
            target_delta=delta, noise_seed=0,
        )
        return mechanism.epsilon_after(rounds) - epsilon

    return float(optimize.brentq(spent, 0.05, 1000.0, xtol=1e-4))


def level_name(epsilon: float) -> str:
    return "inf" if math.isinf(epsilon) else f"{epsilon:g}"


def cell_row(directory: Path, local_steps: int) -> dict[str, object]:
    """A finished cell's figures: base and final test accuracy (%), the last round's ε (client-level, or the worst a
    client reported for its records) and noise std, R̄ per round, over the rounds the mean ‖ū_i‖ (each client's update
    as aggregated: clipped under DP) and the mean ‖Δ‖ the server stepped on (under DP Δ̃, noise included): their ratio
    is how far the noise outgrew the clients' signal; and the mean seconds of a client's local step."""
    rounds = round_records(directory)
    last = rounds[-1] if rounds else {}
    result = load_result(directory)
    return {
        "base": 100 * result["evaluations"]["-1"]["accuracy"]["Total"],
        "accuracy": 100 * final_accuracy(result)["Total"],
        "epsilon": last.get("dp_epsilon", last.get("dp_record_epsilon_worst")),
        "noise_std": last.get("dp_noise_std"),
        "rewards": [statistics.fmean(record["rewards"].values()) for record in rounds],
        "update_norm": statistics.fmean(statistics.fmean(record["update_norms"].values()) for record in rounds),
        "delta_norm": statistics.fmean(record["delta_norm"] for record in rounds),
        "step_seconds": statistics.fmean(metrics["train_seconds"] / local_steps
                                         for record in rounds for metrics in record["client_metrics"].values()),
    }


def update_norm_quartiles(directories: list[Path]) -> tuple[int, list[float]]:
    """How many client-rounds the finished cells `directories` hold, and their update norms ‖θ_i − θ‖ at 0, ¼, ½, ¾
    and 1 (in cells without DP, as the clients sent them: what a clip norm would be set against)."""
    norms = [norm for directory in directories for record in round_records(directory)
             for norm in record["update_norms"].values()]
    return len(norms), [min(norms), *statistics.quantiles(norms, n=4, method="inclusive"), max(norms)]


def recorded_noise_multiplier(folder: Path) -> float | None:
    """The σ a cell folder's cells ran with, from the flags its `budget.json` records (None: no DP)."""
    flags = json.loads((folder / BUDGET_FILE).read_text(encoding="utf-8"))["flags"]
    return float(flags[flags.index(SIGMA_FLAG) + 1]) if SIGMA_FLAG in flags else None


def write_report(root: Path, cells: dict[tuple[str, str], Cell], command: str, kind: str = "client") -> str:
    """`report.md` and `curves.png` (R̄ per round, one line per cell) of the finished cells; `kind`: the level of DP,
    "client" or "record"."""
    reached = "the worst ε a client reported for its records" if kind == "record" else "the ε"
    lines = [
        f"# What {kind}-level DP costs",
        "",
        f"`{command}`; cells in `{root}/<method>-eps<ε>/`. Per cell: test accuracy of the base model and of the final "
        f"adapter, {reached} at δ = {TARGET_DELTA:g} after its last round, σ, the std of Δ's noise in that round, the "
        "mean over rounds of the clients' update norm ‖ū‖ (clipped under DP) and of the ‖Δ‖ the server stepped on "
        "(noise included under DP), the mean seconds of a client's local step, and the clients' mean R̄ per round "
        "(`curves.png`).",
        "",
        "| method | target ε | σ | base % | accuracy % | ε reached | noise std | mean ‖ū‖ | mean ‖Δ‖ | s/step "
        "| R̄ per round |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    curves, without_dp = {}, []
    for (method, level), cell in cells.items():
        folder = root / f"{method}-eps{level}"
        directory = cell.directory(folder)
        if not (directory / "result.json").exists():
            continue
        if level == "inf":
            without_dp.append(directory)
        local_steps = json.loads((folder / BUDGET_FILE).read_text(encoding="utf-8"))["config"]["local_steps"]
        row, sigma = cell_row(directory, local_steps), recorded_noise_multiplier(folder)
        client_sigmas = sorted({entry["noise_multiplier"] for path in directory.glob(f"clients/*/{RECORD_LEDGER}")
                                for entry in read_ledger(path)})
        if sigma is not None:  # client-level: the σ the folder's budget records
            sigma_text = f"{sigma:.3g}"
        elif client_sigmas:  # record-level: the range of the σ the clients calibrated
            sigma_text = "-".join(dict.fromkeys(f"{value:.3g}" for value in (client_sigmas[0], client_sigmas[-1])))
        else:
            sigma_text = "–"
        epsilon = "∞" if row["epsilon"] is None else f"{row['epsilon']:.2f}"
        noise = "–" if row["noise_std"] is None else f"{row['noise_std']:.3g}"
        target = "∞" if level == "inf" else level
        lines.append(
            f"| {method} | {target} | {sigma_text} | {row['base']:.1f} | {row['accuracy']:.1f} | {epsilon} | {noise} | "
            f"{row['update_norm']:.3g} | {row['delta_norm']:.3g} | {row['step_seconds']:.1f} | "
            f"{' '.join(f'{r:.2f}' for r in row['rewards'])} |"
        )
        curves[f"{method}, ε = {target}"] = row["rewards"]
    if without_dp:  # what `dp_clip_norm`'s default is set against (docs/privacy.md)
        count, quartiles = update_norm_quartiles(without_dp)
        lines += ["", f"Update norms ‖θ_i − θ‖ of the {count} client-rounds without DP (before any clipping): min, "
                  f"quartiles, max {', '.join(f'{norm:.3g}' for norm in quartiles)}."]
    text = "\n".join(lines) + "\n"
    (root / REPORT_FILE).write_text(text, encoding="utf-8")
    if curves:
        plot(curves, root / CURVES_FILE)
    return text


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 4))
    for label, rewards in curves.items():
        axis.plot(range(len(rewards)), rewards, marker="o", label=label)
    axis.set(xlabel="round", ylabel="clients' mean R̄ (training reward)", title="Client-level DP: reward per round")
    axis.xaxis.get_major_locator().set_params(integer=True)
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--level", choices=["client", "record"], default="client")
    parser.add_argument("--output_dir", default=None,
                        help=f"Default: {DEFAULT_OUTPUT_DIR}, or {DEFAULT_OUTPUT_DIR}-record-<num_clients>.")
    parser.add_argument("--methods", nargs="+", default=["fedavg", "fgrpo"], choices=list(METHODS))
    parser.add_argument("--epsilons", nargs="+", type=float, default=[math.inf, 8.0, 1.0])
    parser.add_argument("--num_clients", type=int, default=16)
    # 0.05 leaves some of 16 clients without rows of the quickstart's 330 (3 labels); 1.0 gives each at least 8
    parser.add_argument("--dirichlet_alpha", default="1.0")
    parser.add_argument("--fraction_train", type=float, default=0.5)
    parser.add_argument("--num_rounds", type=int, default=8)
    parser.add_argument("--commit", action="store_true", help="Commit each finished cell's files and the report.")
    parser.add_argument("--report_only", action="store_true")
    args = parser.parse_args(argv)
    root = Path(args.output_dir or (DEFAULT_OUTPUT_DIR if args.level == "client"
                                    else f"{DEFAULT_OUTPUT_DIR}-record-{args.num_clients}"))
    root.mkdir(parents=True, exist_ok=True)
    sample_size = clients_per_round(args.num_clients, args.fraction_train, 1)
    cells = {(method, level_name(epsilon)): Cell(method, 0, args.num_clients, args.dirichlet_alpha)
             for epsilon in args.epsilons for method in args.methods}
    command = "python benchmarks/dp_cost.py " + " ".join(arg for arg in argv if arg != "--report_only")
    for epsilon in [] if args.report_only else args.epsilons:
        for method in args.methods:
            level = level_name(epsilon)
            cell, folder = cells[method, level], root / f"{method}-eps{level}"  # one budget (σ a flag) per folder
            if (cell.directory(folder) / "result.json").exists():
                continue  # finished: its σ is the one its budget.json records
            extra = ["--fraction_train", str(args.fraction_train), "--num_rounds", str(args.num_rounds)]
            if not math.isinf(epsilon) and args.level == "record":  # each client calibrates its own σ
                extra += [RECORD_EPSILON_FLAG, f"{epsilon:g}"]
            elif not math.isinf(epsilon):  # calibrated only for a cell that still runs: minutes of accounting
                sigma = noise_multiplier_for(epsilon, args.num_rounds, args.num_clients, sample_size,
                                             METHODS[method].aggregation == "rpg")
                extra += [SIGMA_FLAG, f"{sigma:.6g}"]
            check_budget(folder, args.config, extra)
            if run_cells([cell], folder, lambda cell, folder=folder, extra=extra: cell_command(
                    cell, args.config, folder, extra)):
                return 1
            write_report(root, cells, command.strip(), args.level)
            if args.commit:
                files = [*committed_files(cell.directory(folder)), folder / BUDGET_FILE,
                         root / REPORT_FILE, root / CURVES_FILE]
                commit(files, f"dp cost: {method} at ε = {level} finished")
    print(write_report(root, cells, command.strip(), args.level))
    return 0


if __name__ == "__main__":
    sys.exit(main())
