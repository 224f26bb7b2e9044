"""One registry per kind of name (`choices.AGGREGATIONS`, `SERVER_OPTIMIZERS`, `ROBUST_AGGREGATIONS`,
`TRANSFER_DTYPES`), read when the command line parses and when the config checks: a server optimizer, an aggregation,
a robust combiner and a wire format of one's own are one file (tests/own_methods.py) and one registration line each,
and run from `trl-federated run` with their own hyperparameters and checks."""

import json
import sys

import pytest
import torch
import yaml

from trl_federated.arguments import parse_run_args
from trl_federated.choices import AGGREGATIONS, ROBUST_AGGREGATIONS, SERVER_OPTIMIZERS, TRANSFER_DTYPES
from trl_federated.cli import main


def test_a_name_registered_after_import_is_a_choice_of_the_parser_and_the_config(tmp_path):
    argv = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none", "--aggregation", "leader"]
    if "own_methods" not in sys.modules:  # before the registration, `leader` is no choice
        with pytest.raises(SystemExit):
            parse_run_args(argv)
    import own_methods

    assert AGGREGATIONS["leader"].aggregator_class is own_methods.Leader
    assert AGGREGATIONS["leader"].server_optimizer == "sgd" and SERVER_OPTIMIZERS["half-step"] is own_methods.HalfStep
    args, _, _ = parse_run_args([*argv, "--server_optimizer", "half-step",
                                 "--server_optimizer_args", json.dumps({"scale": 0.25})])
    assert (args.aggregation, args.server_optimizer) == ("leader", "half-step")
    assert args.server_optimizer_args == {"scale": 0.25} and args.server_learning_rate == 1.0  # its own default
    # each checks its own hyperparameter, through the config
    with pytest.raises(SystemExit):
        parse_run_args([*argv, "--aggregation_args", json.dumps({"leader_weight": 2.0})])


def test_an_own_robust_combiner_and_wire_format_are_choices_with_their_own_checks(tmp_path, capsys):
    import own_methods

    assert ROBUST_AGGREGATIONS["drop_farthest"] is own_methods.DropFarthest
    assert TRANSFER_DTYPES["float16"].dtype == torch.float16
    argv = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none", "--num_clients", "3",
            "--robust_aggregation", "drop_farthest", "--robust_num_malicious", "2", "--transfer_dtype", "float16"]
    with pytest.raises(SystemExit):  # its own fewest clients, f + 1, checked by the config
        parse_run_args(argv)
    assert "only among at least 3 a round" in capsys.readouterr().err
    args, _, _ = parse_run_args([*argv, "--min_clients_per_round", "3"])
    assert (args.robust_aggregation, args.transfer_dtype) == ("drop_farthest", "float16")
    # it drops the client farthest from the mean: the other two's weighted mean is Δ
    theta = {"w": torch.zeros(2)}
    states = [{"w": torch.tensor([1.0, 1.0])}, {"w": torch.tensor([3.0, 1.0])}, {"w": torch.tensor([100.0, -50.0])}]
    combiner = own_methods.DropFarthest(num_malicious=1)
    combiner.prepare(theta, states)
    assert combiner.selected == [0, 1]
    assert combiner.pseudo_gradient(theta, states, [0.25, 0.25, 0.5])["w"].tolist() == [2.0, 1.0]


def test_an_own_aggregation_and_server_optimizer_run_from_the_command_line(tmp_path, tiny_model_dir):
    import own_methods  # noqa: F401 - registers `leader` and `half-step`

    output_dir = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(output_dir), "model_name_or_path": str(tiny_model_dir), "benchmark_size": 40,
        "max_eval_samples": 4, "num_clients": 2, "dirichlet_alpha": "inf", "num_rounds": 1, "local_steps": 1,
        "reward_window": 1, "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8,
        "per_device_eval_batch_size": 4, "use_cpu": True, "bf16": False, "gradient_checkpointing": False,
        "report_to": "none", "eval_initial": False,
    }))  # fmt: skip
    assert main(["run", "--config", str(config), "--aggregation", "leader", "--server_optimizer", "half-step",
                 "--aggregation_args", '{"leader_weight": 0.75}', "--server_optimizer_args", '{"scale": 0.5}',
                 "--transfer_dtype", "float16"]) == 0
    (result,) = json.loads((output_dir / "result.json").read_text())["rounds"]
    assert sorted(result["weights"].values()) == pytest.approx([0.25, 0.75])
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    (round_line,) = [line for line in metrics if line["event"] == "round"]
    # each client sent its change in float16 and received θ in float32
    assert {client: sent * 2 for client, sent in round_line["bytes_sent"].items()} == round_line["bytes_received"]


def test_an_own_robust_combiner_runs_from_the_command_line(tmp_path, tiny_model_dir):
    import own_methods  # noqa: F401 - registers `drop_farthest`

    output_dir = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(output_dir), "model_name_or_path": str(tiny_model_dir), "benchmark_size": 40,
        "max_eval_samples": 4, "num_clients": 2, "dirichlet_alpha": "inf", "num_rounds": 1, "local_steps": 1,
        "reward_window": 1, "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8,
        "per_device_eval_batch_size": 4, "use_cpu": True, "bf16": False, "gradient_checkpointing": False,
        "report_to": "none", "eval_initial": False,
    }))  # fmt: skip
    assert main(["run", "--config", str(config), "--aggregation", "fedavg", "--robust_aggregation", "drop_farthest",
                 "--robust_num_malicious", "1", "--min_clients_per_round", "2"]) == 0
    (result,) = json.loads((output_dir / "result.json").read_text())["rounds"]
    # it kept one client of two, which takes all of the combination (ω as applied), and the round records which
    assert sorted(result["weights"].values()) == [0.0, 1.0]
    assert sorted(result["robust_selected"].values()) == [0, 1]
