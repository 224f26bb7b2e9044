"""The round's events and metrics.jsonl (trl_federated/core/callbacks.py)."""

import json

from test_reliability import events
from trl_federated.core.callbacks import MetricsLoggerCallback


def test_metrics_log_drops_the_interrupted_rounds_on_resume(tmp_path):
    logger = MetricsLoggerCallback(tmp_path)
    # every line names its round `round_idx`; a client's, a drop's and an evaluation's were `round` before 2026-11-28
    lines = [
        {"event": "evaluation", "round": -1}, {"event": "client", "round_idx": 0}, {"event": "round", "round_idx": 0},
        {"event": "client", "round_idx": 1}, {"event": "client_dropped", "round": 1},
    ]
    logger.path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"event": "cli')  # torn by the kill
    logger.on_resume(None, round_idx=0, history=[], evaluations={})
    assert events(tmp_path) == [*lines[:3], {"event": "resumed", "checkpoint_round": 0}]
    assert logger.has_line("evaluation", -1) and logger.has_line("client", 0) and not logger.has_line("client", 1)
