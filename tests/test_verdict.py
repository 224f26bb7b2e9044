"""benchmarks/verdict.py: its statistics, its report from finished cells, and a killed grid that resumes."""

import csv
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from trl_federated.compare import Cell

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("benchmark_verdict", ROOT / "benchmarks" / "verdict.py")
verdict = importlib.util.module_from_spec(spec)
spec.loader.exec_module(verdict)


@pytest.mark.parametrize(("df", "expected"), [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042)])
def test_t_quantile_matches_the_published_table(df, expected):
    assert verdict.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)


def test_t_interval_and_its_reading():
    interval = verdict.t_interval([1.0, 2.0, 3.0])
    half = 4.303 * 1.0 / math.sqrt(3)  # stdev of 1, 2, 3 is 1
    assert interval["mean"] == 2.0 and interval["n"] == 3
    assert (interval["low"] == pytest.approx(2.0 - half, abs=1e-3)
            and interval["high"] == pytest.approx(2.0 + half, abs=1e-3))
    assert verdict.reading(interval).startswith("not resolved")  # 2 ± 2.48 holds 0
    assert verdict.reading(verdict.t_interval([3.0, 4.0, 5.0])) == "FGRPO better"
    assert verdict.reading(verdict.t_interval([-3.0, -4.0, -5.0])) == "baseline better"
    assert verdict.reading(verdict.t_interval([-1.0, 1.0, 0.5])).startswith("not resolved")
    assert verdict.reading(verdict.t_interval([1.47, 1.47])).startswith("not resolved (every seed gave the same")
    single = verdict.t_interval([4.0])
    assert single["mean"] == 4.0 and math.isnan(single["low"]) and verdict.reading(single) == "one seed: no interval"
    with pytest.raises(ValueError, match="df"):
        verdict.t_quantile(0.975, 0)


def _result(base, final, rewards):
    """A result.json as `trl-federated run` writes it: evaluations before training (-1) and after the last round."""
    def evaluation(total, hard):
        return {"accuracy": {"simple": 0.5, "medium": 0.25, "hard": hard, "Total": total}}

    return {
        "wall_time": 60.0,
        "evaluations": {"-1": evaluation(*base), str(len(rewards) - 1): evaluation(*final)},
        "rounds": [{"round_idx": t, "rewards": {"client_0": r, "client_1": r / 2}} for t, r in enumerate(rewards)],
    }


def _write(root, cell, result, cpu_seconds=600.0):
    directory = cell.directory(root)
    directory.mkdir(parents=True)
    (directory / "result.json").write_text(json.dumps(result))
    (directory / verdict.COST_FILE).write_text(json.dumps([{"cpu_seconds": cpu_seconds, "wall_seconds": 100.0}]))


def test_report_from_finished_cells_is_partial_and_paired_by_seed(tmp_path, capsys):
    base = (0.20, 0.10)
    # FGRPO gains 10, 12, 14 total points; FedAvg 4, 8, 6: paired FGRPO − FedAvg = 6, 4, 8.
    finals = {"fgrpo": [(0.30, 0.20), (0.32, 0.20), (0.34, 0.25)], "fedavg": [(0.24, 0.10), (0.28, 0.15), (0.26, 0.10)]}
    for method, values in finals.items():
        for seed, final in enumerate(values):
            _write(tmp_path, Cell(method, seed, 3, "0.05"), _result(base, final, [0.1, 0.2, 0.4]))
    # scaffold has seed 0 only; seeds 1 and 2 are missing, so the grid is partial
    _write(tmp_path, Cell("scaffold", 0, 3, "0.05"), _result(base, (0.21, 0.10), [0.1, 0.1, 0.1]))

    args = ["--output_dir", str(tmp_path), "--methods", "fgrpo", "fedavg", "scaffold", "--report_only"]
    assert verdict.main(args) == 0
    assert "PARTIAL: 7 of 9 cells finished" in capsys.readouterr().out

    summary = json.loads((tmp_path / "verdict.json").read_text())
    assert summary["status"] == "PARTIAL: 7 of 9 cells finished"
    rows = {row["method"]: row for row in summary["methods"]}
    assert rows["fgrpo"]["total_gain"]["mean"] == pytest.approx(12.0)
    assert rows["fgrpo"]["hard_gain"]["mean"] == pytest.approx(100 * (0.65 / 3 - 0.10))
    assert rows["fedavg"]["total_gain"]["mean"] == pytest.approx(6.0) and rows["scaffold"]["seeds"] == [0]
    assert rows["fgrpo"]["reward_curve"] == pytest.approx([0.075, 0.15, 0.3])
    assert rows["fgrpo"]["cpu_seconds_per_cell"] == 600.0
    paired = {row["baseline"]: row for row in summary["paired"]}
    assert paired["fedavg"]["total"]["mean"] == pytest.approx(6.0)
    assert paired["fedavg"]["total"]["low"] == pytest.approx(6.0 - 4.303 * 2 / math.sqrt(3), abs=1e-3)
    assert paired["fedavg"]["total_reading"] == "FGRPO better"
    assert paired["scaffold"]["seeds"] == [0] and paired["scaffold"]["total_reading"] == "one seed: no interval"
    assert summary["cpu_seconds"] == 7 * 600.0

    table = list(csv.reader((tmp_path / "verdict.csv").open()))
    assert (table[0][:3] == ["Setting", "Method", "Seeds"]
            and [row[1] for row in table[1:]] == ["fgrpo", "fedavg", "scaffold"])
    assert table[1][5] == "+12.00 [+7.03, +16.97]"
    assert (tmp_path / "paired.csv").exists() and (tmp_path / "verdict.md").read_text().count("PARTIAL") == 1
    assert (tmp_path / "curves-N3-mu0.05.png").stat().st_size > 0


