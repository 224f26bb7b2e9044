"""The round in the log: each finished round's lines (`format_round_log`: R̄, ω, traffic and the aggregator's
metrics of every client, the drops, the evaluation), and the advice when the server step outgrew the clients' mean
change Δ (`SERVER_STEP_ADVICE`). `RoundLog` hangs them on the server core's `on_round_saved` event: after the round's
checkpoint, so that a line in the log means a round that a resumed run keeps."""

from __future__ import annotations

import logging

from ..adapters import state_norm
from ..core.callbacks import RoundCallback
from ..core.round_record import RoundRecord
from .summary import round_label

# The server's round lines, under the logger name they always had.
logger = logging.getLogger(__name__)

# A round whose server step moves the adapter more than this many times the clients' mean change Δ is warned about.
SERVER_STEP_RATIO_WARNING = 5.0


# ‖Δ‖ at most this fraction of ‖θ‖ is float32 rounding of the adapter: the clients did not move it.
ZERO_DELTA_RELATIVE = 1e-6


# Per-client metrics that flag a client (1) or not (0), such as `idle` (its weight held at its data share): said by
# their label, and only of the clients they flag, not as "idle = 0" on every other client's line.
FLAG_METRICS = frozenset({"idle"})


# What the large-ratio warning advises, per `server_optimizer`: what makes that step outgrow Δ.
SERVER_STEP_ADVICE = {
    "adam": "The paper's server Adam moves every coordinate by about the server learning rate whatever Δ's size: "
    "lower `server_learning_rate`, or take a step on Δ's own scale (`server_optimizer` 'adam-norm' or 'fedadam').",
    "fedadam": "FedAdam's momentum outlasts a Δ that shrank: lower `server_beta1` or `server_learning_rate`.",
    "adam-norm": "Its momentum points where Δ no longer does: lower `server_beta1`.",
    "nesterov": "Nesterov momentum grows a persistent direction up to η (1 + μ / (1 − μ)) times Δ: lower "
    "`server_beta1` (μ) or `server_learning_rate` (η).",
    "sgd": "Server SGD moves the adapter by `server_learning_rate` times Δ: lower it (1 is model averaging).",
}


def format_round_log(record: RoundRecord, num_rounds: int, num_clients: int, delta_is_rounding: bool = False) -> str:
    """A finished round in a few log lines: the clients sampled when not all `num_clients`, each aggregated client's
    R̄, ω, traffic and the aggregator's per-client round metrics (RPG: h), its round metrics (RPG: τ), the drops and
    the evaluation, so that a console (`flwr run --stream`, a SuperLink's log) shows what metrics.jsonl records.
    With `delta_is_rounding` (`FederatedServer.delta_is_rounding`) the server step is said as a norm, its ratio to a
    Δ of float rounding meaning nothing."""
    per_client = [metric for metric in record.round_metrics if metric.per_client]
    shown = "".join(
        f", {metric.show(metric.value)}" for metric in record.round_metrics
        if not metric.per_client and metric.value is not None
    )
    if record.server_step_ratio is None:
        step = ""
    elif delta_is_rounding:
        step = f", Δ ≈ 0 (float rounding), server step ‖s‖ = {record.server_step_norm:.3g}"
    else:
        step = f", server step {record.server_step_ratio:.2f}x ‖Δ‖"
    sampled = record.sampled
    sampling = "" if len(sampled) == num_clients else f" ({len(sampled)} of {num_clients} sampled: {sampled})"
    lines = [
        f"Round {round_label(record.round_idx, num_rounds)}: {len(record.weights)} clients aggregated{sampling}, "
        f"{len(record.dropped)} dropped{shown}{step}, {record.wall_time:.1f} s"
    ]
    for client_id, reward in record.rewards.items():
        cosine = record.update_cosines.get(client_id)
        values = [(metric, (metric.value or {}).get(client_id)) for metric in per_client]
        shown_values = [
            metric.label if metric.name in FLAG_METRICS else metric.show(value)
            for metric, value in values if value is not None and (value or metric.name not in FLAG_METRICS)
        ]
        lines.append(
            f"  {client_id}: R̄ = {reward:.4f}"
            + "".join(f", {value}" for value in shown_values)
            + f", ω = {record.weights[client_id]:.4f}, ‖u‖ = {record.update_norms[client_id]:.3g}"
            + ("" if cosine is None else f", cos(u, Δ) = {cosine:+.3f}")
            + f", sent {record.bytes_sent[client_id]:,} B, "
            f"received {record.bytes_received[client_id]:,} B"
        )
    for client_id, reason in record.dropped.items():
        lines.append(f"  {client_id}: dropped ({reason})")
    if record.evaluation is not None:
        accuracy = ", ".join(f"{label} {100 * value:.2f}%" for label, value in record.evaluation["accuracy"].items())
        lines.append(f"  evaluation: {accuracy}")
    return "\n".join(lines)



