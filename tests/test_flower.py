"""Flower deployment: record conversions, the strategy against the aggregators, whole federations through the
`ClientApp` and `FederatedStrategy` in one process, and a real loopback run (a SuperLink and two SuperNodes as
separate processes on 127.0.0.1) whose final global adapter must equal the in-process runner's, bit for bit."""

import copy
import io
import json
import logging
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from datasets import Dataset  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict  # noqa: E402,E501
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402
from peft import get_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_federated import ClientUpdate, FederatedRunner  # noqa: E402
from trl_federated.adapters import InvalidUpdateError  # noqa: E402
from trl_federated.aggregation import aggregator_from_config  # noqa: E402
from trl_federated.core.checkpoint import list_checkpoints, read_checkpoint  # noqa: E402
from trl_federated.flower import (  # noqa: E402
    FederatedStrategy,
    TrainInstruction,
    array_record_to_state,
    content_to_update,
    state_to_array_record,
    update_to_content,
)
from trl_federated.flower.records import CLIENT, client_identity_record  # noqa: E402
from trl_federated.flower.strategy import IDENTIFY  # noqa: E402
from trl_federated.runner import NotEnoughClientsError  # noqa: E402

APP_DIR = Path(__file__).parent / "flower_app"
sys.path.insert(0, str(APP_DIR))
import loopback_app  # noqa: E402


def events(output_dir, name):
    lines = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["event"] == name]


def assert_states_equal(a, b):
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


# Records ---------------------------------------------------------------------------------------------------


def test_adapter_states_cross_array_records_bit_for_bit():
    state = {
        "lora_A.weight": torch.randn(4, 8),
        "lora_B.weight": torch.randn(8, 4).to(torch.bfloat16),  # NumPy has no bfloat16
        "steps": torch.arange(3),
    }
    assert_states_equal(array_record_to_state(state_to_array_record(state)), state)


def test_train_instructions_and_updates_cross_flower_records_intact():
    state = {"a": torch.randn(3, 2), "b": torch.randn(2)}
    control = {key: torch.randn_like(value) for key, value in state.items()}
    extras = {"server_control": control, "client_control": state}
    instruction = TrainInstruction.from_content(TrainInstruction(state, 4, 3, extras).to_content())
    assert (instruction.round_idx, instruction.num_clients) == (4, 3)
    assert_states_equal(instruction.global_state, state)
    assert_states_equal(instruction.extras["server_control"], control)
    assert TrainInstruction.from_content(TrainInstruction(state, 0, 2).to_content()).extras == {}

    update = ClientUpdate("hospital-a", state, num_samples=12, reward=0.375,
                          metrics={"step_rewards": [0.25, math.nan], "train_loss": 0.1},
                          extras={"control_delta": control})
    received, client_index = content_to_update(update_to_content(update, client_index=2))
    assert (received.client_id, client_index, received.num_samples, received.reward) == ("hospital-a", 2, 12, 0.375)
    assert received.metrics["train_loss"] == 0.1 and received.metrics["step_rewards"][0] == 0.25
    assert math.isnan(received.metrics["step_rewards"][1])
    assert_states_equal(received.state, state)
    assert_states_equal(received.extras["control_delta"], control)


def test_a_reply_that_is_no_update_is_an_invalid_update():
    content = update_to_content(ClientUpdate("site", {"a": torch.zeros(2)}, 3, 0.5), client_index=0)
    del content["metrics"]
    with pytest.raises(InvalidUpdateError, match="client 'site' rejected: its reply lacks metrics"):
        content_to_update(content)
    with pytest.raises(InvalidUpdateError, match="The reply names no client"):
        content_to_update(RecordDict({"client": ConfigRecord({"client-id": "x"}), "arrays": content["arrays"]}))


def test_a_flowertune_style_reply_is_told_everything_it_must_add():
    # FlowerTune's ClientApp replies with the adapter and {"num-examples"} only: one refusal names all that is missing
    content = update_to_content(ClientUpdate("site", {"a": torch.zeros(2)}, 3, 0.5), client_index=0)
    reply = RecordDict({"arrays": content["arrays"], "metrics": MetricRecord({"num-examples": 3, "train_loss": 0.1})})
    with pytest.raises(InvalidUpdateError) as error:
        content_to_update(reply)
    message = str(error.value)
    assert "lacks metrics['reward'], a 'client' ConfigRecord ('client-id', 'client-index')" in message
    assert "make_client_app" in message and "FlowerTune" in message


# The strategy, with a grid that delivers messages in this process ------------------------------------------


@pytest.fixture
def task_identity(monkeypatch):
    """The identity Flower gives a ServerApp process, without which no `Message` can be created."""
    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)


class LocalGrid(Grid):
    """A `Grid` whose nodes answer in this process: `respond(message, context)` (e.g. a `ClientApp`) replies to
    every message, or returns None for a node that never replies."""

    def __init__(self, respond, node_configs, run_config=None):
        self.respond = respond
        self.contexts = {
            node_id: Context(run_id=1, node_id=node_id, node_config=config, state=RecordDict(),
                             run_config=run_config or {})
            for node_id, config in node_configs.items()
        }

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for message in messages:  # as Flower's grids do when they push a message
            message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
        replies = (self.respond(message, self.contexts[message.metadata.dst_node_id]) for message in messages)
        return [reply for reply in replies if reply is not None]

    # Unused by the strategy.
    def set_run(self, run):
        raise NotImplementedError

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        raise NotImplementedError

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError


class FakeClock:
    """The strategy module's `time` for a test: `sleep` advances `monotonic` instead of waiting, and is counted, so
    that any wait for SuperNodes is seen and no test waits on the wall clock."""

    def __init__(self):
        self.now, self.sleeps = 1000.0, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds

    time = staticmethod(time.time)  # the clock of Flower's message timestamps, left real


class LateGrid(LocalGrid):
    """A `LocalGrid` whose node `node_id` connects only once `clock` reaches `joins[node_id]`."""

    def __init__(self, respond, node_configs, clock, joins):
        super().__init__(respond, node_configs)
        self.clock, self.joins = clock, joins

    def get_node_ids(self):
        return [node_id for node_id in self.contexts if self.clock.now >= self.joins.get(node_id, -math.inf)]


def moved(state, seed, scale=0.01):
    generator = torch.Generator().manual_seed(seed)
    return {key: value + scale * torch.randn(value.shape, generator=generator) for key, value in state.items()}


