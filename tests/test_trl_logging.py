"""A drop-in federated run reports through TRL's own logging: `trainer.state` and the `report_to` integrations."""

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from conftest import length_reward
from test_cli import labelled_dataset
from trl_federated import FedGRPOTrainer
from trl_federated.runner import default_lora_config


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

    (event_dir,) = {path.parent for path in Path(logging_dir).rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(event_dir)).Reload()
    scalars = events.Tags()["scalars"]
    assert [event.step for event in events.Scalars("train/client_0/weight")] == [2, 4]
    assert [event.step for event in events.Scalars("eval/accuracy/Total")] == [0, 2, 4]
    assert {"train/reward", "train/loss", "train/completions/mean_length", "train/client_1/rpg_gain"} <= set(scalars)
    # evaluation scores with the training reward by default
    assert {"train/temperature", "eval/accuracy/simple", "eval/rewards/length_reward/mean"} <= set(scalars)
