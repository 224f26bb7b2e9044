"""Human-facing outputs of a run: `summary.md` and PNG plots, rewritten after every round."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import TrainerCallback

from ..core.admission import bounded_text
from ..core.callbacks import RoundCallback
from ..core.round_record import RoundRecord

logger = logging.getLogger(__name__)

# How summary.md numbers rounds: as the files of the run do.
ROUND_NUMBERING = (
    "Rounds are numbered t = 0, 1, ..., as the global adapters `round-<t>/`, the checkpoints `checkpoint-<t>/` and "
    "`round_idx` in metrics.jsonl and result.json: \"Round t\" is the global adapter after round t."
)


def plot_label(text: str) -> str:
    """A client's name or label as matplotlib shows it literally: its `$` escaped, so a name cannot open math text
    (whose parser raises on what it cannot read), nor a leading `_` hide the line from the legend."""
    return str(text).replace("$", r"\$").lstrip("_") or "?"


def round_label(round_idx: int, num_rounds: int) -> str:
    """How a console line names a round: its index t, as every file and log line names it, then its position among
    the run's rounds, as Flower's own `[ROUND k/T]` lines count them: "0 (1/3)"."""
    return f"{round_idx} ({round_idx + 1}/{num_rounds})"


def format_round_table(history: list[RoundRecord]) -> str:
    """Markdown table of every client's R̄, ω and traffic, round by round, with a column per round metric of the
    aggregator (`RoundRecord.round_metrics`, headed by its label and printed in its format: RPG's τ per round, h per
    client; "-" where a round has none), and of the clients dropped (their reasons are in metrics.jsonl); rounds are
    numbered t = 0, 1, ... (`ROUND_NUMBERING`), the paper's t that sets τ^{[t]}. An aggregator without round metrics
    leaves one column of "-" in their place."""
    specs = {metric.name: metric for record in history for metric in record.round_metrics}
    per_round = [metric for metric in specs.values() if not metric.per_client] or [None]
    per_client = [metric for metric in specs.values() if metric.per_client] or [None]

    def header(metrics) -> str:
        return " | ".join("-" if metric is None else metric.label for metric in metrics)

    def cell(metric, values: dict, client_id: str | None = None) -> str:
        value = None if metric is None else values.get(metric.name)
        if client_id is not None and isinstance(value, dict):
            value = value.get(client_id)
        return "-" if value is None or isinstance(value, dict) else format(value, metric.format)

    lines = [
        f"| Round | {header(per_round)} | Client | R̄ | {header(per_client)} | ω | Sent (bytes) | Received (bytes) |",
        "|" + "---:|" * (1 + len(per_round)) + "---|" + "---:|" * (4 + len(per_client)),
    ]
    for record in history:
        values = record.metric_values()
        shown = " | ".join(cell(metric, values) for metric in per_round)
        for client_id, reward in record.rewards.items():
            clients = " | ".join(cell(metric, values, client_id) for metric in per_client)
            lines.append(
                f"| {record.round_idx} | {shown} | {client_id} | {reward:.3f} | {clients} | "
                f"{record.weights[client_id]:.3f} | {record.bytes_sent[client_id]:,} | "
                f"{record.bytes_received[client_id]:,} |"
            )
        for client_id in record.dropped:
            dashes = " | ".join("-" for _ in per_client)
            lines.append(f"| {record.round_idx} | {shown} | {client_id} | dropped | {dashes} | - | - | - |")
    return "\n".join(lines)


# What the round table's own columns mean; the aggregator's columns say it themselves (`RoundMetric.legend`).
COLUMN_LEGENDS = {
    "Round": "t, the round (`round_idx`)",
    "R̄": "the mean reward the client reported: of its last `reward_window` local steps, each step's over its prompts "
    "× completions; under `rpg_signal: held-out`, its local model's greedy mean reward on its held-out items",
    "ω": "the weight the client's adapter took in the round's combination: the method's (data volume, RPG's softmax), "
    "renormalised over the clients a robust combiner kept (0 for those it left out, under `krum`/`multi_krum`); under "
    "`trimmed_mean`, `median` and `bulyan`, which combine coordinate by coordinate, the method's weight as computed",
    "Sent (bytes)": "the client's update as it went on the wire",
    "Received (bytes)": "the global adapter the client received",
}


def format_legend(history: list[RoundRecord]) -> str:
    """The legend of `format_round_table`'s columns: its own (`COLUMN_LEGENDS`), then each aggregator metric's
    (`RoundMetric.legend`), one line each, by the label that heads the column."""
    specs = {metric.name: metric for record in history for metric in record.round_metrics}
    legends = [*COLUMN_LEGENDS.items(), *((metric.label, metric.legend) for metric in specs.values() if metric.legend)]
    return "\n".join(f"- {label}: {text}." for label, text in legends)


def format_communication(history: list[RoundRecord]) -> str:
    """One line of the per-round traffic of a client, the paper's Table 4 quantity: the adapter a client uploads
    and the global adapter it downloads, averaged over the clients and rounds of `history` (with LoRA they are all
    the size of one adapter). Table 4's "MB" are mebibytes: its LoRA sizes match MiB to within 0.1%."""
    sent = [size for record in history for size in record.bytes_sent.values()]
    received = [size for record in history for size in record.bytes_received.values()]
    mean_sent, mean_received = sum(sent) / len(sent), sum(received) / len(received)
    return (
        f"Per client and round: {mean_sent / 2**20:.3f} MiB sent ({mean_sent:,.0f} bytes, its adapter), "
        f"{mean_received / 2**20:.3f} MiB received ({mean_received:,.0f} bytes, the global adapter)."
    )


