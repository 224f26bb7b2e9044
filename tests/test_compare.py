"""The comparison harness runs a 2-method × 2-seed grid end to end on the tiny model, and resumes."""

import csv
import json
import os

import pytest
import yaml

from trl_federated.reports.compare import main


def test_grid_runs_writes_tables_and_resumes(tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": str(tiny_model_dir), "benchmark_size": 48, "max_eval_samples": 8,
        "num_clients": 2, "dirichlet_alpha": 1.0, "num_rounds": 2, "local_steps": 1, "reward_window": 1,
        "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8,
        "per_device_eval_batch_size": 8, "use_cpu": True, "bf16": False, "gradient_checkpointing": False,
        "report_to": "none", "reward_funcs": ["accuracy", "format"],
    }))
    grid = tmp_path / "grid"
    common = ["--config", str(config), "--output_dir", str(grid), "--methods", "fgrpo", "fedavg"]

    assert main([*common, "--seeds", "0"]) == 0
    first = grid / "base" / "fgrpo" / "seed0" / "result.json"
    stamp = first.stat().st_mtime_ns
    capsys.readouterr()

    assert main([*common, "--seeds", "0", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("done, skipped") == 2 and out.count(": running") == 2
    assert first.stat().st_mtime_ns == stamp  # the finished cell was not re-run

    for method in ("fgrpo", "fedavg"):
        for seed in (0, 1):
            result = json.loads((grid / "base" / method / f"seed{seed}" / "result.json").read_text())
            assert len(result["rounds"]) == 2 and set(result["evaluations"]) == {"-1", "1"}
    # the same partitions for both methods: the same clients hold the same number of rows, seed by seed
    a = json.loads((grid / "base" / "fgrpo" / "seed1" / "result.json").read_text())
    b = json.loads((grid / "base" / "fedavg" / "seed1" / "result.json").read_text())
    assert a["rounds"][0]["bytes_sent"] == b["rounds"][0]["bytes_sent"]
    # FGRPO w/o RPG is FedAvg (Table 3 pairs them): data-volume weights; RPG weighs the first round uniformly
    assert set(a["rounds"][0]["weights"].values()) == {0.5}

    rows = list(csv.reader((grid / "table1.csv").open()))
    assert rows[0][:2] == ["Setting", "Method"] and rows[0][-2:] == ["Total", "Seeds"]
    assert {row[1] for row in rows[1:]} == {"fgrpo", "fedavg"} and all(row[-1] == "2" for row in rows[1:])
    assert "±" in rows[1][-2]
    table3 = list(csv.reader((grid / "table3.csv").open()))
    assert table3[1][:2] == ["base", "FGRPO"] and "-" not in table3[1][2:]
    assert (grid / "comparison.md").exists() and (grid / "curves-base.png").exists()
    assert os.path.getsize(grid / "curves-base.png") > 0


def test_an_interrupted_cell_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    import torch
    from peft import LoraConfig

    from trl_federated.core.checkpoint import Checkpoint, write_checkpoint
    from trl_federated.reports import compare

    commands = []
    monkeypatch.setattr(compare.subprocess, "run", lambda command, check: commands.append(command))
    cell = compare.Cell("fgrpo", 0, None, None)
    compare.run_cell(cell, "base.yaml", tmp_path, [])  # nothing there yet: a fresh start
    write_checkpoint(Checkpoint(0, {"w": torch.zeros(1)}, {}, [], {}, {}), cell.directory(tmp_path),
                     LoraConfig(r=2, target_modules=["q_proj"]))
    compare.run_cell(cell, "base.yaml", tmp_path, [])  # killed after round 0: resume
    assert commands[0][-2:] == ["--overwrite_output_dir", "true"]
    assert commands[1][-2:] == ["--resume_from_checkpoint", "true"]


def test_one_server_learning_rate_for_adam_and_sgd_methods_is_refused(tmp_path, capsys):
    config = tmp_path / "base.yaml"
    config.write_text("aggregation: rpg\nserver_learning_rate: 1.0e-3\n")
    with pytest.raises(SystemExit):
        main(["--config", str(config), "--output_dir", str(tmp_path / "grid"), "--methods", "fgrpo-paper", "fedavg"])
    assert "server_learning_rate" in capsys.readouterr().err and not (tmp_path / "grid").exists()
    config.write_text("aggregation: rpg\n")
    with pytest.raises(SystemExit):  # the same rate given as a flag
        main(["--config", str(config), "--output_dir", str(tmp_path / "grid"), "--methods", "fgrpo-paper", "fedavg",
              "--server_learning_rate=0.5"])
    assert "server_learning_rate" in capsys.readouterr().err


def test_a_cell_interrupted_under_an_earlier_checkpoint_format_starts_afresh(tmp_path, capsys):
    from trl_federated.core.checkpoint import CHECKPOINT_FORMAT, STATE_FILE
    from trl_federated.reports.compare import Cell, cell_command

    cell = Cell("fedavg", 1, 3, "0.05")
    checkpoint = cell.directory(tmp_path) / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / STATE_FILE).write_text('{"round_idx": 3}')  # an earlier version's: no format recorded
    command = cell_command(cell, "grid.yaml", tmp_path, [])
    assert command[-2:] == ["--overwrite_output_dir", "true"]
    assert "earlier format" in capsys.readouterr().out
    (checkpoint / STATE_FILE).write_text(f'{{"round_idx": 3, "format": {CHECKPOINT_FORMAT}}}')
    assert cell_command(cell, "grid.yaml", tmp_path, [])[-2:] == ["--resume_from_checkpoint", "true"]
