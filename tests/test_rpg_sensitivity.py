"""benchmarks/rpg_sensitivity.py: settings paired with the verdict grid's default FGRPO cells, and the weight
diagnostics."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from trl_federated.reports.compare import Cell

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("benchmark_rpg_sensitivity", ROOT / "benchmarks" / "rpg_sensitivity.py")
sensitivity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sensitivity)


def _result(final_total, final_hard, rounds, base=True):
    """A finished FGRPO cell's result.json: evaluations and per-round client rewards, gains h and weights ω."""
    evaluations = {str(len(rounds) - 1): {"accuracy": {"Total": final_total, "hard": final_hard}}}
    if base:  # only the grid's first cell evaluates the base model
        evaluations["-1"] = {"accuracy": {"Total": 0.20, "hard": 0.10}}
    return {"evaluations": evaluations, "rounds": [
        {"round_idx": t, "rewards": rewards, "gains": gains, "weights": weights}
        for t, (rewards, gains, weights) in enumerate(rounds)
    ]}


ROUNDS = [
    ({"a": 0.0, "b": 0.5}, {"a": 0.0, "b": 0.0}, {"a": 0.5, "b": 0.5}),  # round 0: h = 0, left out of the diagnostics
    ({"a": 0.25, "b": 0.5}, {"a": 2.0, "b": -1.0}, {"a": 0.7, "b": 0.3}),
    ({"a": 0.5, "b": 0.0}, {"a": 1.0, "b": -3.0}, {"a": 0.9, "b": 0.1}),
]


def _write(folder, seed, result):
    directory = Cell("fgrpo-paper", seed, 3, "0.05").directory(folder)  # the sweep's default --method
    directory.mkdir(parents=True)
    (directory / "result.json").write_text(json.dumps(result))


def test_weight_diagnostics_skip_round_zero():
    diagnostics = sensitivity.weight_diagnostics(_result(0.3, 0.1, ROUNDS), completions_per_window=16)
    assert diagnostics["mean_abs_h"] == pytest.approx((2 + 1 + 1 + 3) / 4)
    assert diagnostics["weight_spread"] == pytest.approx((0.4 + 0.8) / 2)
    errors = [math.sqrt(0.25 * 0.75 / 16), math.sqrt(0.25 / 16), math.sqrt(0.25 / 16), 0.0]
    assert diagnostics["reward_standard_error"] == pytest.approx(sum(errors) / 4)


def test_settings_are_paired_with_the_grid_default_of_the_same_seed(tmp_path, capsys):
    grid, out = tmp_path / "grid", tmp_path / "sensitivity"
    # default FGRPO: total gains +10 and +12 points; tau_min=1.0: +6 and +12 -> paired (setting − default) −4 and 0
    _write(grid, 0, _result(0.30, 0.10, ROUNDS))
    _write(grid, 1, _result(0.32, 0.15, ROUNDS, base=False))
    _write(out / "rpg_tau_min=1.0", 0, _result(0.26, 0.10, ROUNDS, base=False))
    _write(out / "rpg_tau_min=1.0", 1, _result(0.32, 0.10, ROUNDS, base=False))
    _write(out / "server_learning_rate=1e-4", 1, _result(0.20, 0.10, ROUNDS, base=False))  # an earlier command's
    args = ["--grid", str(grid), "--output_dir", str(out), "--settings", "rpg_tau_min=1.0", "rpg_lambda_base=0.6",
            "--report_only"]
    assert sensitivity.main(args) == 0
    assert "| rpg_tau_min=1.0 | 2 |" in capsys.readouterr().out
    records = {r["setting"]: r for r in json.loads((out / "rpg-sensitivity.json").read_text())["settings"]}
    # lambda_base=0.6 has no finished cell; the learning-rate setting is reported with its one seed, paired with seed 1
    assert set(records) == {"(default)", "rpg_tau_min=1.0", "server_learning_rate=1e-4"}
    assert records["server_learning_rate=1e-4"]["seeds"] == [1]
    assert records["server_learning_rate=1e-4"]["paired_vs_default"]["total"]["mean"] == pytest.approx(-12.0)
    assert records["(default)"]["server_step_ratio"] is None  # these cells have no round checkpoints
    assert records["(default)"]["total_gain"]["mean"] == pytest.approx(11.0)
    assert records["rpg_tau_min=1.0"]["paired_vs_default"]["total"]["mean"] == pytest.approx(-2.0)
    assert records["rpg_tau_min=1.0"]["paired_vs_default"]["hard"]["mean"] == pytest.approx(-2.5)
    assert json.loads((out / "rpg-sensitivity.json").read_text())["completions_per_window"] == 16  # verdict.yaml's


def test_a_setting_must_name_an_rpg_field_and_the_grid_must_have_run(tmp_path):
    with pytest.raises(SystemExit):
        sensitivity.main(["--settings", "rpg_tau=1.0", "--report_only"])
    with pytest.raises(SystemExit):  # no default FGRPO cell to pair with: refused before any cell runs
        sensitivity.main(["--grid", str(tmp_path / "empty"), "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "rpg_tau_min=1.0").exists()


def test_server_step_ratio_from_round_checkpoints(tmp_path):
    """Adam's moments give Δ back (Δ^t = (m^t − β1 m^{t−1}) / (1 − β1)); the adapters give the step."""
    from peft import LoraConfig

    from trl_federated.core.checkpoint import Checkpoint, write_checkpoint

    def checkpoint(round_idx, b, aggregator):
        return Checkpoint(round_idx=round_idx, global_state={key: b.clone()}, aggregator=aggregator,
                          history=[], evaluations={}, identity={"training": {"server_beta1": 0.9}})

    key = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    deltas, steps = [1e-4, -2e-4], [1e-3, -3e-3]  # the server moved B 10x, then 15x the clients' mean change
    m, b = torch.zeros(4, 2), torch.zeros(4, 2)
    for t, (delta, step) in enumerate(zip(deltas, steps)):
        m, b = 0.9 * m + 0.1 * delta, b + step
        adam = {"server_optimizer": {"m": {key: m.clone()}, "v": {key: m.square()}, "num_steps": t + 1}}
        write_checkpoint(checkpoint(t, b, adam), tmp_path / "adam", LoraConfig())
    assert sensitivity.server_step_ratio(tmp_path / "adam") == pytest.approx(12.5, rel=1e-4)
    write_checkpoint(checkpoint(0, b, {}), tmp_path / "sgd", LoraConfig())  # SGD: no moments
    assert sensitivity.server_step_ratio(tmp_path / "sgd") is None
