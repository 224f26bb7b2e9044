"""How sensitive is FGRPO to its RPG and server hyperparameters on the embedded benchmark, and what do its weights and
its server step follow?

The sweep of the paper's Appendix D (Tables 10-11: τ_min ∈ {1.0, 2.0}, λ_base ∈ {0.6, 0.9}, the rest at Algorithm 1's
defaults) and of the server learning rate α (Eq. model_update), run as FGRPO cells of the verdict grid
(`benchmarks/verdict.py`) with one `rpg_*` or `server_*` field changed. Each cell is paired with the grid's default
FGRPO cell of the same seed (same partition, same local budget), so the verdict grid must have run that seed first; the
base model's evaluation is the grid's too (no cell here evaluates it again).

It also reads the grid's FGRPO cells for why the weights move: with W local steps of B completions, a client's R̄
is a success rate over W·B samples, whose sampling error alone is sqrt(R̄(1 − R̄)/(W·B)); RPG divides the change of
R̄ by σ ≥ σ_min (Eq. rpg), so sampling noise of that size is already |h| ≈ SE/σ_min before any real progress. And the
server's Adam step (Eq. model_update, no bias correction) moves every coordinate by about α whatever the size of the
clients' mean change Δ: the ratio of the two, read from the cells' round checkpoints, says how much the server
amplifies Δ.

    python benchmarks/rpg_sensitivity.py [--grid benchmarks/results/verdict] [--seeds 0 1 2]
        [--output_dir benchmarks/results/rpg-sensitivity] [--settings rpg_tau_min=1.0 ...] [--report_only]

Reruns resume: a finished cell is skipped, an interrupted one resumes from its last round checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
from pathlib import Path

import yaml

from harness.cells import METRICS, cell_metrics, points, with_shared_base
from harness.grid import run_timed_cell
from harness.significance import t_interval
from trl_federated.methods import METHODS
from trl_federated.reports.compare import Cell, load_result, markdown

# Appendix D, Tables 10 (λ_base) and 11 (τ_min); Algorithm 1's defaults are λ_base = 0.8, τ_min = 1.5.
DEFAULT = "(default)"  # the grid's own FGRPO cells, the reference of every paired difference
RPG_METHODS = [name for name, method in METHODS.items() if method.aggregation == "rpg" and method.algorithm == "grpo"]
PAPER_SETTINGS = ["rpg_tau_min=1.0", "rpg_tau_min=2.0", "rpg_lambda_base=0.6", "rpg_lambda_base=0.9"]


def parse_setting(text: str) -> tuple[str, str]:
    from trl_federated.config import FedGRPOConfig

    names = sorted(f.name for f in dataclasses.fields(FedGRPOConfig) if f.name.startswith(("rpg_", "server_")))
    field, separator, value = text.partition("=")
    if not separator or field not in names or not value:
        raise argparse.ArgumentTypeError(f"A setting is <field>=<value> with one of {', '.join(names)}; got {text!r}.")
    return field, value


def weight_diagnostics(result: dict, completions_per_window: int) -> dict[str, float]:
    """From a finished FGRPO cell's rounds after round 0 (h = 0 there by construction): the mean |h|, the mean
    spread max ω − min ω, and the mean sampling error of the clients' R̄ over `completions_per_window` samples."""
    gains, spreads, errors = [], [], []
    for record in result["rounds"][1:]:
        gains += [abs(h) for h in record["gains"].values()]
        weights = record["weights"].values()
        spreads.append(max(weights) - min(weights))
        errors += [math.sqrt(r * (1 - r) / completions_per_window) for r in record["rewards"].values()]
    return {"mean_abs_h": statistics.fmean(gains), "weight_spread": statistics.fmean(spreads),
            "reward_standard_error": statistics.fmean(errors)}


