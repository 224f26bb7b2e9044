"""An aggregation with per-client state, defined here and registered with one line, runs, checkpoints and resumes in
the in-process runner and in the Flower strategy through the package's hooks alone (`Aggregator.client_extras`,
`check_extras`, `accept`, `client_hook`, `state_dict`), with no change to the package; the metrics it reports of its
own (`Aggregator.round_metrics`) reach the round record, the round log, the report and result.json."""

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from test_flower import (  # noqa: F401
    assert_states_equal,
    client_data_dirs,
    local_federation,
    loopback_app,
    prompt_datasets,
    task_identity,
)
from trl_federated import FedAvgAggregator, FederatedRunner
from trl_federated.adapters import check_state, state_norm
from trl_federated.aggregation import ClientHook, RoundMetric, register_aggregation
from trl_federated.core.callbacks import round_logs
from trl_federated.core.checkpoint import list_checkpoints, read_checkpoint


class KeepAverage(TrainerCallback):
    """The client side: holds the average the server sent while the client trains, and echoes it back."""

    def __init__(self, average):
        self.average = average
        self.trained_steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.trained_steps += 1

    def reply(self):
        assert self.trained_steps > 0  # the callback joined the client's trainer
        return {"echo": self.average}


class ClientAverageAggregator(FedAvgAggregator):
    """FedAvg that keeps, per client, a moving average of the adapters it reported, μ_i ← ½ μ_i + ½ θ_i (μ_i = 0
    before its first accepted update), sends each client its own μ_i every round and takes it back as the client's
    echo: a reply whose echo is not exactly what that client was sent is refused."""

    def __init__(self, server_optimizer=None, combiner=None):
        super().__init__(server_optimizer, combiner)
        self.averages = {}

    def client_extras(self, client_id, global_state):
        zeros = {key: torch.zeros_like(value, dtype=torch.float32) for key, value in global_state.items()}
        return {"average": self.averages.get(client_id, zeros)}

    def check_extras(self, update, global_state, norm_bound=None, norm_action="reject"):
        if set(update.extras) != {"echo"}:
            raise ValueError(f"it sends {sorted(update.extras)} instead of its echo")
        check_state(update.extras["echo"], global_state, "echo")
        sent = self.client_extras(update.client_id, global_state)["average"]
        if any(not torch.equal(update.extras["echo"][key], value) for key, value in sent.items()):
            raise ValueError("its echo is not the average it was sent")

    def accept(self, update):
        previous = self.client_extras(update.client_id, update.state)["average"]
        self.averages[update.client_id] = {key: 0.5 * previous[key] + 0.5 * value.float()
                                           for key, value in update.state.items()}

    def round_metrics(self):
        # Its own metrics: each client's ‖μ_i‖ and how many clients it keeps an average for.
        return [
            RoundMetric("average_norms", "‖μ‖", {client_id: state_norm(average) for client_id, average in
                                                  self.averages.items()}, per_client=True, log_name="average_norm"),
            RoundMetric("clients_remembered", "#μ", len(self.averages), format="d"),
        ]

    @classmethod
    def client_hook(cls, extras, args):
        callback = KeepAverage(extras["average"])
        return ClientHook(callback, callback.reply)

    def state_dict(self):
        return {**super().state_dict(), "averages": self.averages}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.averages = {client_id: {key: value.clone() for key, value in average.items()}
                         for client_id, average in state["averages"].items()}


register_aggregation("client-average", ClientAverageAggregator)

CLIENTS = ("client_0", "client_1")


