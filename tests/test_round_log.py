"""The round's lines in the log and the server-step advice (trl_federated/reports/round_log.py)."""

import logging

import torch

from trl_federated.config import FedGRPOConfig
from trl_federated.core.round_record import RoundRecord


def test_large_step_warning_names_the_step_in_use_and_not_a_zero_delta(tmp_path, caplog):
    from trl_federated.reports.round_log import RoundLog, format_round_log

    args = FedGRPOConfig(output_dir=str(tmp_path), use_cpu=True, num_clients=2, report_to="none",
                         server_optimizer="adam")
    server = RoundLog()  # what `on_round_saved` gives it
    server.args, server.global_state = args, {"w": torch.ones(100)}
    record = RoundRecord(round_idx=3, sampled=[0, 1], delta_norm=1e-3, server_step_norm=1.0, server_step_ratio=1000.0)
    with caplog.at_level(logging.INFO, logger="trl_federated.reports.round_log"):
        server.check_server_step(record, server.delta_is_rounding(record))
    # the server's own warnings: FedGRPOConfig's once-per-process notice of TRL defaults may be among the records
    (warning,) = [r for r in caplog.records
                  if r.levelno == logging.WARNING and r.name == "trl_federated.reports.round_log"]
    assert "'adam-norm' or 'fedadam'" in warning.getMessage() and "leave it unset" not in warning.getMessage()
    caplog.clear()
    zero = RoundRecord(round_idx=4, sampled=[0, 1], delta_norm=5.9e-7 * 1e-3, server_step_norm=0.4,
                       server_step_ratio=6.8e5)
    with caplog.at_level(logging.INFO, logger="trl_federated.reports.round_log"):
        server.check_server_step(zero, server.delta_is_rounding(zero))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "float rounding" in caplog.text and "momentum" in caplog.text
    # the round's console line says the same: a step's norm, not a ratio of 6.8e5 to a Δ of rounding
    assert "680000" not in format_round_log(zero, 8, 2, server.delta_is_rounding(zero))
    assert "Δ ≈ 0 (float rounding), server step ‖s‖ = 0.4" in format_round_log(zero, 8, 2, True)
    assert "server step 1000.00x ‖Δ‖" in format_round_log(record, 8, 2, server.delta_is_rounding(record))
    args.server_optimizer = "nesterov"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trl_federated.reports.round_log"):
        server.check_server_step(record, server.delta_is_rounding(record))
    assert "`server_beta1` (μ)" in caplog.text


def test_a_client_line_says_idle_only_of_an_idle_client():
    from trl_federated.aggregation.update import RoundMetric
    from trl_federated.reports.round_log import format_round_log

    record = RoundRecord(
        round_idx=0, sampled=["a", "b"], rewards={"a": 0.5, "b": 0.25}, weights={"a": 0.5, "b": 0.5},
        update_norms={"a": 1.0, "b": 0.0}, bytes_sent={"a": 8, "b": 8}, bytes_received={"a": 8, "b": 8},
        round_metrics=[RoundMetric("idle", "idle", {"a": 0, "b": 1}, per_client=True, format="d")],
    )
    _, line_a, line_b = format_round_log(record, 2, 2).splitlines()
    assert "idle" not in line_a
    assert line_b.startswith("  b: R̄ = 0.2500, idle, ω = 0.5000")