def server_step_ratio(directory: Path) -> float | None:
    """How far the server's Adam step moves LoRA B against the clients' own mean change Δ (Eq. model_diff), mean over
    rounds of mean|θ^{[t+1]} − θ^{[t]}| / mean|Δ^{[t]}|, from the cell's round checkpoints 0, 1, ...:
    Δ^{[t]} = (m^{[t]} − β1 m^{[t−1]}) / (1 − β1) (Eq. momentum) and θ^{[0]}_B = 0 (LoRA's initialisation). 1 is
    plain averaging; None without Adam moments."""
    from trl_federated.core.checkpoint import list_checkpoints, read_checkpoint

    ratios, previous_m, previous_b = [], None, None
    for round_idx, path in enumerate(list_checkpoints(directory)):
        checkpoint = read_checkpoint(path)
        if checkpoint.round_idx != round_idx:  # an earlier round's checkpoint is gone: its θ and m are unknown
            break
        moments = checkpoint.aggregator.get("server_optimizer", {}).get("m")
        if moments is None:
            return None
        beta1 = checkpoint.identity["training"]["server_beta1"]
        m = {key: value for key, value in moments.items() if "lora_B" in key}
        b = {key: checkpoint.global_state[key] for key in m}
        delta = sum(((m[key] - beta1 * previous_m[key] if previous_m else m[key]) / (1 - beta1)).abs().sum().item()
                    for key in m)
        step = sum((b[key] - previous_b[key] if previous_b else b[key]).abs().sum().item() for key in m)
        ratios.append(step / delta)
        previous_m, previous_b = m, b
    return statistics.fmean(ratios) if ratios else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", default="examples/configs/verdict.yaml", help="The verdict grid's base config.")
    parser.add_argument("--grid", default="benchmarks/results/verdict", help="The verdict grid's folder.")
    parser.add_argument("--output_dir", default="benchmarks/results/rpg-sensitivity")
    parser.add_argument("--settings", nargs="+", type=parse_setting, default=[parse_setting(s) for s in PAPER_SETTINGS])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--method", default="fgrpo-paper", choices=RPG_METHODS,
                        help="The FGRPO configuration swept; the committed report is of the paper's server Adam, which "
                             "the first grid ran as its FGRPO.")
    parser.add_argument("--num_clients", type=int, default=3)
    parser.add_argument("--dirichlet_alpha", default="0.05")
    parser.add_argument("--report_only", action="store_true", help="Run nothing: report the cells finished so far.")
    args = parser.parse_args(argv)
    grid, root = Path(args.grid), Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    cell = functools.partial(fgrpo_cell, args)
    missing = [seed for seed in args.seeds if not (cell(seed).directory(grid) / "result.json").exists()]
    if missing and not args.report_only:
        parser.error(f"The verdict grid in {grid} has no finished default FGRPO cell for seed(s) {missing}: run "
                     f"`python benchmarks/verdict.py --config {args.config} --output_dir {grid} --methods "
                     f"{args.method}` first (its cells are the reference every setting is paired with).")
    if not args.report_only:
        for field, value in args.settings:
            for seed in args.seeds:
                run_timed_cell(cell(seed), args.config, root / f"{field}={value}",
                                       [f"--{field}", value, "--eval_initial", "false"])
    print(report(args, grid, root))
    return 0


def fgrpo_cell(args: argparse.Namespace, seed: int) -> Cell:
    return Cell(args.method, seed, args.num_clients, args.dirichlet_alpha)