def format_evaluations(evaluations: dict[int, dict[str, Any]]) -> str:
    """The accuracy table of a run's evaluations (round index -1: before training), rows named as the paper's
    Table 1 names them, "Round t" for the global adapter `round-<t>/` (`ROUND_NUMBERING`)."""
    from ..core.evaluation import format_accuracy_table

    named = {
        ("Before training" if idx < 0 else f"Round {idx}"): result for idx, result in sorted(evaluations.items())
    }
    return format_accuracy_table(named)


def information_reading(history: list[RoundRecord]) -> str:
    """What the run's last `gain_predictiveness_z` says in words (an aggregator that weighs by reward gains reports
    it, RPG), or "" without one."""
    values = {metric.name: metric.value for metric in history[-1].round_metrics} if history else {}
    z, observed, null = (values.get(name) for name in (
        "gain_predictiveness_z", "gain_predictiveness_run", "gain_predictiveness_null"))  # fmt: skip
    if z is None:
        return ""
    verdict = ("carried information" if z > 2 else "carried no information detectable" if z > -2
               else "predicted worse than no information")  # fmt: skip
    return (f"RPG's weights {verdict} about the clients' next change of R̄: z = {z:+.2f} (over the run, corr(h, next "
            f"ΔR̄) = {observed:+.3f} against {null:+.3f} with no information, each client's R̄ permuted over its "
            "rounds; |z| < 2 is within chance).")


def write_summary(
    path: str | Path,
    history: list[RoundRecord],
    evaluations: dict[int, dict[str, Any]],
    header: str = "",
) -> Path:
    """`summary.md`: accuracy before/after (paper's Table 1 layout), the communication per client and round (Table 4),
    then the per-round table."""
    sections = ["# Federated run summary", header, ROUND_NUMBERING if evaluations or history else ""]
    if evaluations:
        sections += ["## Accuracy (%)", format_evaluations(evaluations)]
        timed = [result["seconds"] for result in evaluations.values() if "seconds" in result]
        if timed:
            rows = next(iter(evaluations.values()))["count"]["Total"]
            sections.append(
                f"Evaluation: {rows} rows, greedy, {sum(timed) / len(timed):.1f} s per pass "
                f"({len(timed)} passes, {sum(timed):.0f} s in all)."
            )
    if history:
        wall = sum(record.wall_time for record in history)
        sections += ["## Communication", format_communication(history)]
        sections += [f"## Rounds ({len(history)} rounds, {wall:.0f} s)", format_round_table(history),
                     format_legend(history), information_reading(history)]
    path = Path(path)
    path.write_text("\n\n".join(section for section in sections if section) + "\n", encoding="utf-8")
    return path