def test_strategy_aggregates_exactly_like_the_aggregator_and_drops_faulty_clients(
    tmp_path, tiny_model_dir, fast_args, task_identity
):
    args = fast_args(num_clients=4, num_rounds=2, node_wait_timeout=0)
    strategy = FederatedStrategy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args,
                                 reply_timeout=5, report_header=None)
    reference_state = copy.deepcopy(strategy.global_state)
    reference = aggregator_from_config(args, 4)
    rewards = {0: [0.2, 0.6], 1: [0.5, 0.4], 2: [0.0, 0.0], 3: [0.3, 0.9]}

    def client(index, round_idx):
        return (
            f"site-{index}", moved(reference_state, seed=10 * round_idx + index), 10 + index, rewards[index][round_idx]
        )

    def respond(message, context):
        index = context.node_config["partition-id"]
        if message.metadata.message_type == IDENTIFY:  # as `make_client_app` answers it
            return Message(RecordDict({CLIENT: client_identity_record(f"site-{index}", index)}), reply_to=message)
        round_idx = TrainInstruction.from_content(message.content).round_idx
        client_id, state, num_samples, reward = client(index, round_idx)
        if index == 2:  # its ClientApp fails: an error reply, as `make_client_app` sends it
            report = {"client-id": client_id, "kind": "error", "reason": "RuntimeError: out of memory"}
            return Message(Error(code=2, reason=json.dumps(report)), reply_to=message)
        if index == 1 and round_idx == 0:  # a NaN in its adapter
            next(iter(state.values()))[0, 0] = math.nan
        update = ClientUpdate(client_id, state, num_samples, reward, metrics={"train_loss": 0.5})
        return Message(update_to_content(update, index), reply_to=message)

    for round_idx in range(2):
        # New node ids every round, and replies in another order: state is keyed by client id, order by index.
        grid = LocalGrid(respond, {100 * (round_idx + 1) + (3 - index): {"partition-id": index} for index in range(4)})
        messages = strategy.configure_train(round_idx + 1, None, None, grid)
        assert {message.metadata.dst_node_id for message in messages} == set(grid.contexts)
        arrays, metrics = strategy.aggregate_train(round_idx + 1, grid.send_and_receive(messages))

        accepted = [0, 3] if round_idx == 0 else [0, 1, 3]
        updates = [ClientUpdate(*client(index, round_idx)) for index in accepted]
        reference_state = reference.aggregate(reference_state, updates, round_idx)
        assert_states_equal(strategy.global_state, reference_state)
        assert_states_equal(array_record_to_state(arrays), reference_state)
        assert strategy.aggregator.last_weights == reference.last_weights
        # The round's log entry, as Flower's `start` logs it: each client's R̄, h, ω and bytes, τ, the totals.
        assert metrics["num_clients"] == len(accepted) and metrics["num_dropped"] == 4 - len(accepted)
        assert metrics["temperature"] == strategy.history[-1].temperature
        for index in accepted:
            assert metrics[f"site-{index}/weight"] == reference.last_weights[f"site-{index}"]
            assert metrics[f"site-{index}/reward_window"] == rewards[index][round_idx]

    assert strategy.aggregator.state_dict()["baselines"] == reference.state_dict()["baselines"]
    dropped = sorted((event["round_idx"], event["client_id"], event["kind"])
                     for event in events(args.output_dir, "client_dropped"))
    assert dropped == [(0, "site-1", "invalid_update"), (0, "site-2", "error"), (1, "site-2", "error")]
    assert "adapter[" in strategy.history[0].dropped["site-1"] and "holds NaN" in strategy.history[0].dropped["site-1"]
    assert strategy.history[1].dropped == {"site-2": "RuntimeError: out of memory"}
    checkpoint = read_checkpoint(list_checkpoints(args.output_dir)[-1])
    assert checkpoint.round_idx == 1
    assert_states_equal(checkpoint.global_state, reference_state)

    # A node that never identifies itself is sent nothing; one that stops replying is dropped as a timeout; too few
    # updates stop the run, the checkpoint intact.
    silent = LocalGrid(lambda message, context: None, {7: {"partition-id": 0}})
    with pytest.raises(NotEnoughClientsError,
                       match=r"Round 2: only 0 of the 4 sampled clients .* node-7: did not identify its client"):
        strategy.aggregate_train(3, silent.send_and_receive(strategy.configure_train(3, None, None, silent)))
    mute = LocalGrid(lambda message, context: respond(message, context) if message.metadata.message_type == IDENTIFY
                     else None, {8: {"partition-id": 0}})
    with pytest.raises(NotEnoughClientsError,
                       match=r"Round 2: only 0 of 1 clients .* site-0: no reply after 0 s \(reply timeout 5 s\)"):
        strategy.aggregate_train(3, mute.send_and_receive(strategy.configure_train(3, None, None, mute)))
    assert list_checkpoints(args.output_dir)[-1].name == "checkpoint-1"


# Whole federations in one process: the ClientApp and the strategy, against FederatedRunner -------------------


def prompt_datasets():
    return [Dataset.from_dict({"prompt": [f"Client {c} asks: what is {i} times {c}?" for i in range(6)]})
            for c in range(2)]


@pytest.fixture(scope="module")
def client_data_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("client-data")
    paths = []
    for index, dataset in enumerate(prompt_datasets()):
        dataset.save_to_disk(root / f"client_{index}")
        paths.append(str(root / f"client_{index}"))
    return paths


def runner_result(model_dir, output_dir, aggregation, num_rounds=2, **wire):
    """The in-process runner on the loopback app's settings: clients client_0, client_1 in this order."""
    run_config = {"aggregation": aggregation, "num-rounds": num_rounds, **wire}
    args = loopback_app.federation_args(str(output_dir), run_config)
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(model_dir), loopback_app.length_reward, args,
        dict(zip(["client_0", "client_1"], prompt_datasets())),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    runner.run()
    return runner


def local_federation(model_dir, data_dirs, output_dir, aggregation, node_ids=(11, 12), num_rounds=2, resume=False,
                     **wire):
    run_config = {"model-dir": str(model_dir), "output-dir": str(output_dir), "aggregation": aggregation,
                  "num-rounds": num_rounds, **wire}
    grid = LocalGrid(loopback_app.client_app,
                     {node_id: {"partition-id": index, "data-dir": data_dirs[index]}
                      for index, node_id in enumerate(node_ids)}, run_config)
    strategy = loopback_app.build_strategy(grid.contexts[node_ids[0]])
    strategy.args.resume_from_checkpoint = resume
    strategy.run(grid)
    return strategy


