"""benchmarks/verdict.py: its statistics, its report from finished cells, and a killed grid that resumes."""

import csv
import importlib.util
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from scipy import stats

import harness.cells
import harness.grid
from harness.significance import holm, minimum_detectable, paired_p, seeds_for, t_interval, t_quantile
from trl_federated.reports.compare import Cell

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("benchmark_verdict", ROOT / "benchmarks" / "verdict.py")
verdict = importlib.util.module_from_spec(spec)
spec.loader.exec_module(verdict)


@pytest.mark.parametrize(("df", "expected"), [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042)])
def test_t_quantile_matches_the_published_table(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize("values", [[1.0, 2.0, 3.0], [-3.5, 0.25, 1.0, 7.75, 2.0, 2.0], [0.49, 0.0]])
def test_t_interval_is_scipys(values):
    """The interval is scipy's t-interval (the hand-written t distribution is gone), as scipy's one-sample t-test
    gives it."""
    assert not hasattr(verdict, "t_cdf")
    interval = t_interval(values, confidence=0.95)
    mean, sem = statistics.fmean(values), stats.sem(values)
    low, high = stats.t.interval(0.95, len(values) - 1, loc=mean, scale=sem)
    assert (interval["low"], interval["high"]) == (pytest.approx(low, rel=1e-12), pytest.approx(high, rel=1e-12))
    test = stats.ttest_1samp(values, 0.0).confidence_interval(0.95)
    assert (interval["low"], interval["high"]) == (pytest.approx(test.low), pytest.approx(test.high))
    assert interval["half_width"] == pytest.approx((high - low) / 2) and interval["sd"] == pytest.approx(
        statistics.stdev(values))


def test_the_minimum_detectable_difference_has_the_asked_power():
    sd, n = 4.0, 6
    delta = minimum_detectable(sd, n)
    critical = stats.t.ppf(0.975, n - 1)
    shift = delta * math.sqrt(n) / sd
    power = stats.nct.sf(critical, n - 1, shift) + stats.nct.cdf(-critical, n - 1, shift)
    assert power == pytest.approx(0.8, abs=1e-6)
    # beyond the interval's half-width (a difference that size is resolved only half the time), and close to the
    # textbook approximation (t_0.975 + t_0.8) * sd / sqrt(n)
    assert delta > critical * sd / math.sqrt(n)
    approximation = (critical + stats.t.ppf(0.8, n - 1)) * sd / math.sqrt(n)
    assert delta == pytest.approx(approximation, rel=0.1)
    assert minimum_detectable(2 * sd, n) == pytest.approx(2 * delta)  # in proportion to the spread
    assert math.isnan(minimum_detectable(0.0, n)) and math.isnan(minimum_detectable(sd, 1))


def test_t_interval_and_its_reading():
    interval = t_interval([1.0, 2.0, 3.0])
    half = 4.303 * 1.0 / math.sqrt(3)  # stdev of 1, 2, 3 is 1
    assert interval["mean"] == 2.0 and interval["n"] == 3
    assert (interval["low"] == pytest.approx(2.0 - half, abs=1e-3)
            and interval["high"] == pytest.approx(2.0 + half, abs=1e-3))
    assert verdict.reading(interval).startswith("not resolved")  # 2 ± 2.48 holds 0
    assert verdict.reading(t_interval([3.0, 4.0, 5.0])) == "FGRPO better"
    assert verdict.reading(t_interval([-3.0, -4.0, -5.0])) == "baseline better"
    assert verdict.reading(t_interval([-1.0, 1.0, 0.5])).startswith("not resolved")
    assert verdict.reading(t_interval([1.47, 1.47])).startswith("not resolved (every seed gave the same")
    single = t_interval([4.0])
    assert single["mean"] == 4.0 and math.isnan(single["low"]) and verdict.reading(single) == "one seed: no interval"
    with pytest.raises(ValueError, match="df"):
        t_quantile(0.975, 0)


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
    (directory / harness.cells.COST_FILE).write_text(json.dumps([{"cpu_seconds": cpu_seconds, "wall_seconds": 100.0}]))


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


def test_each_seeds_final_adapters_are_compared_item_by_item(tmp_path, capsys):
    """FGRPO's final adapter against the baseline's of the same seed over the same test items: the per-item mean
    difference with its t-interval, and McNemar's exact test on the items only one of them gets right."""
    items = 200
    fgrpo_rows = [1.0] * 60 + [0.0] * 140  # 30%
    fedavg_rows = [1.0] * 50 + [0.0] * 10 + [1.0] * 30 + [0.0] * 110  # 40%: 10 items only FGRPO, 30 only FedAvg right
    base = (0.20, 0.10)
    for method, rows in (("fgrpo", fgrpo_rows), ("fedavg", fedavg_rows)):
        result = _result(base, (statistics.fmean(rows), 0.10), [0.1, 0.2])
        result["evaluations"]["1"]["row_rewards"] = rows
        _write(tmp_path, Cell(method, 0, 3, "0.05"), result)
    _write(tmp_path, Cell("scaffold", 0, 3, "0.05"), _result(base, (0.21, 0.10), [0.1, 0.1]))  # no per-item scores
    assert verdict.main(["--output_dir", str(tmp_path), "--methods", "fgrpo", "fedavg", "scaffold", "--seeds", "0",
                         "--report_only"]) == 0
    capsys.readouterr()
    paired = {row["baseline"]: row for row in json.loads((tmp_path / "verdict.json").read_text())["paired"]}
    assert paired["scaffold"]["items"] == {"0": None}
    item = paired["fedavg"]["items"]["0"]
    differences = [100 * (a - b) for a, b in zip(fgrpo_rows, fedavg_rows)]
    low, high = stats.t.interval(0.95, items - 1, loc=statistics.fmean(differences), scale=stats.sem(differences))
    assert (item["final"], item["base"]) == (pytest.approx(30.0), pytest.approx(40.0))
    assert item["gain"] == pytest.approx(-10.0)
    assert (item["low"], item["high"]) == (pytest.approx(low), pytest.approx(high))
    assert (item["improved"], item["worsened"]) == (10, 30)
    assert item["mcnemar_p"] == pytest.approx(stats.binomtest(10, 40, 0.5).pvalue)
    report = (tmp_path / "verdict.md").read_text()
    assert "## Item by item, seed by seed" in report
    assert f"| N=3,mu=0.05 | fedavg | 0 | 30.00 | 40.00 | -10.00 [{low:+.2f}, {high:+.2f}] | 10 / 30 |" in report
    assert "| scaffold | 0 |" not in report.split("## Item by item")[1]
    # FGRPO's "w/o RPG" ablation, with its averaging step, is the fedavg row: the report says so (issue 34 point 2)
    ablation = "FGRPO w/o RPG (its server step with FedAvg's data-volume weights in place of RPG's) is the method"
    ablation += " `fedavg`"
    assert ablation in " ".join(report.split())


def test_the_report_averages_each_cells_round_diagnostics(tmp_path, capsys):
    """Server step / ‖Δ‖ (median and largest over rounds), ‖Δ‖, cos(update, Δ), groups with equal rewards and the
    weight spread, per cell from metrics.jsonl (the last line of a round counts), then averaged over seeds."""
    def round_line(index, ratio, delta, cosines, zero_std, weights, step=(None,) * 4, entropy=(None, None)):
        return json.dumps({
            "event": "round", "round_idx": index, "server_step_ratio": ratio, "delta_norm": delta,
            "update_cosines": dict(zip("ab", cosines)), "weights": dict(zip("ab", weights)),
            "client_metrics": {name: {"frac_reward_zero_std": value, "entropy": h}
                               for name, value, h in zip("ab", zero_std, entropy)},
            **dict(zip(("server_step_cosine", "server_step_momentum_cosine", "server_step_norm_a",
                        "server_step_norm_b"), step)),
        })

    base = (0.20, 0.10)
    lines = {
        0: [round_line(0, 9.0, 9.0, (0.0, 0.0), (0.0, 0.0), (0.5, 0.5)),  # replaced by the resumed run's round 0
            json.dumps({"event": "resumed"}),
            round_line(0, 2.0, 0.5, (0.5, 1.0), (0.5, 1.0), (0.2, 0.8)),
            round_line(1, 6.0, 0.3, (-0.5, 0.0), (0.0, 0.5), (0.5, 0.5), (0.5, None, 0.1, 0.2), (1.0, 0.5)),
            round_line(2, 3.0, 0.4, (0.0, 0.0), (0.0, 0.0), (0.4, 0.6), (1.0, 0.5, 0.3, 0.4), (0.25, 0.25)),
            round_line(3, None, None, (None, None), (None, None), ())],  # a round without Δ: nothing to count
        1: [round_line(0, 1.0, 0.2, (1.0, 1.0), (1.0, 1.0), (0.5, 0.5))],
    }
    for seed, seed_lines in lines.items():
        for method in ("fgrpo", "fedavg"):
            cell = Cell(method, seed, 3, "0.05")
            _write(tmp_path, cell, _result(base, (0.3, 0.1), [0.1, 0.2]))
            if method == "fgrpo":
                (cell.directory(tmp_path) / "metrics.jsonl").write_text("\n".join(seed_lines) + "\n")
    assert verdict.main(["--output_dir", str(tmp_path), "--methods", "fgrpo", "fedavg", "--seeds", "0", "1",
                         "--report_only"]) == 0
    capsys.readouterr()
    seed0 = harness.cells.cell_diagnostics(harness.cells.round_records(Cell("fgrpo", 0, 3, "0.05").directory(tmp_path)))
    step_keys = ("entropy", "last_entropy", "step_cosine", "momentum_cosine", "step_norm_a", "step_norm_b")
    steps = {key: seed0.pop(key) for key in step_keys}
    assert seed0 == pytest.approx({"step_ratio_median": 3.0, "step_ratio_max": 6.0, "delta_norm": 0.4,
                                   "update_cosine": 1 / 6, "zero_std_groups": 2 / 6, "weight_spread": 0.8 / 3})
    # the step's diagnostics and the clients' entropy over the rounds that have them; the last round has none
    assert steps == pytest.approx({"entropy": 0.5, "last_entropy": math.nan, "step_cosine": 0.75,
                                   "momentum_cosine": 0.5, "step_norm_a": 0.2, "step_norm_b": 0.3}, nan_ok=True)
    rows = {row["method"]: row for row in json.loads((tmp_path / "verdict.json").read_text())["methods"]}
    averaged = {key: value for key, value in rows["fgrpo"]["diagnostics"].items() if key not in step_keys}
    assert averaged == pytest.approx({key: (value + {"step_ratio_median": 1.0,
        "step_ratio_max": 1.0, "delta_norm": 0.2, "update_cosine": 1.0, "zero_std_groups": 1.0,
        "weight_spread": 0.0}[key]) / 2 for key, value in seed0.items()})
    assert all(math.isnan(value) for value in rows["fedavg"]["diagnostics"].values())  # no metrics.jsonl
    report = (tmp_path / "verdict.md").read_text()
    assert "| N=3,mu=0.05 | fgrpo | 2 | 2.00 | 3.50 | 0.30 | 0.58 | 0.67 | 0.13 |" in report
    assert "| N=3,mu=0.05 | fedavg | 2 | — | — | — | — | — | — |" in report


def test_a_finished_cell_is_skipped_and_keeps_its_cost(tmp_path, capsys):
    cell = Cell("fgrpo", 0, 3, "0.05")
    _write(tmp_path, cell, _result((0.2, 0.1), (0.3, 0.2), [0.1, 0.2, 0.3]), cpu_seconds=123.0)
    harness.grid.run_timed_cell(cell, "no-such-config.yaml", tmp_path, [])  # would fail if it ran anything
    assert "done, skipped" in capsys.readouterr().out
    assert harness.cells.cell_cost(cell.directory(tmp_path)) == {
        "cpu_seconds": 123.0, "wall_seconds": 100.0, "complete": True, "rounds_wall_seconds": 0.0}


def test_a_cells_cost_is_a_lower_bound_when_an_attempt_it_resumed_from_recorded_none(tmp_path):
    """A resume is one attempt more; an attempt killed with its machine writes no cost, which the cost then says."""
    cell = Cell("fgrpo", 0, 3, "0.05")
    _write(tmp_path, cell, _result((0.2, 0.1), (0.3, 0.2), [0.1, 0.2]), cpu_seconds=50.0)
    rounds = [{"event": "round", "round_idx": 0, "wall_time": 30.0}, {"event": "resumed", "checkpoint_round": 0},
              {"event": "round", "round_idx": 1, "wall_time": 20.0}]
    (cell.directory(tmp_path) / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rounds))
    cost = harness.cells.cell_cost(cell.directory(tmp_path))
    assert cost["cpu_seconds"] == 50.0 and cost["rounds_wall_seconds"] == 50.0 and not cost["complete"]
    finished = {"cpu_seconds": 130.0, "wall_seconds": 130.0, "complete": True}
    assert harness.cells.cpu_text([cost, finished], 60.0, ".1f") == "≥1.5"  # reports mark the mean a lower bound
    harness.grid.record_cost(cell.directory(tmp_path), 30.0, 30.0, stopped=True)  # the first attempt, stopped
    cost = harness.cells.cell_cost(cell.directory(tmp_path))
    assert cost["cpu_seconds"] == 80.0 and cost["complete"]
    assert harness.cells.cpu_text([cost, finished], 60.0, ".1f") == "1.8"


