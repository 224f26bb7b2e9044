"""Round-level callbacks fired by `FederatedRunner`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

from ..aggregation.update import RoundMetric
from .round_record import RoundRecord


class RoundCallback(TrainerCallback):
    """A `TrainerCallback` that also hears the federation.

    The runner passes every `RoundCallback` to each client's trainer too, so the usual `on_step_end`/`on_log`
    hooks see local training, while these hooks see the rounds. Only the main process fires them.
    """

    def on_round_begin(self, args, round_idx: int, **kwargs):
        """Before the clients of round `round_idx` start."""

    def on_client_end(self, args, round_idx: int, update, **kwargs):
        """After client `update.client_id` reported its `ClientUpdate` (adapter, R̄, metrics)."""

    def on_client_dropped(self, args, round_idx: int, client_id: str, kind: str, reason: str, **kwargs):
        """Client `client_id` is left out of round `round_idx`: `kind` is 'error', 'timeout' or 'invalid_update'."""

    def on_round_end(self, args, record: RoundRecord, **kwargs):
        """After aggregation: `record` holds R̄, ω, the aggregator's round metrics (RPG: h, τ), bytes and metrics of
        the round."""

    def on_round_saved(self, args, record: RoundRecord, global_state, num_clients: int, **kwargs):
        """After round `record.round_idx` was checkpointed: `global_state` is the adapter it made, `num_clients` the
        federation's clients. The round's lines in the log hang here (`reports.round_log.RoundLog`)."""

    def on_adapter_saved(self, args, model, output_dir, num_clients: int, evaluations: dict[int, dict[str, Any]],
                         privacy: str | None, **kwargs):
        """The run's final adapter is saved in `output_dir`: what describes it goes beside it (the model card,
        `reports.hub.ModelCardReport`; `privacy` is the guarantee the run reached, None without DP)."""

    def on_run_end(self, args, **kwargs):
        """The run is over and saved on every process (the Hub push hangs here, last)."""

    def on_resume(
        self, args, round_idx: int, history: list[RoundRecord], evaluations: dict[int, dict[str, Any]], **kwargs
    ):
        """A checkpoint of round `round_idx` was restored and the run goes on with the next round; `history` and
        `evaluations` are what the interrupted run had recorded up to it."""

    def on_evaluate_round(self, args, round_idx: int, results: dict[str, Any], **kwargs):
        """After the global adapter was evaluated; `round_idx` is -1 for the evaluation before training."""

    def on_client_evaluation(self, args, round_idx: int, results: dict[str, Any], **kwargs):
        """After clients evaluated the global adapter of round `round_idx` on their own held-out data (Flower's
        evaluate round, `fraction_evaluate`): `results` holds the pooled "accuracy" and "count" per label, each
        client's under "clients" and the reason of each client that has none under "failed"."""


# The round log's own entries (`round_logs`): the server's, and under `<client_id>/` each client's, with the
# evaluation's `eval_` entries, and the aggregator's round metrics under their log names (`RoundMetric.log_entry`). A
# client's metrics never take these names (`admission.UpdateGate` drops such a metric, and `round_logs` writes the
# server's entries last).
# The server step's entries, `RoundRecord` fields of the same names.
SERVER_STEP_LOGS = (
    "delta_norm", "server_step_norm", "server_step_ratio", "server_step_cosine", "server_step_momentum_cosine",
    "server_step_norm_a", "server_step_norm_b",
)
ROUND_LOG_NAMES = frozenset({
    "round", "num_clients", "num_sampled", "reward", *SERVER_STEP_LOGS, "bytes_sent", "bytes_received",
    "num_dropped", "step", "epoch",
})
CLIENT_LOG_NAMES = frozenset({"reward_window", "weight", "bytes_sent", "update_norm", "update_cosine"})
EVALUATION_LOG_PREFIX = "eval_"
# Differential privacy's round metrics (`privacy.ClientLevelPrivacy.round_metrics`: `dp_epsilon`, `dp_noise_std`,
# `<client_id>/dp_reward`): reserved whether or not the run is private, so that no client adds an ε to a run without DP.
PRIVACY_LOG_PREFIX = "dp_"