def test_a_finished_cell_is_skipped_and_keeps_its_cost(tmp_path, capsys):
    cell = Cell("fgrpo", 0, 3, "0.05")
    _write(tmp_path, cell, _result((0.2, 0.1), (0.3, 0.2), [0.1, 0.2, 0.3]), cpu_seconds=123.0)
    verdict.run_timed_cell(cell, "no-such-config.yaml", tmp_path, [])  # would fail if it ran anything
    assert "done, skipped" in capsys.readouterr().out
    assert verdict.cell_cost(cell.directory(tmp_path)) == {"cpu_seconds": 123.0, "wall_seconds": 100.0}


def test_cells_share_the_base_evaluation_of_the_first(tmp_path):
    with_base = _result((0.2, 0.1), (0.3, 0.2), [0.1, 0.2, 0.3])
    without = _result((0.9, 0.9), (0.25, 0.1), [0.1, 0.2, 0.3])
    del without["evaluations"]["-1"]  # a cell run with `--eval_initial false`
    fgrpo, fedavg = Cell("fgrpo", 0, 3, "0.05"), Cell("fedavg", 0, 3, "0.05")
    assert verdict.with_shared_base({fedavg: without}) == {}  # no gain without a base evaluation
    shared = verdict.with_shared_base({fgrpo: with_base, fedavg: without})
    assert verdict.cell_metrics(shared[fedavg])["total_gain"] == pytest.approx(5.0)  # 25 − 20, not 25 − 90


def test_the_reference_method_is_required(tmp_path):
    with pytest.raises(SystemExit):
        verdict.main(["--output_dir", str(tmp_path), "--methods", "fedavg", "--report_only"])


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 4 cells of a few seconds each, but a subprocess each: minutes on a loaded machine
def test_a_killed_grid_resumes_to_the_same_report(tmp_path, tiny_model_dir):
    """The whole path on the tiny model: 2 methods x 2 seeds, killed once mid-cell, then rerun to completion."""
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": str(tiny_model_dir), "benchmark_size": 48, "max_eval_samples": 8,
        "num_clients": 2, "dirichlet_alpha": 1.0, "num_rounds": 2, "local_steps": 1, "reward_window": 1,
        "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8,
        "per_device_eval_batch_size": 8, "use_cpu": True, "bf16": False, "gradient_checkpointing": False,
        "report_to": "none", "reward_funcs": ["accuracy", "format"],
    }))
    grid = tmp_path / "grid"
    command = [sys.executable, str(ROOT / "benchmarks" / "verdict.py"), "--config", str(config), "--output_dir",
               str(grid), "--methods", "fgrpo", "fedavg", "--seeds", "0", "1", "--num_clients", "2",
               "--dirichlet_alpha", "1.0"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    first = grid / "N2-mu1.0" / "fgrpo" / "seed0"
    process = subprocess.Popen(command, env=environment, start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (first / "checkpoint-0").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)  # the harness and its cell, mid-grid
    process.wait()
    assert (first / "checkpoint-0").exists() and not (first / "result.json").exists()

    resumed = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
    assert "fgrpo N=2,mu=1.0 seed 0: resuming" in resumed.stdout and "complete" in resumed.stdout
    result = json.loads((first / "result.json").read_text())
    assert [record["round_idx"] for record in result["rounds"]] == [0, 1]
    assert set(result["evaluations"]) == {"-1", "1"}  # the base evaluation survived the kill
    later = json.loads((grid / "N2-mu1.0" / "fedavg" / "seed1" / "result.json").read_text())
    assert set(later["evaluations"]) == {"1"}  # evaluated once, in the first cell
    summary = json.loads((grid / "verdict.json").read_text())
    assert summary["status"] == "complete" and len(summary["paired"]) == 1

    again = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
    assert again.stdout.count("done, skipped") == 4