@pytest.mark.parametrize("aggregation, wire", [
    ("rpg", {}),
    ("scaffold", {}),
    ("fedavg", {"lora-aggregation": "freeze_a"}),  # A never travels: each side keeps its seeded copy
    ("rpg", {"transfer-dtype": "bfloat16"}),  # the clients send θ_i − θ in bfloat16
    # θ_i − θ in 4-bit codes and block scales; round 1's updates carry round 0's rounding, which each node keeps in
    # its context.state as the runner keeps it per client: the same bits either way
    ("fedavg", {"transfer-dtype": "nf4"}),
    # R̄ measured on each client's held-out slice: the ClientApp sets aside the rows the runner's client does
    ("rpg", {"rpg-signal": "held-out", "rpg-signal-items": 2}),
])
def test_flower_apps_in_one_process_end_where_the_runner_ends(
    tmp_path, tiny_model_dir, client_data_dirs, task_identity, aggregation, wire
):
    strategy = local_federation(tiny_model_dir, client_data_dirs, tmp_path / "flower", aggregation, **wire)
    runner = runner_result(tiny_model_dir, tmp_path / "runner", aggregation, **wire)
    assert_states_equal(strategy.global_state, runner.global_state)
    for field in ("weights", "rewards", "bytes_sent", "bytes_received"):  # the same traffic, counted the same way
        assert [getattr(record, field) for record in strategy.history] == [getattr(r, field) for r in runner.history]
    if "rpg-signal" in wire:  # both measured R̄ on the held-out slice
        assert all("signal_seconds" in metrics for record in (*strategy.history, *runner.history)
                   for metrics in record.client_metrics.values())
    if aggregation == "scaffold":  # c and c_i travel down with the adapter, Δc_i up with the update
        adapter = sum(value.numel() * value.element_size() for value in runner.global_state.values())
        assert runner.history[0].bytes_received == {"client_0": 3 * adapter, "client_1": 3 * adapter}
        assert runner.history[0].bytes_sent == {"client_0": 2 * adapter, "client_1": 2 * adapter}
        assert_states_equal(strategy.aggregator.control, runner.aggregator.control)
        for client_id in ("client_0", "client_1"):
            assert_states_equal(strategy.aggregator.client_controls[client_id],
                                runner.aggregator.client_controls[client_id])
    final = load_file(tmp_path / "flower" / "adapter_model.safetensors")
    assert_states_equal({key: final[key] for key in runner.global_state}, runner.global_state)
    # The Flower server writes what `trl-federated run` writes.
    for name in ("summary.md", "rewards.png", "weights.png", "result.json", "README.md", "metrics.jsonl"):
        assert (tmp_path / "flower" / name).is_file(), name
    result = json.loads((tmp_path / "flower" / "result.json").read_text())
    assert [r["weights"] for r in result["rounds"]] == [record.weights for record in runner.history]


def test_a_restarted_server_app_resumes_from_its_checkpoint(tmp_path, tiny_model_dir, client_data_dirs, task_identity):
    local_federation(tiny_model_dir, client_data_dirs, tmp_path / "flower", "rpg", num_rounds=1)
    # The ServerApp restarts with the full number of rounds; the SuperNodes come back with new node ids.
    resumed = local_federation(tiny_model_dir, client_data_dirs, tmp_path / "flower", "rpg", node_ids=(21, 22),
                               resume=True)
    runner = runner_result(tiny_model_dir, tmp_path / "runner", "rpg")
    assert [record.round_idx for record in resumed.history] == [0, 1]
    assert_states_equal(resumed.global_state, runner.global_state)
    assert [event["checkpoint_round"] for event in events(tmp_path / "flower", "resumed")] == [0]


def test_a_node_that_dies_mid_round_is_one_drop_of_its_own_client(tiny_model_dir, fast_args, task_identity):
    """The SuperLink answers for a SuperNode that stopped sending heartbeats, from its own node id: the reply still
    belongs to the client the message was sent to, and that client is dropped once, with Flower's reason and the
    elapsed time."""
    from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
    from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

    args = fast_args(num_clients=2, num_rounds=1, node_wait_timeout=0)
    strategy = FederatedStrategy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args, reply_timeout=5,
                                 report_header=None)

    def respond(message, context):
        index = context.node_config["partition-id"]
        if message.metadata.message_type == IDENTIFY:
            return Message(RecordDict({CLIENT: client_identity_record(f"client_{index}", index)}), reply_to=message)
        if index == 1:  # the SuperLink's own error reply, 54 s after the message was sent
            reply = create_message_error_unavailable_res_message(message.metadata, "node_unavail")
            assert reply.metadata.src_node_id == SUPERLINK_NODE_ID
            reply.metadata.created_at = message.metadata.created_at + 54.0
            return reply
        state = moved(TrainInstruction.from_content(message.content).global_state, seed=index)
        return Message(update_to_content(ClientUpdate(f"client_{index}", state, 8, 0.5), index), reply_to=message)

    grid = LocalGrid(respond, {21: {"partition-id": 0}, 22: {"partition-id": 1}})
    strategy.aggregate_train(1, grid.send_and_receive(strategy.configure_train(1, None, None, grid)))
    drops = events(args.output_dir, "client_dropped")
    assert [(drop["client_id"], drop["kind"]) for drop in drops] == [("client_1", "error")]
    assert drops[0]["reason"].startswith(
        f"Flower error {ErrorCode.NODE_UNAVAILABLE} after 54 s: Error: Node Unavailable"
    )
    assert set(strategy.history[0].weights) == {"client_0"} and set(strategy.history[0].dropped) == {"client_1"}


def test_the_client_app_trains_for_a_stock_flower_fedavg(tiny_model_dir, client_data_dirs, task_identity):
    """Flower's own `FedAvg` drives the ClientApp: its train message carries only "arrays" and "server-round"; the
    replies are what FedAvg averages (one ArrayRecord, one MetricRecord weighted by "num-examples")."""
    from flwr.serverapp.strategy import FedAvg

    from trl_federated.adapters import with_federated_adapter

    run_config = {"model-dir": str(tiny_model_dir), "aggregation": "fedavg", "num-rounds": 1}
    replies = []

    def respond(message, context):
        assert set(message.content.config_records["config"]) == {"server-round"}
        reply = loopback_app.client_app(message, context)
        replies.append(reply)
        return reply

    grid = LocalGrid(respond, {31 + index: {"partition-id": index, "data-dir": data_dir}
                               for index, data_dir in enumerate(client_data_dirs)}, run_config)
    initial = get_peft_model_state_dict(with_federated_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 0))
    result = FedAvg(fraction_evaluate=0.0).start(grid, state_to_array_record(initial), num_rounds=1)

    assert len(replies) == 2 and not any(reply.has_error() for reply in replies)
    updates = [content_to_update(reply.content)[0] for reply in replies]
    assert sorted(update.client_id for update in updates) == ["client_0", "client_1"]
    total = sum(update.num_samples for update in updates)
    averaged = array_record_to_state(result.arrays)
    assert set(averaged) == set(initial)
    for key in initial:
        expected = sum(update.state[key] * (update.num_samples / total) for update in updates)
        torch.testing.assert_close(averaged[key], expected)
        assert not torch.equal(averaged[key], initial[key]) or "lora_B" not in key
    assert all(update.metrics["step_rewards"] and math.isfinite(update.reward) for update in updates)


