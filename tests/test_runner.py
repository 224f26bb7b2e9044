import json

import pytest
import torch
from datasets import Dataset
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from conftest import length_reward
from trl_federated import FedAvgAggregator, FederatedRunner, RoundCallback, ServerSGD
from trl_federated.adapters import get_adapter_state


def client_datasets(num_clients=3, per_client=6):
    return {
        f"site-{c}": Dataset.from_dict(
            {"prompt": [f"Client {c} asks: what is {i} times {c}?" for i in range(per_client)]}
        )
        for c in range(num_clients)
    }


class Recorder(RoundCallback):
    def __init__(self):
        self.events = []

    def on_round_begin(self, args, round_idx, **kwargs):
        self.events.append(("begin", round_idx))

    def on_client_end(self, args, round_idx, update, **kwargs):
        self.events.append(("client", round_idx, update.client_id))

    def on_round_end(self, args, record, **kwargs):
        self.events.append(("end", record.round_idx))

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step",))


def test_two_rounds_three_clients_end_to_end(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args):
    args = fast_args(num_rounds=2, local_steps=2, reward_window=2)
    recorder = Recorder()
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args, client_datasets(),
        processing_class=tiny_tokenizer, callbacks=[recorder],
    )
    initial = {key: value.clone() for key, value in runner.global_state.items()}
    history = runner.run()

    # the adapter changed, and every round reports R̄, h, ω, τ and bytes for every client
    assert any(not torch.equal(initial[key], runner.global_state[key]) for key in initial)
    assert [record.round_idx for record in history] == [0, 1]
    for record in history:
        assert set(record.rewards) == set(record.weights) == set(record.gains) == {"site-0", "site-1", "site-2"}
        assert sum(record.weights.values()) == pytest.approx(1.0)
        assert record.temperature == pytest.approx(runner.aggregator.temperature(record.round_idx))
        assert all(n == sum(t.numel() * 4 for t in initial.values()) for n in record.bytes_sent.values())
        assert record.bytes_received == record.bytes_sent
        for client_id, metrics in record.client_metrics.items():
            assert len(metrics["step_rewards"]) == 2
            assert record.rewards[client_id] == pytest.approx(sum(metrics["step_rewards"]) / 2)
    assert history[0].gains == {"site-0": 0.0, "site-1": 0.0, "site-2": 0.0}  # first report: h = 0

    # callbacks: round and client hooks in order, and local-step events from the clients' trainers
    hooks = [event for event in recorder.events if event[0] != "step"]
    assert hooks[:5] == [
        ("begin", 0), ("client", 0, "site-0"), ("client", 0, "site-1"), ("client", 0, "site-2"), ("end", 0)
    ]
    assert recorder.events.count(("step",)) == 2 * 3 * 2

    # metrics.jsonl: a line per client report and per round
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["event"] for line in lines].count("client") == 6
    rounds = [line for line in lines if line["event"] == "round"]
    assert [line["round_idx"] for line in rounds] == [0, 1]
    assert rounds[1]["weights"] == pytest.approx(history[1].weights)

    # the final global adapter is a standard PEFT adapter that PeftModel loads, per round too
    output_dir = tmp_path / "run"
    assert (output_dir / "adapter_config.json").exists()
    saved = load_file(output_dir / "adapter_model.safetensors")
    assert (output_dir / "round-0" / "adapter_model.safetensors").exists()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), output_dir)
    reloaded = get_adapter_state(loaded)
    assert set(reloaded) == set(runner.global_state)
    for key, value in runner.global_state.items():
        assert torch.equal(reloaded[key], value)
    assert len(saved) == len(reloaded)


def test_fedavg_sgd_global_adapter_is_data_weighted_average_of_clients(
    tmp_path, tiny_model_dir, tiny_tokenizer, fast_args
):
    args = fast_args(num_rounds=1, local_steps=1, reward_window=1)
    clients = client_datasets(num_clients=2)
    clients["site-1"] = Dataset.from_dict({"prompt": [f"More data {i}" for i in range(18)]})
    updates = []

    class Keep(RoundCallback):
        def on_client_end(self, args, round_idx, update, **kwargs):
            updates.append(update)

    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args, clients,
        processing_class=tiny_tokenizer, aggregator=FedAvgAggregator(ServerSGD(1.0)), callbacks=[Keep()],
    )
    runner.run()
    assert runner.history[0].weights == {"site-0": 0.25, "site-1": 0.75}
    for key, value in runner.global_state.items():
        expected = 0.25 * updates[0].state[key] + 0.75 * updates[1].state[key]
        torch.testing.assert_close(value, expected)


def test_clients_start_each_round_from_the_global_adapter(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args):
    """A client's local training must not leak into the next client's start."""
    args = fast_args(num_rounds=1, local_steps=1, reward_window=1)
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args, client_datasets(2),
        processing_class=tiny_tokenizer,
    )
    global_state = {key: value.clone() for key, value in runner.global_state.items()}
    first = runner.train_client(0, 0, "site-0")
    second_start = get_adapter_state(runner.model)  # site-0's trained adapter is still loaded here
    runner.train_client(0, 1, "site-1")
    assert any(not torch.equal(second_start[k], global_state[k]) for k in global_state)
    # train_client reloads the global adapter first, so site-1's result does not depend on site-0's
    alone = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args, client_datasets(2),
        processing_class=tiny_tokenizer,
    ).train_client(0, 1, "site-1")
    again = runner.train_client(0, 1, "site-1")
    for key in global_state:
        assert torch.equal(alone.state[key], again.state[key])
    assert first.client_id == "site-0"


def test_runner_rejects_empty_clients(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args):
    with pytest.raises(ValueError, match="empty"):
        FederatedRunner(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, fast_args(),
            {"a": Dataset.from_dict({"prompt": []})}, processing_class=tiny_tokenizer,
        )


def test_progress_bar_counts_local_steps_and_shows_the_client(
    tmp_path, tiny_model_dir, tiny_tokenizer, fast_args, capsys
):
    args = fast_args(num_rounds=2, local_steps=2, reward_window=2)
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args, client_datasets(),
        processing_class=tiny_tokenizer,
    )
    runner.run()
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    final = [line for line in bar if "Federated rounds" in line][-1]
    assert "12/12" in final  # 2 rounds x 3 clients x 2 local steps
    assert "round 1 (2/2), site-2, step 2/2, reward " in final and " s/step" in final  # round t, its position k/T


def test_a_reward_model_given_by_id_is_loaded_once_per_run(tiny_model_dir, tiny_tokenizer, fast_args, monkeypatch):
    loads = []
    load = AutoModelForSequenceClassification.from_pretrained

    def counted_load(name, *args, **kwargs):
        loads.append(name)
        return load(name, *args, **kwargs)

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", counted_load)
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(tiny_model_dir),
        fast_args(local_steps=1, reward_window=1), client_datasets(num_clients=2), processing_class=tiny_tokenizer,
    )  # fmt: skip
    history = runner.run()
    assert len(history) == 2 and all(len(record.rewards) == 2 for record in history)
    assert loads == [str(tiny_model_dir)]  # not once per client round (4)