class RoundLog(RoundCallback):
    """Logs each finished round (`format_round_log`) and warns, with advice for the server optimizer in use, when its
    server step moved the adapter far more than the clients' mean change Δ (`check_server_step`). The drivers attach
    it (`reports.server_reports`); only the main process fires it."""

    def __init__(self):
        self.args = self.global_state = None

    def on_round_saved(self, args, record, global_state, num_clients, **kwargs):
        self.args, self.global_state = args, global_state
        delta_is_rounding = self.delta_is_rounding(record)
        logger.info("%s", format_round_log(record, args.num_rounds, num_clients, delta_is_rounding))
        self.check_server_step(record, delta_is_rounding)

    def delta_is_rounding(self, record: RoundRecord) -> bool:
        """Whether the round's Δ is at float rounding of the adapter: every client sent back what it received, so
        ‖server step‖ / ‖Δ‖ measures rounding, not the server optimizer. Only a large ratio can be such a round (a
        step of Δ's size or less is said as it is), so only then is ‖θ‖ computed: not a pass over the adapter every
        round."""
        ratio = record.server_step_ratio
        if ratio is None or ratio <= SERVER_STEP_RATIO_WARNING:
            return False
        return record.delta_norm <= ZERO_DELTA_RELATIVE * state_norm(self.global_state)

    def check_server_step(self, record: RoundRecord, delta_is_rounding: bool) -> None:
        """Warn, with advice for the server optimizer in use, when the round's server step moved the adapter far
        more than the clients' mean change Δ (`server_step_ratio` above `SERVER_STEP_RATIO_WARNING`). A round whose Δ
        is at float rounding of the adapter (`delta_is_rounding`) is said as such, not as a configuration at fault:
        whatever moved then was the server's momentum."""
        ratio, args = record.server_step_ratio, self.args
        if ratio is None or ratio <= SERVER_STEP_RATIO_WARNING:
            return
        if delta_is_rounding:
            logger.info(
                "Round %d: the clients' mean change Δ is at float rounding of the adapter (‖Δ‖ = %.3g): they sent "
                "back what they received; the server step (%.3g) is the momentum of `server_optimizer` %r.",
                record.round_idx, record.delta_norm, record.server_step_norm, args.server_optimizer,
            )
            return
        setting = (f"`server_optimizer` {args.server_optimizer!r} with `server_learning_rate` "
                   f"{args.server_learning_rate:g} ({args.server_field_origin('server_learning_rate')})")
        logger.warning(
            "Round %d: the server step moved the global adapter %.1fx as far as the clients' mean change Δ "
            "(‖θ^{t+1} − θ^{t}‖ = %.3g, ‖Δ‖ = %.3g); %s. %s metrics.jsonl records every round's ratio "
            "(`server_step_ratio`).",
            record.round_idx, ratio, record.server_step_norm, record.delta_norm, setting,
            SERVER_STEP_ADVICE.get(args.server_optimizer, SERVER_STEP_ADVICE["sgd"]),
        )
