# Plot a federated run's round metrics from its TensorBoard event files, offline (no TensorBoard server).
"""
A federated run with `report_to: tensorboard` logs one entry per round (see `docs/federate-trl.md`): per client
`train/<client>/reward_window` (R̄), `rpg_gain` (h) and `weight` (ω), and the RPG temperature `train/temperature` (τ).
This script reads them with TensorBoard's `EventAccumulator` and draws the four panels in one PNG:

    python examples/scripts/plot_tensorboard.py outputs/custom-trainer docs/round_metrics.png

The first argument is the folder that holds the event files, or any folder above it (e.g. the run's `output_dir`,
under which TRL writes `runs/<date>_<host>/`); with several runs below it, the newest is plotted.
"""

import argparse
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

# (TensorBoard tag suffix, panel title): per-client metrics, then the server's temperature.
CLIENT_METRICS = (("reward_window", "R̄: client's mean reward over its last W steps"),
                  ("rpg_gain", "h: relative performance gain"),
                  ("weight", "ω: aggregation weight"))  # fmt: skip
TEMPERATURE = ("temperature", "τ: RPG softmax temperature")


def newest_event_dir(root: Path) -> Path:
    """The folder of the newest `events.out.tfevents.*` file at or below `root`."""
    events = sorted(root.rglob("events.out.tfevents.*"), key=lambda path: path.stat().st_mtime)
    if not events:
        raise SystemExit(f"No TensorBoard event files under {root}: was the run started with report_to tensorboard?")
    return events[-1].parent


def read_rounds(event_dir: Path) -> tuple[dict[str, dict[str, list[float]]], list[float], list[int]]:
    """Per metric, per client, the value of every round; τ per round; and the logged step of every round."""
    events = EventAccumulator(str(event_dir), size_guidance={"scalars": 0}).Reload()  # 0: keep every point
    tags = events.Tags()["scalars"]
    clients = sorted({match.group(1) for tag in tags if (match := re.fullmatch(r"train/(.+)/weight", tag))})
    if not clients:
        raise SystemExit(f"{event_dir} has no `train/<client>/weight` scalars: not a federated run's events.")
    values = {
        name: {client: [event.value for event in events.Scalars(f"train/{client}/{name}")] for client in clients}
        for name, _ in CLIENT_METRICS
    }
    temperature = [event.value for event in events.Scalars("train/temperature")] if "train/temperature" in tags else []
    steps = [event.step for event in events.Scalars(f"train/{clients[0]}/weight")]
    return values, temperature, steps


def plot(values, temperature, steps, output: Path, title: str) -> None:
    rounds = list(range(1, len(steps) + 1))
    figure, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    for axis, (name, label) in zip(axes.flat, CLIENT_METRICS):
        for client, series in values[name].items():
            axis.plot(rounds[: len(series)], series, marker="o", markersize=3, label=client)
        axis.set_title(label, fontsize=10)
    axes[0, 0].legend(fontsize=8)
    axis = axes.flat[3]
    if temperature:
        axis.plot(rounds[: len(temperature)], temperature, marker="o", markersize=3, color="black")
    axis.set_title(TEMPERATURE[1] + ("" if temperature else " (not logged: aggregation is not RPG)"), fontsize=10)
    for axis in axes[1]:
        axis.set_xlabel("round")
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=90)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logdir", type=Path, help="Folder with the event files, or a folder above it.")
    parser.add_argument("output", type=Path, help="PNG to write.")
    parser.add_argument("--title", default=None, help="Figure title (default: the event folder).")
    args = parser.parse_args()
    event_dir = newest_event_dir(args.logdir)
    values, temperature, steps = read_rounds(event_dir)
    plot(values, temperature, steps, args.output, args.title or str(event_dir))
    print(f"{len(steps)} rounds x {len(values['weight'])} clients from {event_dir} -> {args.output}")


if __name__ == "__main__":
    main()