def report(args: argparse.Namespace, grid: Path, root: Path) -> str:
    """rpg-sensitivity.md and .json: per setting the gains, the paired difference against the default, the weights.
    A setting's cells live in `root`/<field>=<value>, laid out as the grid's."""
    cell = functools.partial(fgrpo_cell, args)
    config = yaml.safe_load(Path(args.config).read_text(encoding="utf-8"))
    completions = (
        config["reward_window"] * config["per_device_train_batch_size"] * config["gradient_accumulation_steps"]
    )

    def finished_seeds(folder: Path) -> list[int]:
        return sorted(int(path.parent.name.removeprefix("seed"))
                      for path in cell(0).directory(folder).parent.glob("seed*/result.json"))

    # The grid's default cells and every setting run so far, in this command or an earlier one, with each seed it
    # finished; the base model's evaluation lives in the grid's first cell.
    found = {path.name for path in root.glob("*=*") if path.is_dir()}
    settings = sorted(found | {f"{field}={value}" for field, value in args.settings})
    folders = {DEFAULT: grid, **{name: root / name for name in settings}}
    results = with_shared_base({
        (name, seed): load_result(cell(seed).directory(folder))
        for name, folder in folders.items() for seed in finished_seeds(folder)
    })
    if not results:
        return "The verdict grid has no finished cell with the base model's evaluation yet.\n"
    metrics = {key: cell_metrics(result) for key, result in results.items()}
    rows, records = [], []
    for name, folder in folders.items():
        seeds = sorted(seed for setting, seed in results if setting == name)
        if not seeds:
            continue
        paired = None
        if name != DEFAULT:  # setting − default, seed by seed
            common = [seed for seed in seeds if (DEFAULT, seed) in metrics]
            paired = {
                key: t_interval([metrics[name, seed][f"{key}_gain"] - metrics[DEFAULT, seed][f"{key}_gain"]
                                         for seed in common])
                for key in METRICS
            }
        diagnostics = [weight_diagnostics(results[name, seed], completions) for seed in seeds]
        mean = {key: statistics.fmean(d[key] for d in diagnostics) for key in diagnostics[0]}
        ratios = [r for r in (server_step_ratio(cell(seed).directory(folder)) for seed in seeds) if r is not None]
        mean["server_step_ratio"] = statistics.fmean(ratios) if ratios else None
        gains = {f"{key}_gain": t_interval([metrics[name, seed][f"{key}_gain"] for seed in seeds])
                 for key in METRICS}
        record = {"setting": name, "seeds": seeds, **gains, "paired_vs_default": paired, **mean}
        records.append(record)
        rows.append([
            name, str(len(seeds)), points(record["total_gain"]), points(record["hard_gain"]),
            points(paired["total"]) if paired else "—", points(paired["hard"]) if paired else "—",
            f"{mean['mean_abs_h']:.2f}", f"{mean['weight_spread']:.2f}", f"{mean['reward_standard_error']:.3f}",
            "—" if mean["server_step_ratio"] is None else f"{mean['server_step_ratio']:.1f}",
        ])
    header = ["Setting", "Seeds", "Total gain [95% CI]", "Hard gain [95% CI]", "Setting − default, total",
              "Setting − default, hard", "Mean abs(h)", "Mean ω spread", "SE of R̄",
              "Server step / Δ"]
    text = (
        "# RPG sensitivity: FGRPO with one hyperparameter changed (the paper's Appendix D sweep)\n\n"
        "A row's cells: `python benchmarks/rpg_sensitivity.py --settings <setting> --seeds <its seeds>` (rerun to "
        "resume); this report, from every setting finished so far: `python benchmarks/rpg_sensitivity.py "
        "--report_only`.\n\n"
        f"Grid: `{grid}` (the default row and the reference of every paired difference: same seed, same partition). "
        "Accuracy gains in points over the base model on the verdict test split; 95% t-intervals over seeds (none "
        "with one seed). Mean abs(h) and mean ω spread (max ω − min ω of a round) over rounds 1.. (h = 0 in round 0); "
        f"SE of R̄: the sampling error sqrt(R̄(1 − R̄)/n) of a client's window reward over n = {completions} "
        "completions (W × batch), to be read against σ_min, the floor of RPG's volatility (Eq. rpg). Server step / Δ: "
        "mean |θ^{t+1} − θ^t| over mean |Δ^t| of LoRA B, averaged over rounds (1 = plain averaging; Adam's step is "
        "about α per coordinate whatever Δ's size).\n\n"
        f"{markdown(header, rows)}\n"
    )
    (root / "rpg-sensitivity.md").write_text(text, encoding="utf-8")
    (root / "rpg-sensitivity.json").write_text(json.dumps({"completions_per_window": completions,
                                                           "settings": records}, indent=1), encoding="utf-8")
    return text


if __name__ == "__main__":
    sys.exit(main())