def run_runner(model_dir, output_dir, num_rounds=2, runner_class=FederatedRunner, **overrides):
    """The in-process runner on the Flower loopback app's settings (clients client_0, client_1), as
    test_flower.runner_result, with `overrides` of its config."""
    args = loopback_app.federation_args(str(output_dir), {"aggregation": "client-average", "num-rounds": num_rounds})
    for name, value in overrides.items():
        setattr(args, name, value)
    runner = runner_class(
        AutoModelForCausalLM.from_pretrained(model_dir), loopback_app.length_reward, args,
        dict(zip(CLIENTS, prompt_datasets())), processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    runner.run()
    return runner


def adapter_bytes(state):
    return sum(value.numel() * value.element_size() for value in state.values())


def assert_same_averages(a, b):
    assert set(a.averages) == set(b.averages) == set(CLIENTS)
    for client_id in CLIENTS:
        assert_states_equal(a.averages[client_id], b.averages[client_id])


def test_the_runner_runs_checkpoints_and_resumes_a_registered_stateful_aggregation(tmp_path, tiny_model_dir):
    runner = run_runner(tiny_model_dir, tmp_path / "run")
    assert type(runner.aggregator) is ClientAverageAggregator
    assert runner.args.server_optimizer == "sgd"  # the registry's default for it
    assert [set(record.weights) for record in runner.history] == [set(CLIENTS)] * 2
    assert any(value.abs().sum() > 0 for value in runner.aggregator.averages["client_0"].values())
    # The average travels down, the echo up: each counted in the round's traffic.
    adapter = adapter_bytes(runner.global_state)
    assert runner.history[1].bytes_received == runner.history[1].bytes_sent == dict.fromkeys(CLIENTS, 2 * adapter)

    # The per-client state is in the checkpoint, as the aggregator's own state.
    checkpoints = list_checkpoints(tmp_path / "run")
    saved = read_checkpoint(checkpoints[-1]).aggregator["averages"]
    for client_id in CLIENTS:
        assert_states_equal(saved[client_id], runner.aggregator.averages[client_id])

    # Round 1 again from checkpoint-0 ends where the uninterrupted run ended.
    resumed = run_runner(tiny_model_dir, tmp_path / "resumed", resume_from_checkpoint=str(checkpoints[0]))
    assert [record.round_idx for record in resumed.history] == [0, 1]
    assert_states_equal(resumed.global_state, runner.global_state)
    assert_same_averages(resumed.aggregator, runner.aggregator)
    assert [record.weights for record in resumed.history] == [record.weights for record in runner.history]


def test_a_malformed_echo_is_refused_and_leaves_that_clients_state_alone(tmp_path, tiny_model_dir):
    class Forgetful(FederatedRunner):
        """client_1 echoes an average it was never sent."""

        def train_client(self, round_idx, client_index, client_id):
            update = super().train_client(round_idx, client_index, client_id)
            if client_id == "client_1":
                update.extras["echo"] = {key: value + 1 for key, value in update.extras["echo"].items()}
            return update

    runner = run_runner(tiny_model_dir, tmp_path / "run", num_rounds=1, runner_class=Forgetful)
    record = runner.history[0]
    assert set(record.weights) == {"client_0"}
    assert "client 'client_1' rejected: its echo is not the average it was sent" in record.dropped["client_1"]
    assert set(runner.aggregator.averages) == {"client_0"}


def test_the_flower_strategy_runs_and_resumes_a_registered_stateful_aggregation(
    tmp_path, tiny_model_dir, client_data_dirs, task_identity  # noqa: F811
):
    runner = run_runner(tiny_model_dir, tmp_path / "runner")
    strategy = local_federation(tiny_model_dir, client_data_dirs, tmp_path / "flower", "client-average")
    assert type(strategy.aggregator) is ClientAverageAggregator
    assert_states_equal(strategy.global_state, runner.global_state)
    assert_same_averages(strategy.aggregator, runner.aggregator)
    for field in ("weights", "bytes_sent", "bytes_received"):
        assert [getattr(record, field) for record in strategy.history] == [getattr(r, field) for r in runner.history]

    # A ServerApp stopped after round 0 and restarted, its SuperNodes back with new node ids, ends there too.
    local_federation(tiny_model_dir, client_data_dirs, tmp_path / "restarted", "client-average", num_rounds=1)
    resumed = local_federation(tiny_model_dir, client_data_dirs, tmp_path / "restarted", "client-average",
                               node_ids=(21, 22), resume=True)
    assert [record.round_idx for record in resumed.history] == [0, 1]
    assert_states_equal(resumed.global_state, runner.global_state)
    assert_same_averages(resumed.aggregator, runner.aggregator)


def test_a_registered_aggregations_own_metrics_reach_the_record_the_log_the_report_and_the_result(
    tmp_path, tiny_model_dir, caplog
):
    args = loopback_app.federation_args(str(tmp_path / "run"), {"aggregation": "client-average", "num-rounds": 2})
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), loopback_app.length_reward, args,
        dict(zip(CLIENTS, prompt_datasets())), processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        report_header="",
    )
    with caplog.at_level(logging.INFO, logger="trl_federated.reports.round_log"):
        runner.run()
    expected = {client_id: state_norm(runner.aggregator.averages[client_id]) for client_id in CLIENTS}

    # 1. the round record, by the metric's name
    record = runner.history[-1]
    assert record.average_norms == pytest.approx(expected) and all(norm > 0 for norm in expected.values())
    assert record.clients_remembered == 2

    # 2. the round log (`round_logs`, what `report_to` and Flower's Result get; metrics.jsonl keeps the record), and
    # the console line of the round
    logs = round_logs(record)
    assert logs["clients_remembered"] == 2
    assert {client_id: logs[f"{client_id}/average_norm"] for client_id in CLIENTS} == pytest.approx(expected)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last_round = [line for line in lines if line["event"] == "round"][-1]
    assert last_round["average_norms"] == pytest.approx(expected) and last_round["clients_remembered"] == 2
    assert "Round 1 (2/2): 2 clients aggregated, 0 dropped, #μ = 2" in caplog.text
    assert f"client_0: R̄ = {record.rewards['client_0']:.4f}, ‖μ‖ = {expected['client_0']:.4g}, ω = " in caplog.text

    # 3. the report
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "| Round | #μ | Client | R̄ | ‖μ‖ | ω |" in summary
    assert f"| 1 | 2 | client_1 | {record.rewards['client_1']:.3f} | {expected['client_1']:.4g} |" in summary

    # 4. result.json
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["rounds"][-1]["average_norms"] == pytest.approx(expected)
    assert [entry["clients_remembered"] for entry in result["rounds"]] == [2, 2]

    # and a checkpoint brings them back with how to print them
    saved = read_checkpoint(list_checkpoints(tmp_path / "run")[-1]).history[-1]
    assert saved.round_metrics == record.round_metrics
