"""benchmarks/gate.py: the paired test of a gain over the test items, and the gate's two cells and report."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
from scipy import stats

import harness.grid
import harness.significance
import verdict

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("benchmark_gate", ROOT / "benchmarks" / "gate.py")
gate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gate)
FAKE_CELL = ROOT / "tests" / "scripts" / "fake_cell.py"


def _scores(items, correct, improved, worsened):
    """Per-item base and final scores: `correct` items right before, of which `worsened` go wrong; `improved` of the
    others go right."""
    base = [1.0] * correct + [0.0] * (items - correct)
    final = list(base)
    for index in range(worsened):
        final[index] = 0.0
    for index in range(correct, correct + improved):
        final[index] = 1.0
    return base, final


def _binomial_two_sided(successes, trials):
    """McNemar's exact p by hand: twice the smaller tail of Binomial(trials, 1/2), at most 1."""
    tail = sum(math.comb(trials, k) for k in range(min(successes, trials - successes) + 1)) / 2**trials
    return min(1.0, 2 * tail)


def test_a_resolved_gain_passes():
    base, final = _scores(600, 180, improved=40, worsened=10)
    record = harness.significance.paired_gain(base, final)
    assert record["items"] == 600 and record["base"] == pytest.approx(30.0) and record["final"] == pytest.approx(35.0)
    assert record["gain"] == pytest.approx(5.0)
    interval = stats.ttest_rel(final, base).confidence_interval(0.95)
    assert (record["low"], record["high"]) == (pytest.approx(100 * interval.low), pytest.approx(100 * interval.high))
    assert record["p_value"] == pytest.approx(stats.ttest_rel(final, base).pvalue)
    assert (record["improved"], record["worsened"]) == (40, 10)
    assert record["mcnemar_p"] == pytest.approx(_binomial_two_sided(40, 50)) and record["mcnemar_p"] < 1e-4
    assert record["low"] > 0 and record["passed"]


@pytest.mark.parametrize(
    ("improved", "worsened"),
    [(12, 10), (10, 12), (0, 0), (20, 10)],  # not resolved, a loss, no change, and borderline (McNemar p 0.099)
)
def test_an_unresolved_gain_or_a_loss_fails(improved, worsened):
    base, final = _scores(600, 180, improved, worsened)
    record = harness.significance.paired_gain(base, final)
    assert record["gain"] == pytest.approx(100 * (improved - worsened) / 600)
    assert not record["passed"]
    if improved + worsened:
        assert record["mcnemar_p"] == pytest.approx(_binomial_two_sided(improved, improved + worsened))
    else:
        assert record["mcnemar_p"] == 1.0 and record["low"] == record["high"] == 0.0 and record["p_value"] == 1.0


def test_both_tests_must_resolve_the_gain():
    """Where the t-interval clears 0 but McNemar's exact test does not (few changed items), the gate fails."""
    base, final = _scores(40, 10, improved=4, worsened=0)
    record = harness.significance.paired_gain(base, final)
    assert record["low"] > 0 and record["mcnemar_p"] == pytest.approx(0.125) and not record["passed"]


def test_scores_that_are_not_binary_have_no_mcnemar_test():
    record = harness.significance.paired_gain([0.0, 0.5, 0.25, 0.5], [0.5, 1.0, 0.5, 1.0])
    assert record["mcnemar_p"] is None and record["passed"]
    with pytest.raises(ValueError, match="same items"):
        harness.significance.paired_gain([0.0, 1.0], [1.0])


def test_the_gate_runs_centralised_grpo_and_the_grids_fedavg_cell():
    cells = gate.gate_cells(0, 3, "0.05")
    centralised, fedavg = cells["centralised GRPO"], cells["FedAvg"]
    assert list(cells) == ["centralised GRPO", "FedAvg"]  # the cheaper cell first: it evaluates the base model
    assert centralised.overrides() == [
        "--aggregation",
        "fedavg",
        "--server_optimizer",
        "sgd",
        "--seed",
        "0",
        "--num_clients",
        "1",
        "--dirichlet_alpha",
        "inf",
    ]
    assert str(centralised.directory(Path("grid"))) == "grid/N1-muinf/fedavg/seed0"
    grid = harness.grid.grid_cells(verdict.DEFAULT_METHODS, [0, 1, 2], {}, [3], ["0.05"])
    assert fedavg in grid and centralised not in grid  # the grid skips the gate's FedAvg cell once it is done


def _evaluation(scores, hard):
    return {
        "accuracy": {"hard": hard, "Total": sum(scores) / len(scores)},
        "count": {"Total": len(scores)},
        "row_rewards": scores,
    }


def test_the_gate_reports_pass_and_fail_from_its_cells(tmp_path, monkeypatch, capsys):
    """Both cells through `main` with stand-in cells, two at a time: the centralised cell evaluates the base model,
    FedAvg borrows it; centralised GRPO gains a resolved 5 points, FedAvg an unresolved 0.33."""
    base, centralised = _scores(600, 180, improved=40, worsened=10)
    _, fedavg = _scores(600, 180, improved=12, worsened=10)
    cells = gate.gate_cells(0, 3, "0.05")
    key = {name: "/".join(cell.directory(Path("grid")).parts[-3:]) for name, cell in cells.items()}
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "spec.json").write_text(
        json.dumps(
            {
                "base": _evaluation(base, 0.10),
                "together": 2,
                "wait_for": 20,
                "cells": {
                    key["centralised GRPO"]: _evaluation(centralised, 0.15),
                    key["FedAvg"]: _evaluation(fedavg, 0.10),
                },
            }
        )
    )

    def fake_command(cell, config, root, extra):
        if (cell.directory(root) / "result.json").exists():
            return None
        return [
            sys.executable,
            str(FAKE_CELL),
            str(cell.directory(root)),
            str(fake / "spec.json"),
            *extra,
            *cell.overrides(),
        ]

    monkeypatch.setattr(harness.grid, "cell_command", fake_command)
    config = tmp_path / "grid.yaml"
    config.write_text("num_rounds: 8\nlocal_steps: 5\n")
    root = tmp_path / "grid"
    assert gate.main(["--config", str(config), "--output_dir", str(root), "--parallel", "2"]) == 1
    out = capsys.readouterr().out
    assert "PASS centralised GRPO: +5.00 points" in out and "FAIL FedAvg: +0.33 points" in out
    log = {entry["cell"]: entry for entry in map(json.loads, (fake / "log.jsonl").read_text().splitlines())}
    assert "--eval_initial" not in log[key["centralised GRPO"]]["flags"]
    assert log[key["FedAvg"]]["flags"][:2] == ["--eval_initial", "false"]
    assert max(entry["seen"] for entry in log.values()) == 2

    report = json.loads((root / "gate.json").read_text())
    assert report["status"] == "FAIL" and report["runs"]["FedAvg"]["cell"] == "N3-mu0.05/fedavg/seed0"
    assert report["runs"]["centralised GRPO"]["hard_gain"] == pytest.approx(5.0)
    text = (root / "gate.md").read_text()
    assert "(FAIL)" in text and "num_rounds 8, local_steps 5" in text and "| 40 / 10 |" in text

    # a report of what has finished: the base model's evaluation lives in the centralised cell only
    (cells["centralised GRPO"].directory(root) / "result.json").unlink()
    assert gate.main(["--config", str(config), "--output_dir", str(root), "--report_only"]) == 1
    assert "PENDING centralised GRPO" in capsys.readouterr().out
    assert json.loads((root / "gate.json").read_text())["status"] == "PENDING"