def test_the_client_app_turns_grpos_speedups_off_for_an_rloo_trainer_with_one_notice(
    tmp_path, tiny_model_dir, client_data_dirs, task_identity, caplog
):
    """A site config written for GRPO (the example app's `shared-prefix`, `fast-generation`) under `RLOOTrainer`:
    the ClientApp turns both off with `trl-federated run`'s one notice and trains, where every round failed."""
    from datasets import load_from_disk
    from trl import RLOOConfig, RLOOTrainer

    from trl_federated.adapters import with_federated_adapter
    from trl_federated.config import federated_config
    from trl_federated.flower import ClientSite, make_client_app

    args = federated_config(RLOOConfig)(
        **loopback_app.SETTINGS | {"num_clients": 1, "local_steps": 1, "reward_window": 1},
        output_dir=str(tmp_path / "site"), shared_prefix=True, fast_generation=True,
    )
    model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args.seed)
    site = ClientSite(model, AutoTokenizer.from_pretrained(tiny_model_dir), loopback_app.length_reward,
                      load_from_disk(client_data_dirs[0]), args)
    app = make_client_app(lambda context: site, trainer_class=RLOOTrainer)
    content = RecordDict({"arrays": state_to_array_record(get_peft_model_state_dict(model)),
                          "config": ConfigRecord({"server-round": 1})})
    message = Message(content, dst_node_id=31, message_type=MessageType.TRAIN)
    message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
    context = Context(run_id=1, node_id=31, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    with caplog.at_level(logging.INFO, logger="trl_federated"):
        reply = app(message, context)
    assert not reply.has_error(), reply.error.reason
    assert (args.shared_prefix, args.fast_generation) == (False, False)
    notices = [record.getMessage() for record in caplog.records if "turned off" in record.getMessage()]
    assert notices == ["`shared_prefix`, `fast_generation` turned off: they speed up `trl.GRPOTrainer`'s private "
                       "methods, which trl.trainer.rloo_trainer.RLOOTrainer does not have; it trains without them."]


def test_the_strategy_runs_inside_a_server_app_of_ones_own(tmp_path, tiny_model_dir, client_data_dirs, task_identity):
    """`FederatedStrategy.start(grid, initial_arrays, ...)` as a user's ServerApp calls it: the federation starts
    from `initial_arrays`, the run's outputs are written, the `Result` holds the final adapter and the rounds."""
    run_config = {"model-dir": str(tiny_model_dir), "output-dir": str(tmp_path / "own"), "aggregation": "rpg",
                  "num-rounds": 1}
    grid = LocalGrid(loopback_app.client_app,
                     {41 + index: {"partition-id": index, "data-dir": data_dir}
                      for index, data_dir in enumerate(client_data_dirs)}, run_config)
    strategy = loopback_app.build_strategy(grid.contexts[41])
    start = moved(strategy.global_state, seed=7)
    with pytest.raises(ValueError, match=r"num_rounds=3, but the federation's FedGRPOConfig.num_rounds is 1"):
        strategy.start(grid, state_to_array_record(start), num_rounds=3)
    strategy.args.beta = 0.04  # the ClientApps' KL reference is their own seeded adapter, not `start`
    with pytest.raises(ValueError, match=r"`initial_arrays` differ from the seeded adapter, but beta != 0"):
        strategy.start(grid, state_to_array_record(start))
    strategy.args.beta = 0.0

    sent = []
    original = grid.send_and_receive

    def recording(messages, *, timeout=None):
        messages = list(messages)
        sent.extend(messages)
        return original(messages, timeout=timeout)

    grid.send_and_receive = recording
    result = strategy.start(grid, state_to_array_record(start), num_rounds=1, train_config=ConfigRecord({"note": 1}))
    train = [message for message in sent if message.metadata.message_type == MessageType.TRAIN]
    assert len(train) == 2 and all(message.content["config"]["note"] == 1 for message in train)
    assert_states_equal(TrainInstruction.from_content(train[0].content).global_state, start)
    assert_states_equal(array_record_to_state(result.arrays), strategy.global_state)
    assert result.train_metrics_clientapp[1]["num_clients"] == 2
    assert (tmp_path / "own" / "result.json").is_file() and (tmp_path / "own" / "summary.md").is_file()


def test_package_info_logs_reach_flowers_console_in_an_app_process(monkeypatch):
    """In a ServerApp or ClientApp process nothing configures Python logging: the package's INFO lines (a round's
    summary, the wait for SuperNodes) went nowhere; `show_package_logs` hands them to Flower's console handler,
    whose output Flower streams. An application that configured logging keeps its own."""
    import logging

    from flwr.common.logger import console_handler

    from trl_federated.flower.stream import show_package_logs

    package, root = logging.getLogger("trl_federated"), logging.getLogger()
    console = io.StringIO()
    monkeypatch.setattr(console_handler, "stream", console)
    monkeypatch.setattr(package, "handlers", [])
    monkeypatch.setattr(package, "level", logging.NOTSET)
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])  # an application's own configuration
    show_package_logs()
    assert package.handlers == []
    monkeypatch.setattr(root, "handlers", [])  # an app process: nothing configured
    show_package_logs()
    show_package_logs()  # once only
    logging.getLogger("trl_federated.core.server").info("Round 1/2: 2 clients aggregated")
    logging.getLogger("other").info("not shown")
    assert console.getvalue().count("Round 1/2: 2 clients aggregated") == 1 and "not shown" not in console.getvalue()


# The real thing: a SuperLink and two SuperNodes as processes on 127.0.0.1 -----------------------------------


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Processes:
    """Background processes, each in its own process group, stopped with SIGTERM and then SIGKILL."""

    def __init__(self, env, log_dir):
        self.env, self.log_dir, self.started = env, log_dir, []

    def start(self, name, *command):
        log = open(self.log_dir / f"{name}.log", "w")
        process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append((process, log))
        return process

    def stop(self):
        for process, _ in self.started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process, log in self.started:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            log.close()