# What a client id may not be or start with (`admission.check_client_id`): its entries are `<client_id>/<name>`, and
# an id that is a prefix of the server's own entries writes them. `eval_` and `test_` are also the prefixes that
# Trainer's integrations (`rewrite_logs`) turn into their own sections (`eval/accuracy/Total`); `train`, `eval` and
# `test` are those sections; the others are the first components of TRL's GRPO metric names (`rewards/<f>/mean`,
# `completions/mean_length`, ...), whose means over the clients the round log keeps under those names.
RESERVED_CLIENT_ID_PREFIXES = (EVALUATION_LOG_PREFIX, "test_", PRIVACY_LOG_PREFIX)
RESERVED_CLIENT_IDS = frozenset({
    "train", "eval", "test", *ROUND_LOG_NAMES, *CLIENT_LOG_NAMES,
    "rewards", "completions", "clip_ratio", "sampling", "tools",
})


def reserved_client_id_fault(client_id: str, round_metrics: Iterable[RoundMetric] = ()) -> str | None:
    """Why `client_id` would forge the server's own log entries (None if it would not): it is one of their names or
    prefixes (`RESERVED_CLIENT_IDS`, the name of a `round_metrics` entry) or starts with
    `RESERVED_CLIENT_ID_PREFIXES`."""
    if client_id.startswith(RESERVED_CLIENT_ID_PREFIXES):
        prefix = next(prefix for prefix in RESERVED_CLIENT_ID_PREFIXES if client_id.startswith(prefix))
        return f"it starts with {prefix!r}, a prefix of the server's own log entries"
    if client_id in RESERVED_CLIENT_IDS or client_id in {metric.log_entry for metric in round_metrics}:
        return "it is the name of one of the server's own log entries or their groups"
    return None


def metric_log_name(name: str) -> str:
    """The round log's name for a client metric: TRL's (`train_loss` is `loss`)."""
    return name.removeprefix("train_")


def is_reserved_metric(name: str, round_metrics: Iterable[RoundMetric] = ()) -> bool:
    """Whether a client metric named `name` would take the name of one of the round log's own entries: the server's,
    an evaluation's, a client's (`weight`, and `<any client>/weight`), one of the aggregator's `round_metrics`, or
    differential privacy's (`dp_...`, in any run)."""
    name = metric_log_name(name)
    round_metrics = list(round_metrics)
    round_names = ROUND_LOG_NAMES | {metric.log_entry for metric in round_metrics if not metric.per_client}
    client_names = CLIENT_LOG_NAMES | {metric.log_entry for metric in round_metrics if metric.per_client}
    return (
        name in round_names or name.rsplit("/", 1)[-1] in client_names
        or name.startswith(EVALUATION_LOG_PREFIX)
        or name.startswith(PRIVACY_LOG_PREFIX) or name.rsplit("/", 1)[-1].startswith(PRIVACY_LOG_PREFIX)
    )


# A client's entries of the round log that differential privacy releases or that are public: its weight (from R̃ or
# the sample counts), its traffic, its released R̃ and the gain RPG computed from it.
RELEASED_UNDER_DP = ("weight", "bytes_sent", "dp_reward", "rpg_gain")


