"""A drop-in federated run reports through TRL's own logging: `trainer.state` and the `report_to` integrations."""

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from conftest import length_reward
from test_cli import labelled_dataset
from trl_federated import FederatedRunner, FedGRPOTrainer
from trl_federated.adapters import default_lora_config


def read_scalars(logging_dir: Path) -> EventAccumulator:
    (event_dir,) = {path.parent for path in logging_dir.rglob("events.out.tfevents.*")}
    return EventAccumulator(str(event_dir)).Reload()


def test_federated_rounds_reach_trainer_state_and_tensorboard(
    tmp_path, monkeypatch, tiny_model_dir, tiny_tokenizer, fast_args
):
    logging_dir = tmp_path / "tensorboard"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logging_dir))
    args = fast_args(
        num_clients=2, dirichlet_alpha=float("inf"), num_rounds=2, local_steps=2, report_to=["tensorboard"],
        aggregation="rpg", eval_every=1,
    )
    trainer = FedGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward, args=args,
        train_dataset=labelled_dataset(), eval_dataset=labelled_dataset(4), processing_class=tiny_tokenizer,
        peft_config=default_lora_config(),
    )
    trainer.train()

    assert trainer.state.global_step == 2 * 2  # rounds x local steps
    before, *rounds = trainer.state.log_history
    assert before["step"] == 0 and "eval_accuracy/Total" in before
    assert [entry["step"] for entry in rounds] == [2, 4]
    for entry in rounds:
        for client_id in ("client_0", "client_1"):
            for name in ("reward_window", "rpg_gain", "weight", "bytes_sent", "loss", "completions/mean_length"):
                assert f"{client_id}/{name}" in entry
        # TRL's step metrics keep their names, as means over the clients' local steps
        assert {"reward", "loss", "completions/mean_length", "rewards/length_reward/mean", "grad_norm"} <= set(entry)
        assert {"temperature", "bytes_sent", "eval_accuracy/Total", "eval_accuracy/simple"} <= set(entry)
        assert "epoch" not in entry

    events = read_scalars(logging_dir)
    scalars = events.Tags()["scalars"]
    assert [event.step for event in events.Scalars("train/client_0/weight")] == [2, 4]
    assert [event.step for event in events.Scalars("eval/accuracy/Total")] == [0, 2, 4]
    assert {"train/reward", "train/loss", "train/completions/mean_length", "train/client_1/rpg_gain"} <= set(scalars)
    # evaluation scores with the training reward by default
    assert {"train/temperature", "eval/accuracy/simple", "eval/rewards/length_reward/mean"} <= set(scalars)


def test_the_runner_alone_reports_to_report_to(tmp_path, monkeypatch, tiny_model_dir, tiny_tokenizer, fast_args):
    logging_dir = tmp_path / "tensorboard"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logging_dir))
    args = fast_args(num_rounds=2, local_steps=1, reward_window=1, report_to=["tensorboard"])
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args,
        [labelled_dataset(8), labelled_dataset(8)], processing_class=tiny_tokenizer,
    )  # fmt: skip
    runner.run()
    assert [entry["step"] for entry in runner.log_to.state.log_history] == [1, 2]
    events = read_scalars(logging_dir)
    assert [event.step for event in events.Scalars("train/client_1/weight")] == [1, 2]


def test_round_metrics_plot_reads_what_the_rounds_logged(
    tmp_path, monkeypatch, tiny_model_dir, tiny_tokenizer, fast_args
):
    """examples/scripts/plot_tensorboard.py reads R̄, h, ω per client and τ back from the event files, per round."""
    import importlib.util

    from trl_federated.scoring.rewards import completion_text

    def text_length_reward(completions, **kwargs):
        return [len(completion_text(completion)) / 64 for completion in completions]

    spec = importlib.util.spec_from_file_location(
        "plot_tensorboard", Path(__file__).parents[1] / "examples" / "scripts" / "plot_tensorboard.py"
    )
    plot_tensorboard = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_tensorboard)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "run" / "runs" / "one"))
    args = fast_args(num_rounds=3, local_steps=1, reward_window=1, report_to=["tensorboard"], aggregation="rpg")
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), text_length_reward, args,
        [labelled_dataset(8), labelled_dataset(8)], processing_class=tiny_tokenizer,
    )  # fmt: skip
    history = runner.run()
    assert len({record.weights["client_0"] for record in history}) > 1  # the curves are not flat

    values, temperature, steps = plot_tensorboard.read_rounds(plot_tensorboard.newest_event_dir(tmp_path / "run"))
    assert steps == [1, 2, 3]
    for name, attribute in (("reward_window", "rewards"), ("rpg_gain", "gains"), ("weight", "weights")):
        for client_id in ("client_0", "client_1"):
            expected = [getattr(record, attribute)[client_id] for record in history]
            assert values[name][client_id] == pytest.approx(expected, rel=1e-6)  # TensorBoard stores float32
    assert temperature == pytest.approx([record.temperature for record in history], rel=1e-6)
    output = tmp_path / "rounds.png"
    plot_tensorboard.plot(values, temperature, steps, output, "test")
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