def wait_for_port(port, process, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the SuperLink exited"
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


class Loopback:
    """A SuperLink and one SuperNode per client dataset as processes on 127.0.0.1 (insecure), and `flwr run` of
    tests/flower_app on them; `stop()` ends them all."""

    def __init__(self, tmp_path, data_dirs):
        self.bin_dir = Path(sys.executable).parent  # flower-superlink, flower-supernode, flwr and what they start
        self.tmp_path = tmp_path
        flwr_home = tmp_path / "flwr-home"
        flwr_home.mkdir()
        link_port = free_port()
        (flwr_home / "config.toml").write_text(
            f'[superlink.loopback]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n', encoding="utf-8"
        )
        self.env = {
            **os.environ,
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ['PATH']}",
            "FLWR_HOME": str(flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            # The ClientApps import this checkout's trl_federated, and compute with one thread, as this process does.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        self.processes = Processes(self.env, tmp_path)
        superlink = self.processes.start(
            "superlink", str(self.bin_dir / "flower-superlink"), "--insecure",
            "--disable-runtime-dependency-installation", "--database", str(tmp_path / "state.db"),
            "--port", str(link_port),
        )
        wait_for_port(link_port, superlink)
        self.supernodes = [
            self.processes.start(
                f"supernode-{index}", str(self.bin_dir / "flower-supernode"), "--insecure",
                "--superlink", f"127.0.0.1:{link_port}", "--port", str(free_port()),
                "--node-config", f"partition-id={index} data-dir='{data_dir}'",
            )
            for index, data_dir in enumerate(data_dirs)
        ]

    def flwr_run(self, run_config: str) -> subprocess.Popen:
        return subprocess.Popen(
            [str(self.bin_dir / "flwr"), "run", str(APP_DIR), "loopback", "--stream", "--run-config", run_config],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text()

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}" for path in self.tmp_path.glob("*.log"))

    def stop(self):
        self.processes.stop()


@pytest.mark.slow  # 60-90 s on 2 CPU cores: every round starts a fresh ClientApp process per SuperNode
def test_loopback_superlink_and_two_supernodes_end_where_the_runner_ends(tmp_path, tiny_model_dir, client_data_dirs):
    """`flwr run` of tests/flower_app on a real SuperLink and two SuperNodes (insecure, 127.0.0.1), 2 rounds of
    FGRPO on the tiny model; the final global adapter equals FederatedRunner's for the same seeds and data, and
    the stream and each SuperNode's log show the rounds."""
    output_dir = tmp_path / "flower"
    started = time.perf_counter()
    loopback = Loopback(tmp_path, client_data_dirs)
    try:
        run = loopback.flwr_run(
            f"model-dir='{tiny_model_dir}' output-dir='{output_dir}' aggregation='rpg' num-rounds=2"
        )
        stream, _ = run.communicate(timeout=400)
    finally:
        loopback.stop()
    wall_time = time.perf_counter() - started
    assert (output_dir / "adapter_model.safetensors").exists(), f"{stream[-3000:]}\n{loopback.logs()}"
    print(f"loopback Flower run: {wall_time:.1f} s from SuperLink start to stop")

    runner = runner_result(tiny_model_dir, tmp_path / "runner", "rpg")
    flower_state = load_file(output_dir / "adapter_model.safetensors")
    assert_states_equal({key: flower_state[key] for key in runner.global_state}, runner.global_state)
    rounds = events(output_dir, "round")
    assert [line["round_idx"] for line in rounds] == [0, 1]
    assert [line["weights"] for line in rounds] == [record.weights for record in runner.history]
    assert [line["client_id"] for line in events(output_dir, "client")] == ["client_0", "client_1"] * 2
    assert (output_dir / "checkpoint-1").is_dir() and (output_dir / "round-0" / "adapter_model.safetensors").exists()
    for name in ("summary.md", "result.json", "rewards.png", "weights.png"):
        assert (output_dir / name).is_file(), name
    # The stream shows the package's INFO lines: the strategy, and each round's R̄, h, ω, τ and traffic.
    assert "FederatedStrategy: RPGAggregator, 2 clients" in stream, stream[-3000:]
    for round_idx, record in enumerate(runner.history):
        # round t, then its position as Flower's own [ROUND k/T] lines count
        assert (f"Round {round_idx} ({round_idx + 1}/2): 2 clients aggregated, 0 dropped, "
                f"τ = {record.temperature:.3f}") in stream
        for client_id, reward in record.rewards.items():
            # R̄ and h, the round's per-client diagnostics (se(R̄), zero-signal, idle), then ω and ‖u‖, on one line
            head = re.escape(f"{client_id}: R̄ = {reward:.4f}, h = {record.gains[client_id]:+.4f}, ")
            tail = re.escape(f"ω = {record.weights[client_id]:.4f}, ‖u‖ = {record.update_norms[client_id]:.3g}")
            assert re.search(f"{head}[^\n]*{tail}", stream), stream[-3000:]
            assert f"sent {record.bytes_sent[client_id]:,} B" in stream
    # Each SuperNode's log shows its own local rounds.
    for index in (0, 1):
        log = loopback.log(f"supernode-{index}")
        for round_idx in (0, 1):
            # Numbered as the server's lines number it, beside Flower's [ROUND k/T].
            assert (f"Round {round_idx} ({round_idx + 1}/2), client 'client_{index}': 2 local steps on 6 rows, R̄ = "
                    in log), log[-3000:]


@pytest.mark.slow  # ~2 min: the SuperLink declares a silent SuperNode unavailable after 2 heartbeat intervals (60 s)
def test_loopback_supernode_killed_mid_round_is_one_drop_line(tmp_path, tiny_model_dir, client_data_dirs):
    """A SuperNode SIGKILLed while its ClientApp trains: the SuperLink answers for it, and metrics.jsonl records one
    `client_dropped` line naming its client, Flower's reason and the elapsed time; the round aggregates the other."""
    output_dir = tmp_path / "flower"
    loopback = Loopback(tmp_path, client_data_dirs)
    try:
        run = loopback.flwr_run(
            f"model-dir='{tiny_model_dir}' output-dir='{output_dir}' aggregation='rpg' num-rounds=1"
        )
        deadline = time.monotonic() + 180
        while "Receiving: train message" not in loopback.log("supernode-1"):
            assert run.poll() is None and time.monotonic() < deadline, loopback.logs()
            time.sleep(0.2)
        os.killpg(loopback.supernodes[1].pid, signal.SIGKILL)
        stream, _ = run.communicate(timeout=400)
    finally:
        loopback.stop()
    assert (output_dir / "adapter_model.safetensors").exists(), f"{stream[-3000:]}\n{loopback.logs()}"
    drops = events(output_dir, "client_dropped")
    assert [(drop["round_idx"], drop["client_id"], drop["kind"]) for drop in drops] == [(0, "client_1", "error")], drops
    assert re.fullmatch(r"Flower error 5 after \d+ s: Error: Node Unavailable .*", drops[0]["reason"]), drops[0]
    assert [line["weights"] for line in events(output_dir, "round")] == [{"client_0": 1.0}]
    assert "client 'client_1' dropped (error): Flower error 5 after" in stream


# A hostile participant: every reply goes through one guarded path ---------------------------------------------


def npy_bytes(values, **kwargs):
    buffer = io.BytesIO()
    np.save(buffer, values, **kwargs)
    return buffer.getvalue()


def fuzz_content(rng, content, global_state):
    """A random fault in a valid reply's records (arrays, identity, metrics), or None for a valid reply; faults 7
    and 8 may draw valid values (a sample count the server caps, R̄ = 1e9 without a declared reward range)."""
    fault = rng.randrange(14)
    key = rng.choice(list(global_state))
    arrays = content["arrays"]
    shape, dtype = tuple(global_state[key].shape), "float32"
    if fault == 0:  # random bytes, with or without a valid magic string
        data = rng.choice([b"", b"\x93NUMPY"]) + rng.randbytes(rng.randrange(0, 300))
        arrays[key] = Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)
    elif fault == 1:  # truncated, or a header that claims more than it carries
        data = arrays[key].data if rng.random() < 0.5 else npy_bytes(np.zeros((4096, 4096), np.float32))
        arrays[key] = Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data[: rng.randrange(0, 400)])
    elif fault == 2:  # oversized: another shape, with all its data
        arrays[key] = Array(np.zeros((rng.randrange(1, 600), rng.randrange(1, 600)), np.float32))
    elif fault == 3:  # dtypes: what torch cannot hold, and what the adapter is not
        values = np.zeros(shape)
        choices = [values.astype(t) for t in (np.float16, np.float64, np.int64, np.bool_, np.complex64, np.uint16,
                                                "<U3", "datetime64[s]")]
        arrays[key] = Array(rng.choice(choices))
    elif fault == 4:  # pickled objects, Fortran order, a lying record header
        data = rng.choice([npy_bytes(np.array([{"x": 1}] * 4, dtype=object), allow_pickle=True),
                           npy_bytes(np.asfortranarray(np.zeros(shape + (2,), np.float32)))])
        arrays[key] = Array(dtype=rng.choice(["float32", "object", "bfloat16"]), shape=rng.choice([shape, (1,)]),
                            stype=rng.choice(["numpy.ndarray", "torch"]), data=data)
    elif fault == 5:  # entries missing or extra
        if rng.random() < 0.5:
            del arrays[key]
        else:
            arrays[rng.choice(["extra", key + "x"])] = Array(np.zeros(3, np.float32))
    elif fault == 6:  # whole records missing or of the wrong kind
        name = rng.choice(["arrays", "metrics", "client"])
        del content[name]
        if rng.random() < 0.5:
            content[name] = rng.choice([ConfigRecord({"x": 1}), MetricRecord({"x": 1.0}), ArrayRecord()])
    elif fault == 7:  # wrong types in every identity field
        content["client"] = ConfigRecord({
            "client-id": rng.choice([5, 1.5, b"site-2", True, "", "x" * 10_000, "site-2"]),
            "client-index": rng.choice([2, "2", 2.0, True, -1, 99, 2**64]),
        })
    elif fault == 8:  # and in every metric
        metrics = content["metrics"]
        name = rng.choice(["num-examples", "reward"])
        metrics[name] = rng.choice([1.5, -1, 0, 2**62, 2**64, [], [1, 2], math.nan, math.inf, -math.inf, 1e308, 10**9])
    elif fault == 9:  # speaking for another client
        content["client"] = client_identity_record(*rng.choice([("site-0", 0), ("site-2", 0), ("site-0", 2)]))
    elif fault == 10:  # a SCAFFOLD control variate nobody asked for, well-formed or not
        content["extra/control_delta"] = rng.choice([state_to_array_record(global_state), ArrayRecord()])
    elif fault == 11:  # poison: finite, scaled or huge
        arrays[key] = Array((global_state[key] * rng.choice([1e6, -1e30, 3e38])).numpy())
    else:
        return None
    return fault