def test_cells_share_the_base_evaluation_of_the_first(tmp_path):
    with_base = _result((0.2, 0.1), (0.3, 0.2), [0.1, 0.2, 0.3])
    without = _result((0.9, 0.9), (0.25, 0.1), [0.1, 0.2, 0.3])
    del without["evaluations"]["-1"]  # a cell run with `--eval_initial false`
    fgrpo, fedavg = Cell("fgrpo", 0, 3, "0.05"), Cell("fedavg", 0, 3, "0.05")
    assert harness.cells.with_shared_base({fedavg: without}) == {}  # no gain without a base evaluation
    shared = harness.cells.with_shared_base({fgrpo: with_base, fedavg: without})
    assert harness.cells.cell_metrics(shared[fedavg])["total_gain"] == pytest.approx(5.0)  # 25 − 20, not 25 − 90


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
    assert summary["status"] == "complete: 4 of 4 cells finished" and len(summary["paired"]) == 1

    again = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
    assert again.stdout.count("done, skipped") == 4


# Seeds, cells run side by side, budgets and commits ---------------------------------------------------------------

FAKE_CELL = ROOT / "tests" / "scripts" / "fake_cell.py"


def test_extra_seeds_go_to_the_named_methods_after_the_common_seeds():
    methods = ["fgrpo", "fgrpo-paper", "fedavg", "fedprox", "scaffold"]
    extra = harness.grid.parse_extra_seeds(["fgrpo,fedavg:3,4,5"], methods)
    assert extra == {"fgrpo": [3, 4, 5], "fedavg": [3, 4, 5]}
    cells = harness.grid.grid_cells(methods, [0, 1, 2], extra, [3], ["0.05"])
    assert len(cells) == 3 * 5 + 2 * 3  # 21: 3 seeds for all, 6 for FGRPO and FedAvg
    assert [(c.method, c.seed) for c in cells[:5]] == [(method, 0) for method in methods]  # methods innermost
    assert [(c.method, c.seed) for c in cells[15:]] == [(m, s) for s in (3, 4, 5) for m in ("fgrpo", "fedavg")]
    assert {c.setting for c in cells} == {"N=3,mu=0.05"}
    # a seed named twice runs once; separate specs add up
    assert harness.grid.parse_extra_seeds(["fgrpo:0,3", "fgrpo:3,4"], methods) == {"fgrpo": [0, 3, 4]}
    assert len(harness.grid.grid_cells(["fgrpo"], [0, 1], {"fgrpo": [0, 3]}, [3], ["0.05"])) == 3
    for bad in ("fgrpo", "fgrpo:", "fgrpo:x", ":3", "fedsgd:3"):
        with pytest.raises(ValueError, match="extra_seeds"):
            harness.grid.parse_extra_seeds([bad], methods)