def round_logs(record: RoundRecord) -> dict[str, float]:
    """One round as a flat log entry named as TRL names its step logs.

    Each client's values are under `<client_id>/`: R̄ (`reward_window`), ω (`weight`),
    `bytes_sent`, its update's norm ‖θ_i − θ^{[t]}‖ (`update_norm`) and cosine with the clients' mean change Δ
    (`update_cosine`), and its scalar metrics (`loss`, `seconds`, and the means over its local steps of TRL's step
    metrics: `completions/mean_length`, `kl`, `frac_reward_zero_std` (its GRPO groups whose rewards were all equal),
    ...). Their means over the aggregated clients keep TRL's own names (`reward` is the mean R̄), so the curves
    overlay a `GRPOTrainer` run's; then the round's totals (`num_clients` aggregated of `num_sampled`), the
    aggregator's round metrics under their log names (`RoundMetric`: RPG's τ as `temperature`, each client's h as
    `<client_id>/rpg_gain`), the server step s (`delta_norm` ‖Δ‖, `server_step_norm` ‖s‖ = ‖θ^{[t+1]} − θ^{[t]}‖
    and their ratio `server_step_ratio`, `server_step_cosine` cos(s, Δ), `server_step_momentum_cosine`
    cos(s, s^{[t-1]}), and ‖s‖ over the LoRA A and B factors, `server_step_norm_a` and `_b`), and
    the evaluation if the round had one (`evaluation_logs`). Trainer's TensorBoard, W&B and Trackio integrations
    show them as `train/reward`, `train/client_0/weight`, `eval/accuracy/Total`, ... Under differential privacy
    (the record carries `dp_epsilon`) a client's raw values are left out: its metrics and their means, R̄ and its mean,
    its update's norm and cosine; only `RELEASED_UNDER_DP` and the round's totals remain.
    """
    # Under differential privacy only what the mechanism released, or what is public, leaves the server this way
    # (report_to, Flower's MetricRecord): no client's raw R̄, metrics or update geometry (metrics.jsonl, a local file,
    # keeps them).
    private = any(metric.name == "dp_epsilon" for metric in record.round_metrics)
    client_scalars = {} if private else {
        client_id: {
            metric_log_name(name): value
            for name, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            and not is_reserved_metric(name, record.round_metrics)
        }
        for client_id, metrics in record.client_metrics.items()
    }
    clients = {*record.rewards, *record.dropped, *record.client_metrics}
    logs: dict[str, float] = {}
    for name in sorted({name for scalars in client_scalars.values() for name in scalars}):
        if name.split("/", 1)[0] not in clients:
            values = [scalars[name] for scalars in client_scalars.values() if name in scalars]
            logs[name] = sum(values) / len(values)
    for client_id, scalars in client_scalars.items():
        for name, value in scalars.items():
            logs[f"{client_id}/{name}"] = value
    logs.update({"round": record.round_idx, "num_clients": len(record.rewards)})
    if record.sampled is not None:
        logs["num_sampled"] = len(record.sampled)
    if record.rewards and not private:
        logs["reward"] = sum(record.rewards.values()) / len(record.rewards)
    for metric in record.round_metrics:
        if not metric.per_client and metric.value is not None:
            logs[metric.log_entry] = metric.value
    for name in SERVER_STEP_LOGS:
        if getattr(record, name) is not None:
            logs[name] = getattr(record, name)
    logs["bytes_sent"] = sum(record.bytes_sent.values())
    logs["bytes_received"] = sum(record.bytes_received.values())
    logs["num_dropped"] = len(record.dropped)
    per_client = {
        "reward_window": record.rewards,
        **{metric.log_entry: metric.value or {} for metric in record.round_metrics if metric.per_client},
        "weight": record.weights,
        "bytes_sent": record.bytes_sent,
        "update_norm": record.update_norms,
        "update_cosine": record.update_cosines,
    }
    for name, values in per_client.items():
        if private and name not in RELEASED_UNDER_DP:
            continue
        for client_id, value in values.items():
            if value is not None:  # a cosine with a zero vector
                logs[f"{client_id}/{name}"] = value
    if record.evaluation is not None:
        logs.update(evaluation_logs(record.evaluation))
    return logs


def evaluation_logs(results: dict[str, Any]) -> dict[str, float]:
    """An evaluation result as `eval_`-prefixed log entries, as `Trainer.evaluate` names its metrics:
    `eval_accuracy/<label>` (with `Total`), `eval_rewards/<reward>/mean` and `eval_runtime`."""
    logs = {f"eval_accuracy/{label}": value for label, value in results["accuracy"].items()}
    logs.update(
        {f"eval_rewards/{name}/mean": value for name, value in results.get("rewards", {}).items() if value is not None}
    )
    logs["eval_runtime"] = results["seconds"]
    return logs


class IntegrationLog:
    """`Trainer`'s logging without a `Trainer`: a `TrainerState` and the `args.report_to` integrations, for a
    federation that `FederatedRunner` runs by itself (the drop-in `FedGRPOTrainer` logs through its own)."""

    def __init__(self, args, model, processing_class, is_main_process: bool):
        self.args = args
        self.state = TrainerState(is_local_process_zero=is_main_process, is_world_process_zero=is_main_process)
        self.control = TrainerControl()
        integrations = get_reporting_integration_callbacks(args.report_to)
        self.callback_handler = CallbackHandler(
            [DefaultFlowCallback, *integrations], model, processing_class, optimizer=None, lr_scheduler=None
        )

    def log(self, logs: dict[str, float]) -> None:
        """As `Trainer.log`: the entry joins `state.log_history` with its step and goes to every integration."""
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)