def fuzz_error(rng):
    report = rng.choice([
        "not json", "", "[1, 2]", "null", '"text"', "{" * 100_000,
        json.dumps({"client-id": rng.choice([5, None, ["site-0"], "site-0"]), "kind": "error", "reason": "boom"}),
        json.dumps({"client-id": "site-2", "kind": rng.choice(["invalid_update", 5, None]), "reason": rng.choice([
            "x" * 100_000, 5, None])}),
    ])
    return Error(code=rng.choice([0, 2, -1]), reason=report)


def test_fuzz_replies_never_raise_out_of_the_strategy(tiny_model_dir, fast_args, task_identity):
    """Garbage arrays, lying headers, wrong dtypes, wrong types in every metadata field, error reports of every
    shape, impersonation, poison, duplicate, late and unasked replies: a client's bad reply is that client's
    `invalid_update` (or error), the honest clients' updates are aggregated, the server state stays finite."""
    args = fast_args(num_clients=3, num_rounds=1000, save_every_round=False, save_total_limit=1, node_wait_timeout=0,
                     server_optimizer="adam")  # Adam's v: the server state a hostile reply could poison
    strategy = FederatedStrategy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args,
                                 reply_timeout=5, report_header=None)
    rng = random.Random(0)
    nodes = {11: 0, 12: 1, 13: 2}  # node 13 serves site-2, the hostile one

    def respond(message, context):
        index = context.node_config["partition-id"]
        if message.metadata.message_type == IDENTIFY:
            return Message(RecordDict({CLIENT: client_identity_record(f"site-{index}", index)}), reply_to=message)
        instruction = TrainInstruction.from_content(message.content)
        update = ClientUpdate(f"site-{index}", moved(instruction.global_state, seed=index), 8, 0.5 + 0.1 * index)
        return Message(update_to_content(update, index), reply_to=message)

    grid = LocalGrid(respond, {node_id: {"partition-id": index} for node_id, index in nodes.items()})
    faults = {}
    for server_round in range(1, 101):
        messages = list(strategy.configure_train(server_round, None, None, grid))
        assert {message.metadata.dst_node_id for message in messages} == set(nodes)
        replies = grid.send_and_receive(messages)
        hostile = next(reply for reply in replies if reply.metadata.src_node_id == 13)
        if rng.random() < 0.15:
            replies.remove(hostile)
            replies.append(Message(fuzz_error(rng), reply_to=next(m for m in messages if m.metadata.dst_node_id == 13)))
            fault = "error"
        else:
            fault = fuzz_content(rng, hostile.content, strategy.global_state)
        extra = rng.randrange(4)
        if extra == 1:  # a reply delivered twice (only its node can send it: Flower authenticates the source)
            replies.append(copy.deepcopy(rng.choice(replies)))
        elif extra == 2:  # a late reply, to the previous round
            late = respond(messages[1], grid.contexts[messages[1].metadata.dst_node_id])
            late.metadata.group_id = str(server_round - 2)
            replies.insert(0, late)
        elif extra == 3:  # a reply from a node that was never asked
            stranger = Message(RecordDict(), dst_node_id=99, message_type=MessageType.TRAIN,
                               group_id=str(server_round - 1))
            replies.append(Message(update_to_content(ClientUpdate("site-0", strategy.global_state, 8, 0.9), 0),
                                   reply_to=stranger))
        rng.shuffle(replies)

        strategy.aggregate_train(server_round, replies)  # never raises
        record = strategy.history[-1]
        assert {"site-0", "site-1"} <= set(record.weights), (server_round, fault, record.dropped)
        assert record.num_samples["site-0"] == 8
        if fault in (7, 8) and "site-2" in record.weights:  # valid values, bounded by the server
            assert record.num_samples["site-2"] <= args.max_client_samples and math.isfinite(record.rewards["site-2"])
            assert abs(record.gains["site-2"]) <= args.rpg_h_max
        elif fault is not None:
            assert "site-2" in record.dropped and "site-2" not in record.weights, (server_round, fault)
        else:
            assert "site-2" in record.weights and not record.dropped
        assert set(record.dropped) <= {"site-2"}
        faults[fault] = faults.get(fault, 0) + 1
        assert all(torch.isfinite(value).all() for value in strategy.global_state.values())
    assert all(torch.isfinite(value).all() for value in strategy.aggregator.server_optimizer.v.values())
    assert set(faults) == {*range(12), None, "error"}, faults
    kinds = {(e["client_id"], e["kind"]) for e in events(args.output_dir, "client_dropped")}
    assert kinds == {("site-2", "invalid_update"), ("site-2", "error")}