def plot_run(output_dir: str | Path, history: list[RoundRecord], evaluations: dict[int, dict[str, Any]]) -> list[Path]:
    """Reward per local step for each client, aggregation weights per round, accuracy per round.

    Figures are built without pyplot, so writing them never switches the backend of a notebook or script that
    also plots.
    """
    from matplotlib.figure import Figure

    output_dir = Path(output_dir)
    written = []
    client_ids = sorted({client for record in history for client in record.rewards})

    figure = Figure(figsize=(7, 4))
    axis = figure.subplots()
    for client_id in client_ids:
        rewards = [
            reward
            for record in history
            for reward in record.client_metrics.get(client_id, {}).get("step_rewards", [])
        ]
        axis.plot(range(1, len(rewards) + 1), rewards, marker=".", label=plot_label(client_id))
    axis.set(xlabel="local step (all rounds)", ylabel="mean step reward R̄[t,e]", title="Reward per local step")
    axis.legend(fontsize="small")
    written.append(_save(figure, output_dir / "rewards.png"))

    figure = Figure(figsize=(7, 4))
    axis = figure.subplots()
    for client_id in client_ids:
        points = [(r.round_idx, r.weights[client_id]) for r in history if client_id in r.weights]
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=plot_label(client_id))
    axis.set(xlabel="round t (as round-<t>/)", ylabel="aggregation weight ω", title="Aggregation weights per round")
    axis.xaxis.get_major_locator().set_params(integer=True)
    axis.legend(fontsize="small")
    written.append(_save(figure, output_dir / "weights.png"))

    if evaluations:
        figure = Figure(figsize=(7, 4))
        axis = figure.subplots()
        rounds = sorted(evaluations)
        labels = list(evaluations[rounds[0]]["accuracy"])
        for label in labels:
            axis.plot(
                rounds,
                [100 * evaluations[idx]["accuracy"].get(label, float("nan")) for idx in rounds],
                marker="o",
                linewidth=2.5 if label == "Total" else 1.0,
                label=plot_label(label),
            )
        axis.set(xlabel="round t (as round-<t>/; -1: before training)", ylabel="accuracy (%)",
                 title="Test accuracy per round")
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.legend(fontsize="small")
        written.append(_save(figure, output_dir / "accuracy.png"))
    return written


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path


class ReportCallback(RoundCallback):
    """Rewrites `summary.md` and the plots in `output_dir` after every round and evaluation, so an interrupted
    run still leaves an up-to-date report."""

    def __init__(self, output_dir: str | Path, header: str = ""):
        self.output_dir = Path(output_dir)
        self.header = header
        self.history: list[RoundRecord] = []
        self.evaluations: dict[int, dict[str, Any]] = {}

    def on_evaluate_round(self, args, round_idx, results, **kwargs):
        self.evaluations[round_idx] = results
        if round_idx < 0:
            self._write()

    def on_round_end(self, args, record, **kwargs):
        self.history.append(record)
        self._write()

    def on_resume(self, args, round_idx, history, evaluations, **kwargs):
        self.history, self.evaluations = list(history), dict(evaluations)

    def _write(self) -> None:
        """summary.md and the plots; a failure is logged, never raised: a report cannot stop a round (the round is
        checkpointed whatever becomes of its report, and the next round rewrites it from the whole history)."""
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            write_summary(self.output_dir / "summary.md", self.history, self.evaluations, self.header)
            if self.history:
                plot_run(self.output_dir, self.history, self.evaluations)
        except Exception as error:  # noqa: BLE001 - anything a report does wrong, the run goes on
            logger.warning("The run's summary and plots were not written (%s: %s); the run goes on.",
                           type(error).__name__, bounded_text(error, 300))


class RunProgress(TrainerCallback):
    """The runner's progress bar, counted in local steps (rounds x clients sampled a round x `local_steps`), so that
    it moves while a client trains and its rate and time left are those of training. The postfix names the round, the
    client, its local step, its last logged reward and its seconds per step. Passed to every client's trainer; the
    runner calls `start_client`/`end_client` around each client's round. A context manager: while it is open, the
    console's log lines (the package's and transformers') are written above the bar (`logging_redirect_tqdm`), not
    glued onto it."""

    def __init__(self, num_rounds: int, clients_per_round: int, local_steps: int, first_round: int, disable: bool):
        self.num_rounds, self.num_clients, self.local_steps = num_rounds, clients_per_round, local_steps
        self.bar = tqdm(
            total=num_rounds * self.num_clients * local_steps,
            initial=min(first_round, num_rounds) * self.num_clients * local_steps,
            desc="Federated rounds",
            unit="step",
            disable=disable,
        )
        self._redirect = logging_redirect_tqdm(loggers=[logging.getLogger(), logging.getLogger("transformers")])

    def __enter__(self) -> RunProgress:
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self.bar.close()
        self._redirect.__exit__(*exc_info)

    def start_client(self, round_idx: int, client_id: str) -> None:
        self.round_idx, self.client_id = round_idx, client_id
        self.steps, self.reward = 0, None
        self.started = time.perf_counter()
        self._show()

    def end_client(self) -> None:
        """Account for the steps a client did not take (it failed or stopped at its deadline)."""
        self.bar.update(self.local_steps - self.steps)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        self.bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and logs.get("reward") is not None:
            self.reward = logs["reward"]
        self._show()

    def _show(self) -> None:
        parts = [
            f"round {round_label(self.round_idx, self.num_rounds)}", self.client_id,
            f"step {self.steps}/{self.local_steps}",
        ]
        if self.reward is not None:
            parts.append(f"reward {self.reward:.3f}")
        if self.steps:
            parts.append(f"{(time.perf_counter() - self.started) / self.steps:.1f} s/step")
        self.bar.set_postfix_str(", ".join(parts))