class TrainerLogCallback(RoundCallback):
    """Reports the federation through a trainer's logging (a `Trainer`, or an `IntegrationLog`), so that its
    `state` and the `report_to` integrations of its `args` see a federated run as they see a `Trainer` run.

    TRL's step is the local optimisation step: after round t, `state.global_step` is (t + 1) · `local_steps`, the
    number of steps every client has taken and the position in the federation's learning-rate schedule, so the
    curves line up with a non-federated run of `num_rounds * local_steps` steps. Each round is one `log()` entry
    (`round_logs`); the evaluation before training is one entry at step 0.
    """

    def __init__(self, trainer, local_steps: int):
        self.trainer = trainer
        self.local_steps = local_steps

    def on_evaluate_round(self, args, round_idx, results, **kwargs):
        if round_idx == -1:  # a round's own evaluation is part of its round entry
            self.trainer.log(evaluation_logs(results))

    def on_round_end(self, args, record, **kwargs):
        self.trainer.state.global_step = (record.round_idx + 1) * self.local_steps
        self.trainer.log(round_logs(record))

    def on_resume(self, args, round_idx, history, evaluations, **kwargs):
        # The integrations received these entries in the interrupted run: only the trainer's state is rebuilt.
        state = self.trainer.state
        state.log_history = []
        if -1 in evaluations:
            state.log_history.append({**evaluation_logs(evaluations[-1]), "step": 0})
        for record in history:
            state.log_history.append({**round_logs(record), "step": (record.round_idx + 1) * self.local_steps})
        state.global_step = (round_idx + 1) * self.local_steps


def fire_round_callbacks(callbacks: list, hook: str, args, **kwargs) -> None:
    """Call `hook` (e.g. "on_round_end") on every `RoundCallback` among `callbacks`."""
    for callback in callbacks:
        if isinstance(callback, RoundCallback):
            getattr(callback, hook)(args, **kwargs)


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def read_metrics(path: str | Path) -> Iterator[dict[str, Any]]:
    """The events of a metrics.jsonl, in order; a line a crash tore (or that holds no JSON object) is skipped, and a
    missing file has none."""
    path = Path(path)
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            yield event


def line_round(event: dict[str, Any]):
    """The round of a metrics.jsonl line: `round_idx` on every line (-1: the evaluation before training), or `round`,
    which a version before 2026-11-28 wrote on client, drop and evaluation lines; None for a line of no round."""
    return event.get("round_idx", event.get("round"))


def _round_of(line: str) -> float:
    """The round a metrics line belongs to: -inf for a line of no round, +inf for a line the crash tore (or whose
    round is no number: a client's metric named `round`, which a version before this one wrote into its line)."""
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return math.inf
    if not isinstance(event, dict):
        return math.inf
    value = line_round(event)
    if value is None:
        return -math.inf
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else math.inf


class MetricsLoggerCallback(RoundCallback):
    """Appends one JSON line per client report (its metrics under "metrics"), dropped client, round, evaluation and
    clients' evaluation (Flower's evaluate round) to `output_dir/metrics.jsonl`, each naming its round `round_idx`
    (-1: the evaluation before training), as the round lines (`RoundRecord.to_dict`) do.

    On resume it first removes the lines of the rounds after the checkpoint, which the interrupted run may have
    begun and the resumed run repeats, so the log reads like an uninterrupted run's plus a `resumed` line.
    """

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / "metrics.jsonl"

    def _write(self, event: str, payload: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as stream:
            stream.write(json.dumps(_json_safe({"event": event, **payload})) + "\n")

    def on_client_end(self, args, round_idx, update, **kwargs):
        # The client's metrics under their own key: whatever their names, they never read as the line's fields.
        self._write(
            "client",
            {
                "round_idx": round_idx,
                "client_id": update.client_id,
                "reward": update.reward,
                "num_samples": update.num_samples,
                "metrics": update.metrics,
            },
        )

    def on_client_dropped(self, args, round_idx, client_id, kind, reason, **kwargs):
        self._write("client_dropped", {"round_idx": round_idx, "client_id": client_id, "kind": kind, "reason": reason})

    def on_round_end(self, args, record, **kwargs):
        self._write("round", record.to_dict())

    def on_resume(self, args, round_idx, history, evaluations, **kwargs):
        if self.path.exists():
            lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
            kept = [line for line in lines if _round_of(line) <= round_idx]
            temporary = self.path.with_suffix(".jsonl.tmp")
            temporary.write_text("".join(kept), encoding="utf-8")
            temporary.replace(self.path)
        self._write("resumed", {"checkpoint_round": round_idx})

    def on_evaluate_round(self, args, round_idx, results, **kwargs):
        self._write("evaluation", {"round_idx": round_idx, **results})

    def has_line(self, event: str, round_idx: int) -> bool:
        """Whether metrics.jsonl holds a whole `event` line of round `round_idx` (a torn line is none)."""
        return any(entry.get("event") == event and line_round(entry) == round_idx for entry in read_metrics(self.path))

    def on_client_evaluation(self, args, round_idx, results, **kwargs):
        self._write("client_evaluation", {"round_idx": round_idx, **results})