# Identity: the server maps nodes to clients; a reply never speaks for another client ---------------------------


class KeyedGrid(LocalGrid):
    """A `LocalGrid` whose nodes hold SuperNode public keys (PEM, as the SuperLink reports them)."""

    def __init__(self, respond, node_configs, keys):
        super().__init__(respond, node_configs)
        self.keys = keys

    def get_nodes(self):
        from flwr.proto.node_pb2 import NodeInfo

        return [NodeInfo(node_id=node_id, public_key=self.keys.get(node_id, b"")) for node_id in self.contexts]


def ec_key_pair():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    public = ec.generate_private_key(ec.SECP384R1()).public_key()
    pem = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    openssh = public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return pem, openssh


def scaffold_reply(message, client_id, index, num_samples=8, reward=0.5):
    instruction = TrainInstruction.from_content(message.content)
    control = {key: torch.zeros_like(value) for key, value in instruction.global_state.items()}
    update = ClientUpdate(client_id, moved(instruction.global_state, seed=index), num_samples, reward,
                          extras={"control_delta": control})
    return Message(update_to_content(update, index), reply_to=message)


def test_a_registry_maps_nodes_to_clients_by_their_public_keys(tmp_path, tiny_model_dir, fast_args, task_identity):
    from trl_federated.flower.identity import ClientRegistry

    (a_pem, a_ssh), (b_pem, b_ssh), (c_pem, c_ssh), (x_pem, _) = (ec_key_pair() for _ in range(4))
    for name, key in (("a", a_ssh), ("b", b_ssh)):
        (tmp_path / f"hospital-{name}.pub").write_bytes(key)
    (tmp_path / "clients.json").write_text(json.dumps({"clients": [
        {"client-id": "hospital-a", "public-key": "hospital-a.pub", "num-samples": 10},
        {"client-id": "hospital-b", "public-key": "hospital-b.pub", "num-samples": 30},
        {"client-id": "hospital-c", "public-key": c_pem.decode()},
    ]}))
    registry = ClientRegistry.from_file(tmp_path / "clients.json")
    args = fast_args(num_clients=3, aggregation="scaffold", node_wait_timeout=0)
    strategy = FederatedStrategy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args, reply_timeout=5,
                                 registry=registry, report_header=None)
    marked = {key: torch.full_like(value, 7.0) for key, value in strategy.global_state.items()}
    strategy.aggregator.client_controls["hospital-a"] = marked  # SCAFFOLD's c_i: only hospital-a's node may receive it

    def respond(message, context):
        assert message.metadata.message_type == MessageType.TRAIN, "a registry never asks a node who it is"
        node_id = message.metadata.dst_node_id
        if node_id == 11:  # hospital-a, honest, but claims 2**40 training rows
            return scaffold_reply(message, "hospital-a", 0, num_samples=2**40)
        if node_id == 12:  # hospital-b speaks for hospital-a
            return scaffold_reply(message, "hospital-a", 0)
        report = {"client-id": "hospital-a", "kind": "error", "reason": "RuntimeError: boom"}  # hospital-c blames a
        return Message(Error(code=2, reason=json.dumps(report)), reply_to=message)

    # node 14 holds an unregistered key and claims hospital-b in its node config; node 15 holds no key at all
    grid = KeyedGrid(respond, {node_id: {"partition-id": 1} for node_id in (11, 12, 13, 14, 15)},
                     {11: a_pem, 12: b_pem, 13: c_pem, 14: x_pem})
    messages = list(strategy.configure_train(1, None, None, grid))
    assert {message.metadata.dst_node_id for message in messages} == {11, 12, 13}
    sent_to_a = next(m for m in messages if m.metadata.dst_node_id == 11)
    assert_states_equal(TrainInstruction.from_content(sent_to_a.content).extras["client_control"], marked)
    for message in messages:
        if message.metadata.dst_node_id != 11:
            assert not any(value.eq(7.0).any() for value in
                           TrainInstruction.from_content(message.content).extras["client_control"].values())

    strategy.aggregate_train(1, grid.send_and_receive(messages))
    record = strategy.history[-1]
    assert set(record.weights) == {"hospital-a"} and record.num_samples == {"hospital-a": 10}  # the registered count
    assert "rejected: it speaks for client 'hospital-a' at index 0" in record.dropped["hospital-b"]
    assert record.dropped["hospital-c"] == "RuntimeError: boom (the report names client 'hospital-a')"
    assert (record.dropped["node-14"] == record.dropped["node-15"]
            == "its public key is not registered for this federation")
    kinds = {(e["client_id"], e["kind"]) for e in events(args.output_dir, "client_dropped")}
    assert kinds == {("hospital-b", "invalid_update"), ("hospital-c", "error")}