def _fake_spec(folder, **spec):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def _log(folder):
    return [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]


def test_two_cells_run_at_a_time_each_on_its_share_of_the_cores(tmp_path):
    spec = _fake_spec(tmp_path / "fake", base={}, default_final={}, together=2, wait_for=20, cpu_seconds=0.3)
    cells = [Cell("fgrpo", seed, 3, "0.05") for seed in range(4)]
    grid = tmp_path / "grid"
    done = Cell("fedavg", 0, 3, "0.05")
    done.directory(grid).mkdir(parents=True)
    (done.directory(grid) / "result.json").write_text("{}")
    finished = []

    def command(cell):
        if (cell.directory(grid) / "result.json").exists():
            return None
        return [sys.executable, str(FAKE_CELL), str(cell.directory(grid)), str(spec)]

    failures = harness.grid.run_cells([done, *cells], grid, command, parallel=2,
                                 on_finish=lambda cell, ran: finished.append((cell, ran)))
    assert failures == []
    assert finished[0] == (done, False) and sorted(finished[1:], key=lambda item: item[0].seed) == [
        (cell, True) for cell in cells]
    log = _log(tmp_path / "fake")
    assert len(log) == 4 and max(entry["seen"] for entry in log) == 2  # two at once, never three
    cores = len(os.sched_getaffinity(0))
    assert {entry["threads"] for entry in log} == {str(max(1, cores // 2))}
    for cell in cells:  # each attempt's own CPU time (not the other cell's), and its wall time
        (attempt,) = json.loads((cell.directory(grid) / harness.cells.COST_FILE).read_text())
        assert 0.25 <= attempt["cpu_seconds"] < 5 and attempt["wall_seconds"] >= attempt["cpu_seconds"] * 0.5
    assert not (done.directory(grid) / harness.cells.COST_FILE).exists()


def test_a_failing_cell_stops_the_launch_of_others(tmp_path):
    cells = [Cell("fgrpo", seed, 3, "0.05") for seed in range(4)]
    failing = "/".join(cells[1].directory(tmp_path / "grid").parts[-3:])
    spec = _fake_spec(tmp_path / "fake", base={}, default_final={}, fail=[failing], cpu_seconds=0.5)
    grid = tmp_path / "grid"
    finished = []
    failures = harness.grid.run_cells(
        cells, grid, lambda cell: [sys.executable, str(FAKE_CELL), str(cell.directory(grid)), str(spec)], parallel=2,
        on_finish=lambda cell, ran: finished.append(cell))
    assert failures == [(cells[1], 3)] and finished == [cells[0]]  # the cell beside it finished; no other started
    assert len(_log(tmp_path / "fake")) == 2 and not (cells[1].directory(grid) / harness.cells.COST_FILE).exists()
    assert not cells[2].directory(grid).exists()


def test_a_stopped_harness_stops_its_cells(tmp_path):
    """SIGTERM to the harness alone (as `kill PID` of a grid in the background): its running cells get SIGTERM and
    are reaped, no further cell starts, and it exits 143."""
    spec = _fake_spec(tmp_path / "fake", base={}, default_final={}, together=3, wait_for=120)  # never 3: they wait
    grid = tmp_path / "grid"
    driver = (
        "import sys\n"
        "from pathlib import Path\n"
        "from harness.grid import run_cells\n"
        "from trl_federated.reports.compare import Cell\n"
        f"root = Path({str(grid)!r})\n"
        "cells = [Cell('fgrpo', seed, 3, '0.05') for seed in range(3)]\n"
        f"command = lambda cell: [sys.executable, {str(FAKE_CELL)!r}, str(cell.directory(root)), {str(spec)!r}]\n"
        "run_cells(cells, root, command, parallel=2)\n"
    )
    environment = {**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")}  # the harness, which puts the package first
    process = subprocess.Popen([sys.executable, "-c", driver], env=environment)
    deadline = time.monotonic() + 120
    while len(list((tmp_path / "fake").glob("running-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    cell_pids = [int(path.name.removeprefix("running-")) for path in (tmp_path / "fake").glob("running-*")]
    assert len(cell_pids) == 2
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM
    for pid in cell_pids:  # stopped and reaped by the harness
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not list(grid.rglob("result.json")) and not (grid / "N3-mu0.05" / "fgrpo" / "seed2").exists()
    for seed in (0, 1):  # each stopped attempt's cost recorded, so its resume can add up the cell's
        (attempt,) = json.loads((Cell("fgrpo", seed, 3, "0.05").directory(grid) / harness.cells.COST_FILE).read_text())
        assert attempt["stopped"] and attempt["cpu_seconds"] >= 0 and attempt["wall_seconds"] > 0


def test_one_cell_at_a_time_inherits_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert harness.grid.cell_environment(1) is None
    assert harness.grid.cell_environment(2)["MKL_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))


def test_a_folder_runs_one_budget(tmp_path):
    config = tmp_path / "grid.yaml"
    config.write_text("num_rounds: 8\nlocal_steps: 5\n")
    root = tmp_path / "grid"
    harness.grid.check_budget(root, str(config), ["--max_eval_samples", "10"])
    assert json.loads((root / harness.cells.BUDGET_FILE).read_text())["config"] == {"num_rounds": 8, "local_steps": 5}
    harness.grid.check_budget(root, str(config), ["--max_eval_samples", "10"])  # the same budget: fine
    with pytest.raises(ValueError, match="flags"):
        harness.grid.check_budget(root, str(config), [])
    config.write_text("num_rounds: 4\nlocal_steps: 5\n# a comment changes nothing\n")
    with pytest.raises(ValueError, match="num_rounds: 8 -> 4"):
        harness.grid.check_budget(root, str(config), ["--max_eval_samples", "10"])


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def repository(tmp_path):
    """A git repository with one commit, its grid cells ignored as this project's .gitignore ignores them."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "--quiet")
    _git(repo, "config", "user.email", "grid@example.com")
    _git(repo, "config", "user.name", "grid")
    (repo / ".gitignore").write_text("grid/N*/\n")
    _git(repo, "add", ".gitignore")
    _git(repo, "commit", "--quiet", "-m", "start")
    return repo


def test_commit_takes_a_cells_small_files_only(repository, capsys):
    spec = _fake_spec(repository.parent / "fake", base={}, default_final={})
    cell = Cell("fgrpo", 0, 3, "0.05")
    directory = cell.directory(repository / "grid")
    subprocess.run([sys.executable, str(FAKE_CELL), str(directory), str(spec)], check=True)
    harness.grid.record_cost(directory, 1.0, 2.0)
    (directory / "huge.png").write_bytes(b"0")
    files = harness.grid.committed_files(directory)
    assert {path.name for path in files} == {"result.json", "metrics.jsonl", "cost.json", "summary.md", "rewards.png",
                                             "weights.png", "accuracy.png"}
    (repository / "notes.txt").write_text("staged by someone else\n")
    _git(repository, "add", "notes.txt")

    assert harness.grid.commit(files, "grid: fgrpo seed 0 finished")
    committed = _git(repository, "show", "--name-only", "--format=", "HEAD").split()
    assert sorted(committed) == sorted(str(path.relative_to(repository)) for path in files)
    assert "notes.txt" in _git(repository, "diff", "--cached", "--name-only")  # still staged, not committed
    tracked = _git(repository, "ls-files")
    assert "adapter_model.safetensors" not in tracked and "checkpoint-1" not in tracked and "round-1" not in tracked

    assert not harness.grid.commit(files, "again")  # nothing new
    (directory / "result.json").write_text("{}")
    assert harness.grid.commit(files, "changed")
    assert _git(repository, "log", "-1", "--format=%s").strip() == "changed"
    outside = repository.parent / "outside.json"
    outside.write_text("{}")
    assert not harness.grid.commit([outside], "no repository") and "not committed" in capsys.readouterr().out


def test_a_cell_file_too_large_is_not_committed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(harness.grid, "MAX_COMMITTED_BYTES", 10)
    (tmp_path / "result.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("x" * 11)
    assert harness.grid.committed_files(tmp_path) == [tmp_path / "result.json"]
    assert "metrics.jsonl is" in capsys.readouterr().out


def _evaluation(total, hard, items=10):
    return {"accuracy": {"simple": 0.5, "medium": 0.25, "hard": hard, "Total": total}, "count": {"Total": items}}


def test_the_grid_runs_two_at_a_time_commits_each_cell_and_resumes(repository, monkeypatch, capsys):
    """`main` end to end with stand-in cells: the extra seeds, two cells at a time, the base evaluated once, a
    commit per finished cell, the report with what the grid resolves, and a rerun that skips everything."""
    methods = ["fgrpo", "fedavg"]
    cells = harness.grid.grid_cells(methods, [0, 1], {"fgrpo": [2], "fedavg": [2]}, [3], ["0.05"])
    gains = {"fgrpo": [0.10, 0.14, 0.12], "fedavg": [0.05, 0.06, 0.10]}
    spec = _fake_spec(repository.parent / "fake", base=_evaluation(0.20, 0.10), together=2, wait_for=20, cells={
        "/".join(cell.directory(Path("grid")).parts[-3:]): _evaluation(0.20 + gains[cell.method][cell.seed], 0.10)
        for cell in cells
    })

    def fake_command(cell, config, root, extra):
        if (cell.directory(root) / "result.json").exists():
            return None
        return [sys.executable, str(FAKE_CELL), str(cell.directory(root)), str(spec), *extra, *cell.overrides()]

    monkeypatch.setattr(harness.grid, "cell_command", fake_command)
    config = repository / "grid.yaml"
    config.write_text("num_rounds: 8\n")
    grid = repository / "grid"
    argv = ["--config", str(config), "--output_dir", str(grid), "--methods", *methods, "--seeds", "0", "1",
            "--extra_seeds", "fgrpo,fedavg:2", "--parallel", "2", "--commit", "--max_eval_samples", "10"]
    assert verdict.main(argv) == 0
    out = capsys.readouterr().out
    assert "# Verdict: FGRPO against the baselines (complete: 6 of 6 cells finished)" in out

    log = {entry["cell"]: entry for entry in _log(repository.parent / "fake")}
    assert len(log) == 6 and max(entry["seen"] for entry in log.values()) == 2
    first = "/".join(cells[0].directory(grid).parts[-3:])
    assert [key for key, entry in log.items() if "--eval_initial" not in entry["flags"]] == [first]
    assert all(entry["flags"][:2] == ["--max_eval_samples", "10"] for entry in log.values())

    subjects = _git(repository, "log", "--format=%s").splitlines()
    assert sum(subject.endswith("finished") for subject in subjects) == 6
    tracked = _git(repository, "ls-files").split()
    assert all(f"grid/{cell.directory(Path('.'))}/result.json" in tracked for cell in cells)
    assert not [name for name in tracked if "safetensors" in name or "checkpoint" in name or "round-1" in name]
    assert {"grid/verdict.md", "grid/verdict.json", "grid/budget.json"} <= set(tracked)

    summary = json.loads((grid / "verdict.json").read_text())
    (paired,) = summary["paired"]
    assert paired["seeds"] == [0, 1, 2] and summary["test_items"] == 10
    differences = [100 * (gains["fgrpo"][s] - gains["fedavg"][s]) for s in range(3)]
    assert paired["total"]["mean"] == pytest.approx(statistics.fmean(differences))
    half = stats.t.ppf(0.975, 2) * statistics.stdev(differences) / math.sqrt(3)
    assert paired["total"]["half_width"] == pytest.approx(half)
    assert paired["total_detectable_80"] == pytest.approx(minimum_detectable(statistics.stdev(differences), 3))
    report = (grid / "verdict.md").read_text()
    assert f"| {half:.2f} |" in report and "one test item is 10.00 points" in report

    commits = len(subjects)
    assert verdict.main(argv) == 0  # everything finished: skipped, nothing new to commit for the cells
    assert sum(s.endswith("finished") for s in _git(repository, "log", "--format=%s").splitlines()) == 6
    assert len(_git(repository, "log", "--format=%s").splitlines()) <= commits + 1
    with pytest.raises(SystemExit):  # another budget in the same folder
        verdict.main([*argv, "--num_rounds", "4"])


def test_each_cell_attempt_records_the_machine_it_ran_on(tmp_path):
    spec = _fake_spec(tmp_path / "fake", base={}, default_final={})
    cell = Cell("fedavg", 0, 3, "0.05")

    def command(cell):
        return [sys.executable, str(FAKE_CELL), str(cell.directory(tmp_path)), str(spec)]

    failures = harness.grid.run_cells([cell], tmp_path, command, parallel=2)
    assert failures == []
    (attempt,) = json.loads((cell.directory(tmp_path) / harness.cells.COST_FILE).read_text())
    machine = attempt["machine"]
    cores = len(os.sched_getaffinity(0))
    assert machine["cores"] == cores
    assert machine["threads"] == max(1, cores // 2)  # --parallel 2: each cell its share, as cell_environment sets
    assert machine["cpu"] and machine["versions"]["torch"] == torch.__version__
    assert set(machine["cpu_flags"]) <= harness.grid.KERNEL_FLAGS


def test_secondary_endpoints_from_per_item_scores_and_the_seeds_a_target_takes(tmp_path, capsys):
    """Arithmetic against the other tasks from each evaluation's per-item scores (the folder's test-items.json gives
    each item's task), the seeds FGRPO − FedAvg needs for ±3 points, and the machines the cells recorded."""
    tasks = ["chain_sum"] * 2 + ["products"] * 2 + ["gcd"] * 4
    (tmp_path / harness.cells.TEST_ITEMS_FILE).write_text(json.dumps(tasks))
    base_rows = [0, 0, 1, 0] + [1, 0, 0, 0]  # arithmetic 25%, other 25%
    finals = {"fgrpo": ([1, 1, 1, 0] + [1, 0, 0, 0], [1, 1, 0, 0] + [1, 1, 0, 0]),  # arithmetic 75 / 50, other 25 / 50
              "fedavg": ([0, 1, 1, 0] + [1, 1, 1, 0], [0, 1, 1, 0] + [1, 1, 1, 1])}  # arith 50 / 50, other 75 / 100
    for method, seeds in finals.items():
        for seed, rows in enumerate(seeds):
            result = _result((0.25, 0.1), (statistics.fmean(rows), 0.1), [0.1, 0.2])
            result["evaluations"]["-1"]["row_rewards"] = base_rows
            result["evaluations"]["1"]["row_rewards"] = rows
            _write(tmp_path, Cell(method, seed, 3, "0.05"), result)
    machine = {"cpu": "AMD EPYC", "cpu_flags": ["avx512_bf16"], "cores": 2, "threads": 1, "python": "3.11",
               "versions": {"torch": "2.13.0", "transformers": "5.24.0"}}
    for seed in (0, 1):
        harness.grid.record_cost(Cell("fgrpo", seed, 3, "0.05").directory(tmp_path), 1.0, 1.0, machine)
    assert verdict.main(["--output_dir", str(tmp_path), "--methods", "fgrpo", "fedavg", "--seeds", "0", "1",
                         "--report_only"]) == 0
    capsys.readouterr()
    summary = json.loads((tmp_path / "verdict.json").read_text())
    rows = {row["method"]: row for row in summary["methods"]}
    assert rows["fgrpo"]["arith_gain"]["mean"] == pytest.approx(37.5)  # (50 + 25) / 2
    assert rows["fgrpo"]["other_gain"]["mean"] == pytest.approx(12.5)
    assert rows["fedavg"]["other_gain"]["mean"] == pytest.approx(62.5)
    (paired,) = summary["paired"]
    assert paired["arith"]["mean"] == pytest.approx(12.5) and paired["other"]["mean"] == pytest.approx(-50.0)
    sd = paired["total"]["sd"]
    needed = paired["total_seeds_for_target"]
    assert t_quantile(0.975, needed - 1) * sd / math.sqrt(needed) <= 3.0
    assert t_quantile(0.975, needed - 2) * sd / math.sqrt(needed - 1) > 3.0
    report = (tmp_path / "verdict.md").read_text()
    assert "Endpoints, named before the cells ran: total accuracy (primary)" in report
    assert "Machines: 1 recorded (AMD EPYC (avx512_bf16), 2 core(s) free to the harness, 1 thread(s)" in report
    assert "2 cell(s) ran before cells recorded their machine" in report
    assert seeds_for(0.0, 3.0) is None and seeds_for(1.0, 3.0) == 3  # t(0.975, 2) / √3 = 2.48 ≤ 3


def test_holm_adjusts_step_down_and_keeps_the_order():
    # sorted 0.01, 0.03, 0.04 of m = 3: 0.03, then max(0.03, 2 × 0.03) = 0.06, then max(0.06, 1 × 0.04) = 0.06
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06})
    adjusted = holm({"a": 0.5, "b": math.nan, "c": 0.4})  # NaN is not counted in m
    assert adjusted["a"] == pytest.approx(0.8) and math.isnan(adjusted["b"])
    assert holm({"a": 0.9, "b": 0.8}) == {"a": 1.0, "b": 1.0}


def test_paired_p_is_scipys_one_sample_t_test():
    from scipy import stats

    differences = [1.0, 2.5, 0.5, 3.0]
    assert paired_p(differences) == pytest.approx(stats.ttest_1samp(differences, 0.0).pvalue)
    assert math.isnan(paired_p([1.0])) and math.isnan(paired_p([2.0, 2.0]))
    assert math.isnan(paired_p([1.0, math.nan]))