def test_without_a_registry_a_claim_is_trusted_once_and_never_taken_over(tiny_model_dir, fast_args, task_identity):
    args = fast_args(num_clients=3, aggregation="scaffold", node_wait_timeout=0)
    strategy = FederatedStrategy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args, reply_timeout=5,
                                 report_header=None)
    marked = {key: torch.full_like(value, 7.0) for key, value in strategy.global_state.items()}
    strategy.aggregator.client_controls["client_2"] = marked

    def respond(message, context):
        index = context.node_config["partition-id"]
        if message.metadata.message_type == IDENTIFY:
            return Message(RecordDict({CLIENT: client_identity_record(f"client_{index}", index)}), reply_to=message)
        if message.metadata.dst_node_id == 22:  # client_1 fails and blames client_0
            report = {"client-id": "client_0", "kind": "timeout", "reason": "client 'client_0' took too long"}
            return Message(Error(code=2, reason=json.dumps(report)), reply_to=message)
        return scaffold_reply(message, f"client_{index}", index)

    # node 24 claims an index beyond num_clients; node 25 claims client_2, which node 23 already serves
    configs = {21: {"partition-id": 0}, 22: {"partition-id": 1}, 23: {"partition-id": 2}, 24: {"partition-id": 5},
               25: {"partition-id": 2}}
    keys = {node_id: ec_key_pair()[0] for node_id in configs}
    grid = KeyedGrid(respond, configs, keys)
    messages = list(strategy.configure_train(1, None, None, grid))
    assert {message.metadata.dst_node_id for message in messages} == {21, 22, 23}
    strategy.aggregate_train(1, grid.send_and_receive(messages))
    record = strategy.history[-1]
    assert "outside the federation's [0, 3)" in record.dropped["node-24"]
    assert record.dropped["node-25"] == "claims client 'client_2', which connected node 23 already serves"
    assert set(record.weights) == {"client_0", "client_2"}
    assert record.dropped["client_1"] == "client 'client_0' took too long (the report names client 'client_0')"

    # node 23 leaves: the impostor, node 25, still cannot take client_2 over; node 23 restarted as node 26 with its
    # own key (`--auth-supernode-private-key`) gets it back, with its c_i
    del configs[23]
    configs[26] = {"partition-id": 2}
    keys[26] = keys[23]
    grid = KeyedGrid(respond, configs, keys)
    messages = list(strategy.configure_train(2, None, None, grid))
    assert {message.metadata.dst_node_id for message in messages} == {21, 22, 26}
    sent = next(m for m in messages if m.metadata.dst_node_id == 26)
    assert_states_equal(TrainInstruction.from_content(sent.content).extras["client_control"], marked)
    strategy.aggregate_train(2, grid.send_and_receive(messages))
    assert "a node with another public key served first" in strategy.history[-1].dropped["node-25"]


def test_a_refused_node_serves_no_client_so_the_round_waits_and_it_is_refused_once(
    tiny_model_dir, fast_args, task_identity, monkeypatch, caplog
):
    """Without a registry, 3 connected nodes need not serve the 3 clients: node 25 claims client_1, which node 22
    serves, so client_2 has no node and the round waits for it (a server counting connected nodes started at once);
    the wait asks node 25 once and refuses it once, however often it polls."""
    args = fast_args(num_clients=3, aggregation="fedavg", node_wait_timeout=3600)
    strategy = FederatedStrategy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args, reply_timeout=5,
                                 report_header=None)
    clock = FakeClock()
    monkeypatch.setattr("trl_federated.flower.strategy.time", clock)
    asked = []

    def respond(message, context):
        assert message.metadata.message_type == IDENTIFY
        asked.append(message.metadata.dst_node_id)
        index = context.node_config["partition-id"]
        return Message(RecordDict({CLIENT: client_identity_record(f"client_{index}", index)}), reply_to=message)

    # node 23, client_2's, connects 30 s into the round
    configs = {21: {"partition-id": 0}, 22: {"partition-id": 1}, 25: {"partition-id": 1}, 23: {"partition-id": 2}}
    grid = LateGrid(respond, configs, clock, joins={23: clock.now + 30})
    with caplog.at_level(logging.INFO, logger="trl_federated"):
        messages = strategy.configure_train(1, None, None, grid)
    assert sorted(message.metadata.dst_node_id for message in messages) == [21, 22, 23]
    assert sum(clock.sleeps) == 30 and len(clock.sleeps) > 1  # polled until client_2 was served, no longer
    assert sorted(asked) == [21, 22, 23, 25]  # each node asked once
    assert caplog.text.count("node-25 is sent no training message") == 1
    assert "no connected SuperNode serves the sampled client indices [2] yet; waiting up to 3600 s" in caplog.text


@pytest.mark.parametrize("attack, reason", [
    ("garbage npy", r"cannot be decoded: the magic string is not correct"),
    ("header claims more", r"cannot be decoded: header declares shape \(4096, 4096\) of float32 \(67108864 bytes\), "
                           r"but \d+ bytes follow"),
    ("dtype torch cannot hold", r"cannot be decoded: dtype <U5 is not a plain numeric dtype"),
    ("error report names no string", r"RuntimeError: out of memory \(the report names client \['site-0'\]\)"),
])
def test_each_malformed_reply_of_the_issue_drops_only_its_client(tiny_model_dir, fast_args, task_identity, attack,
                                                                 reason):
    """Each of these raised out of `aggregate_train` and stopped the ServerApp, every round the client repeated it."""
    args = fast_args(num_clients=2, num_rounds=2, node_wait_timeout=0)
    strategy = FederatedStrategy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args, reply_timeout=5,
                                 report_header=None)

    def respond(message, context):
        index = context.node_config["partition-id"]
        if message.metadata.message_type == IDENTIFY:
            return Message(RecordDict({CLIENT: client_identity_record(f"site-{index}", index)}), reply_to=message)
        state = moved(TrainInstruction.from_content(message.content).global_state, seed=index)
        content = update_to_content(ClientUpdate(f"site-{index}", state, 8, 0.5), index)
        if index == 1:
            key = next(iter(state))
            if attack == "garbage npy":
                content["arrays"][key] = Array(dtype="float32", shape=tuple(state[key].shape), stype="numpy.ndarray",
                                               data=b"\x00garbage" * 5)
            elif attack == "header claims more":
                data = npy_bytes(np.zeros((4096, 4096), np.float32))[:300]
                content["arrays"][key] = Array(dtype="float32", shape=(4096, 4096), stype="numpy.ndarray", data=data)
            elif attack == "dtype torch cannot hold":
                content["arrays"][key] = Array(np.full(tuple(state[key].shape), "hello"))
            else:
                report = {"client-id": ["site-0"], "kind": "error", "reason": "RuntimeError: out of memory"}
                return Message(Error(code=2, reason=json.dumps(report)), reply_to=message)
        return Message(content, reply_to=message)

    grid = LocalGrid(respond, {11: {"partition-id": 0}, 12: {"partition-id": 1}})
    for server_round in (1, 2):  # repeated every round: the run goes on
        strategy.aggregate_train(
            server_round, grid.send_and_receive(strategy.configure_train(server_round, None, None, grid))
        )
        record = strategy.history[-1]
        assert set(record.weights) == {"site-0"} and set(record.dropped) == {"site-1"}
        assert re.search(reason, record.dropped["site-1"]), record.dropped["site-1"]
