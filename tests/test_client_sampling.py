"""Client sampling per round (`fraction_train`, `min_train_clients`, as Flower's strategies take them): the sampled
sets, the runner and the Flower strategy training the same clients, the per-client state of a client that sits a
round out (RPG's φ and σ, SCAFFOLD's c_i) left as it was, and a resumed run that samples what the uninterrupted one
did. Each test fails on a tree without client sampling."""

import copy
import json
import logging
import statistics
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from flwr.app import Message, RecordDict
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import FAST_GRPO, length_reward
from test_flower import (  # noqa: F401
    FakeClock,
    LocalGrid,
    assert_states_equal,
    client_data_dirs,
    events,
    local_federation,
    loopback_app,
    moved,
    runner_result,
    task_identity,
)
from trl_federated import ClientUpdate, FederatedRunner, FedGRPOConfig, RoundCallback
from trl_federated.adapters import with_federated_adapter
from trl_federated.core.callbacks import round_logs
from trl_federated.flower import FederatedStrategy, TrainInstruction, update_to_content
from trl_federated.flower.records import CLIENT, client_identity_record
from trl_federated.flower.strategy import IDENTIFY
from trl_federated.runner import NotEnoughClientsError

# 4 clients, half of them a round: with seed 0 rounds 0-2 sample [0, 1], [1, 3], [0, 3] (pinned below), so client 3
# first trains in round 1, client 0 sits out round 1 and client 1 round 2, client 2 every round.
NUM_CLIENTS, FRACTION, SEED, NUM_ROUNDS = 4, 0.5, 0, 3
SAMPLED = [[0, 1], [1, 3], [0, 3]]
CLIENT_IDS = [f"site-{index}" for index in range(NUM_CLIENTS)]


def sampling_args(output_dir, **overrides):
    values = {
        **FAST_GRPO,
        "num_rounds": NUM_ROUNDS,
        "local_steps": 1,
        "reward_window": 1,
        "seed": SEED,
        "fraction_train": FRACTION,
        **overrides,
    }
    return FedGRPOConfig(output_dir=str(output_dir), **values)


def client_datasets():
    return {
        client_id: Dataset.from_dict({"prompt": [f"{client_id} asks: what is {i} plus {i}?" for i in range(6)]})
        for client_id in CLIENT_IDS
    }


def sampled_runner(model_dir, output_dir, callbacks=(), **overrides):
    return FederatedRunner(
        AutoModelForCausalLM.from_pretrained(model_dir),
        length_reward,
        sampling_args(output_dir, **overrides),
        client_datasets(),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=list(callbacks),
    )


class RPGStates(RoundCallback):
    """RPG's per-client state (φ, σ) as each round begins and ends."""

    def __init__(self):
        self.runner, self.before, self.after = None, {}, {}

    def snapshot(self):
        state = self.runner.aggregator.state_dict()
        return {name: dict(state[name]) for name in ("baselines", "volatilities")}

    def on_round_begin(self, args, round_idx, **kwargs):
        self.before[round_idx] = self.snapshot()

    def on_round_end(self, args, record, **kwargs):
        self.after[record.round_idx] = self.snapshot()


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory, tiny_model_dir):
    """3 rounds of FGRPO (RPG + server Adam) on 4 clients, 2 sampled a round, 1 local step each."""
    states = RPGStates()
    runner = sampled_runner(tiny_model_dir, tmp_path_factory.mktemp("sampled") / "run", callbacks=[states])
    states.runner = runner
    runner.run()
    return runner, states


def sampled_ids(indices):
    return {CLIENT_IDS[index] for index in indices}


# The draw ------------------------------------------------------------------------------------------------------


def test_each_round_samples_flowers_count_from_seed_and_round_alone():
    from trl_federated.sampling import clients_per_round, sample_clients

    # Flower's count, int(fraction × N) but at least the minimum: 0.29 × 100 is 29 clients, not float's 28
    for num_clients, fraction, minimum, expected in [
        (10, 0.3, 1, 3),
        (10, 0.05, 2, 2),
        (100, 0.29, 1, 29),
        (10, 0.7, 1, 7),
        (3, 0.1, 1, 1),
        (5, 1.0, 1, 5),
        (5, 1.0, 5, 5),
    ]:
        assert clients_per_round(num_clients, fraction, minimum) == expected
        for round_idx in range(5):
            sampled = sample_clients(num_clients, fraction, minimum, SEED, round_idx)
            assert len(sampled) == expected and sampled == sorted(set(sampled))
            assert all(0 <= index < num_clients for index in sampled)
    assert sample_clients(5, 1.0, 1, SEED, 3) == [0, 1, 2, 3, 4]
    # (seed, round) alone: the same draw whatever was drawn before, pinned so that a resumed run (even under another
    # Python: only `random()` of a string-seeded `Random` is promised stable) samples what the first run did
    draws = [sample_clients(NUM_CLIENTS, FRACTION, 1, SEED, round_idx) for round_idx in range(NUM_ROUNDS)]
    assert draws == SAMPLED
    backwards = [sample_clients(NUM_CLIENTS, FRACTION, 1, SEED, round_idx) for round_idx in reversed(range(3))]
    assert backwards == SAMPLED[::-1]
    assert sample_clients(20, 0.25, 1, 7, 4) == sample_clients(20, 0.25, 1, 7, 4)
    # uniform over the clients: every client is drawn within a few rounds, and the seed changes the draws
    rounds = [sample_clients(20, 0.25, 1, 7, round_idx) for round_idx in range(40)]
    assert set().union(*rounds) == set(range(20)) and len({tuple(draw) for draw in rounds}) > 30
    assert rounds != [sample_clients(20, 0.25, 1, 8, round_idx) for round_idx in range(40)]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"fraction_train": 0.0}, r"`fraction_train` must lie in \(0, 1\], got 0.0"),
    ({"fraction_train": 1.5}, r"`fraction_train` must lie in \(0, 1\], got 1.5"),
    ({"fraction_train": -0.5}, r"`fraction_train` must lie in \(0, 1\]"),
    ({"min_train_clients": 0}, "`min_train_clients` must be a positive integer"),
    ({"num_clients": 3, "min_train_clients": 4}, r"`min_train_clients` \(4\) exceeds the 3 clients"),
    ({"fraction_evaluate": 1.5}, r"`fraction_evaluate` must lie in \[0, 1\], got 1.5"),
    ({"min_evaluate_clients": 0}, "`min_evaluate_clients` must be a positive integer"),
    ({"num_clients": 3, "fraction_evaluate": 0.5, "min_evaluate_clients": 4},
     r"`min_evaluate_clients` \(4\) exceeds the 3 clients"),
    ({"num_clients": 4, "fraction_train": 0.5, "min_clients_per_round": 3},
     r"`min_clients_per_round` \(3\) exceeds the 2 clients sampled each round \(`fraction_train` 0.5 of 4 clients"),
])  # fmt: skip
def test_invalid_fraction_or_minimum_is_refused_by_name(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        FedGRPOConfig(output_dir=str(tmp_path), **{**FAST_GRPO, **overrides})


def test_the_runner_refuses_a_minimum_its_clients_cannot_meet(tmp_path, tiny_model_dir):
    # The runner's federation is its client datasets (num_clients is left at 1): checked against those, by name
    with pytest.raises(ValueError, match=r"`min_train_clients` \(5\) exceeds the 4 clients of the federation"):
        sampled_runner(tiny_model_dir, tmp_path / "run", min_train_clients=5)
    with pytest.raises(ValueError, match=r"`min_clients_per_round` \(3\) exceeds the 2 clients sampled each round"):
        sampled_runner(tiny_model_dir, tmp_path / "run", min_clients_per_round=3)


# The runner ------------------------------------------------------------------------------------------------------


def test_the_runner_trains_and_records_only_the_sampled_clients(sampled_run):
    runner, _ = sampled_run
    assert [record.sampled for record in runner.history] == SAMPLED
    for record, indices in zip(runner.history, SAMPLED):
        # ω over the sampled clients only, and each of them trained from the round's global adapter
        assert set(record.weights) == set(record.rewards) == sampled_ids(indices) and not record.dropped
        assert sum(record.weights.values()) == pytest.approx(1.0)
        assert round_logs(record)["num_sampled"] == 2
    # metrics.jsonl says which clients each round sampled, and has a client line for those only
    lines = [json.loads(line) for line in (Path(runner.args.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [line["sampled"] for line in lines if line["event"] == "round"] == SAMPLED
    clients = [(line["round_idx"], line["client_id"]) for line in lines if line["event"] == "client"]
    assert clients == [(t, CLIENT_IDS[index]) for t, indices in enumerate(SAMPLED) for index in indices]


def test_a_client_that_sits_a_round_out_keeps_its_rpg_state_bit_for_bit(sampled_run):
    runner, states = sampled_run
    sigma_min = runner.aggregator.sigma_min
    seen = set()
    for round_idx, (record, indices) in enumerate(zip(runner.history, SAMPLED)):
        before, after = states.before[round_idx], states.after[round_idx]
        for client_id in set(CLIENT_IDS) - sampled_ids(indices):
            # Eq. (ema) is applied once per report: no decay, no update while the client is away
            for name in ("baselines", "volatilities"):
                assert (client_id in before[name]) == (client_id in after[name])
                if client_id in before[name]:
                    assert before[name][client_id].hex() == after[name][client_id].hex(), (round_idx, client_id)
        for client_id in sampled_ids(indices) - seen:
            # the first report, in whichever round it comes, starts from φ = R̄ (h = 0, Eq. rpg) and σ = σ_min
            assert record.gains[client_id] == 0.0 and after["volatilities"][client_id] == sigma_min
        seen |= sampled_ids(indices)
        # τ follows the federation's round index, not how often a client took part
        assert record.temperature == runner.aggregator.temperature(round_idx)
    assert runner.history[1].gains["site-3"] == 0.0 and runner.history[1].gains["site-1"] != 0.0


def test_a_resumed_run_samples_the_same_clients_and_ends_on_the_same_adapter(sampled_run, tmp_path, tiny_model_dir):
    reference, _ = sampled_run
    checkpoint = Path(reference.args.output_dir) / "checkpoint-0"
    resumed = sampled_runner(tiny_model_dir, tmp_path / "resumed", resume_from_checkpoint=str(checkpoint))
    resumed.run()
    assert [record.sampled for record in resumed.history] == SAMPLED
    assert [record.weights for record in resumed.history] == [record.weights for record in reference.history]
    assert_states_equal(resumed.global_state, reference.global_state)
    assert resumed.aggregator.state_dict()["baselines"] == reference.aggregator.state_dict()["baselines"]
    assert resumed.aggregator.state_dict()["volatilities"] == reference.aggregator.state_dict()["volatilities"]


# SCAFFOLD under partial participation -------------------------------------------------------------------------


def test_scaffold_moves_c_by_the_sampled_clients_changes_over_n(tmp_path):
    from trl_federated.aggregation import aggregator_from_config

    args = FedGRPOConfig(output_dir=str(tmp_path), **{**FAST_GRPO, "aggregation": "scaffold", "num_clients": 4})
    aggregator = aggregator_from_config(args, NUM_CLIENTS)
    global_state = {"w": torch.zeros(3)}
    generator = torch.Generator().manual_seed(0)

    def report(client_id, round_idx, num_samples=6):
        delta = {"w": torch.randn(3, generator=generator)}
        return ClientUpdate(
            client_id, {"w": torch.randn(3, generator=generator)}, num_samples, 0.5, extras={"control_delta": delta}
        )

    controls = {}
    for round_idx, indices in enumerate(SAMPLED):
        before = copy.deepcopy(aggregator.state_dict())
        updates = [report(CLIENT_IDS[index], round_idx) for index in indices]
        for update in updates:
            aggregator.accept(update)
        global_state = aggregator.aggregate(global_state, updates, round_idx)
        # SCAFFOLD (its Algorithm 1): c ← c + (|S| / N) · mean_{i ∈ S} Δc_i, over the N clients, not the sampled
        mean_delta = torch.stack([update.extras["control_delta"]["w"] for update in updates]).mean(0)
        previous = before["control"]["w"] if before["control"] else torch.zeros(3)
        torch.testing.assert_close(aggregator.control["w"], previous + len(updates) / NUM_CLIENTS * mean_delta)
        # a client that sat the round out keeps its c_i bit for bit
        for client_id, control in controls.items():
            if client_id not in {update.client_id for update in updates}:
                assert torch.equal(aggregator.client_controls[client_id]["w"], control)
        controls = {client_id: control["w"].clone() for client_id, control in aggregator.client_controls.items()}
        torch.testing.assert_close(aggregator.control["w"], sum(controls.values()) / NUM_CLIENTS)
    # FedAvg's weights over the sampled clients only
    assert aggregator.last_weights == {"site-0": 0.5, "site-3": 0.5}


# The Flower strategy ---------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("task_identity")
def test_the_strategy_sends_the_round_to_the_clients_the_runner_samples(tmp_path, tiny_model_dir, sampled_run, caplog):
    runner, _ = sampled_run
    args = sampling_args(tmp_path / "flower", num_clients=NUM_CLIENTS, aggregation="fedavg", node_wait_timeout=0)
    strategy = FederatedStrategy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args, report_header=None)
    initial = copy.deepcopy(strategy.global_state)

    def respond(message, context):
        index = context.node_config["partition-id"]
        if message.metadata.message_type == IDENTIFY:
            return Message(RecordDict({CLIENT: client_identity_record(CLIENT_IDS[index], index)}), reply_to=message)
        round_idx = TrainInstruction.from_content(message.content).round_idx
        update = ClientUpdate(
            CLIENT_IDS[index], moved(initial, seed=10 * round_idx + index), 10 + index, 0.5, metrics={"train_loss": 0.5}
        )
        return Message(update_to_content(update, index), reply_to=message)

    for round_idx in range(NUM_ROUNDS):
        # In the last round client 3's SuperNode is not connected: sampled, it trains nowhere
        connected = [0, 1, 2] if round_idx == 2 else range(NUM_CLIENTS)
        grid = LocalGrid(respond, {100 * (round_idx + 1) + index: {"partition-id": index} for index in connected})
        messages = strategy.configure_train(round_idx + 1, None, None, grid)
        sent_to = sorted(
            grid.contexts[message.metadata.dst_node_id].node_config["partition-id"] for message in messages
        )
        strategy.aggregate_train(round_idx + 1, grid.send_and_receive(messages))
        record = strategy.history[-1]
        # the same draw as the runner's, from the same seed and round
        assert record.sampled == runner.history[round_idx].sampled == SAMPLED[round_idx]
        assert sent_to == [index for index in SAMPLED[round_idx] if index in connected]
        # FedAvg weighs the sampled clients that reported by their D_i, and no other
        sizes = {CLIENT_IDS[index]: 10 + index for index in sent_to}
        assert record.weights == pytest.approx(
            {client_id: size / sum(sizes.values()) for client_id, size in sizes.items()}
        )
    assert "no connected SuperNode serves the sampled client indices [3]" in caplog.text
    assert strategy.history[2].weights == {"site-0": 1.0} and not strategy.history[2].dropped


def absent_client_strategy(tiny_model_dir, output_dir, monkeypatch):
    """A sampled federation (half of the 4 clients a round) whose client `absent` has no SuperNode: gone for good. The
    strategy waits up to an hour for SuperNodes on a `FakeClock`, which sees every wait. Returns the strategy, a grid
    of the other clients' nodes, the clock, the absent client's index, a round that does not sample it, one that
    does, and the training replies received."""
    from trl_federated.sampling import sample_clients

    args = sampling_args(output_dir, num_clients=NUM_CLIENTS, num_rounds=100, aggregation="fedavg",
                         node_wait_timeout=3600)
    strategy = FederatedStrategy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args, report_header=None)
    clock = FakeClock()
    monkeypatch.setattr("trl_federated.flower.strategy.time", clock)
    draws = [sample_clients(NUM_CLIENTS, FRACTION, 1, SEED, round_idx) for round_idx in range(args.num_rounds)]
    absent = next(index for index in range(NUM_CLIENTS) if index not in draws[0])
    without = next(round_idx for round_idx, draw in enumerate(draws) if absent not in draw)
    with_absent = next(round_idx for round_idx, draw in enumerate(draws) if absent in draw)

    def respond(message, context):
        index = context.node_config["partition-id"]
        if message.metadata.message_type == IDENTIFY:
            return Message(RecordDict({CLIENT: client_identity_record(CLIENT_IDS[index], index)}), reply_to=message)
        update = ClientUpdate(CLIENT_IDS[index], moved(strategy.global_state, seed=index), 10, 0.5)
        return Message(update_to_content(update, index), reply_to=message)

    grid = LocalGrid(respond, {100 + index: {"partition-id": index} for index in range(NUM_CLIENTS) if index != absent})
    return strategy, grid, clock, absent, (without, draws[without]), (with_absent, draws[with_absent])


def partition_ids(grid, messages):
    return sorted(grid.contexts[message.metadata.dst_node_id].node_config["partition-id"] for message in messages)


@pytest.mark.usefixtures("task_identity")
def test_a_round_that_does_not_sample_a_missing_supernodes_client_starts_without_waiting(
    tmp_path, tiny_model_dir, monkeypatch
):
    # a server waiting for all 4 SuperNodes would wait node_wait_timeout here, for a client this round does not train
    strategy, grid, clock, absent, (round_idx, sampled), _ = absent_client_strategy(
        tiny_model_dir, tmp_path / "flower", monkeypatch
    )
    assert absent not in sampled
    messages = strategy.configure_train(round_idx + 1, None, None, grid)
    assert clock.sleeps == []  # no wait at all
    assert partition_ids(grid, messages) == sampled
    strategy.aggregate_train(round_idx + 1, grid.send_and_receive(messages))
    assert set(strategy.history[-1].weights) == sampled_ids(sampled) and not strategy.history[-1].dropped


@pytest.mark.usefixtures("task_identity")
def test_a_round_that_samples_a_missing_supernodes_client_waits_then_goes_on_naming_it(
    tmp_path, tiny_model_dir, monkeypatch, caplog
):
    strategy, grid, clock, absent, _, (round_idx, sampled) = absent_client_strategy(
        tiny_model_dir, tmp_path / "flower", monkeypatch
    )
    with caplog.at_level(logging.INFO, logger="trl_federated"):
        messages = strategy.configure_train(round_idx + 1, None, None, grid)
    assert sum(clock.sleeps) == 3600  # the whole node_wait_timeout, then the round goes on with the others
    assert partition_ids(grid, messages) == [index for index in sampled if index != absent]
    label = f"{round_idx} ({round_idx + 1}/{strategy.args.num_rounds})"  # as the round's other lines name it
    assert (f"Round {label}: no connected SuperNode serves the sampled client indices [{absent}] yet; waiting up "
            "to 3600 s more (node_wait_timeout=3600 s)") in caplog.text
    assert (f"Round {label}: no connected SuperNode serves the sampled client indices [{absent}] after 3600 s; "
            "the round goes on without them") in caplog.text
    strategy.aggregate_train(round_idx + 1, grid.send_and_receive(messages))
    record = strategy.history[-1]
    assert record.sampled == sampled and set(record.weights) == sampled_ids(sampled) - {CLIENT_IDS[absent]}
    # too few sampled clients served: the run stops, naming the missing index
    strategy.args.min_clients_per_round = 2
    with pytest.raises(NotEnoughClientsError, match=rf"only 1 of the 2 sampled clients are served by a connected "
                       rf"SuperNode after 3600 s .* No node serves the client indices \[{absent}\]"):
        strategy.configure_train(round_idx + 1, None, None, grid)


@pytest.mark.usefixtures("task_identity")
def test_flower_apps_with_client_sampling_end_where_the_runner_ends(tmp_path, tiny_model_dir, client_data_dirs):  # noqa: F811
    # 2 clients, one a round, through the ClientApp: the same client trains in each round, from the same adapter
    sampling = {"fraction-train": 0.5}
    strategy = local_federation(tiny_model_dir, client_data_dirs, tmp_path / "flower", "rpg", **sampling)
    runner = runner_result(tiny_model_dir, tmp_path / "runner", "rpg", **sampling)
    assert [len(record.sampled) for record in strategy.history] == [1, 1]
    assert [record.sampled for record in strategy.history] == [record.sampled for record in runner.history]
    assert [record.weights for record in strategy.history] == [record.weights for record in runner.history]
    assert_states_equal(strategy.global_state, runner.global_state)


# Flower's evaluate round: the clients evaluate the global adapter on their own held-out data ----------------------


def test_client_evaluations_pool_into_the_row_weighted_accuracy_per_label():
    from trl_federated.core.evaluation import merge_evaluations
    from trl_federated.flower.records import content_to_evaluation, evaluation_to_content

    a = {"accuracy": {"hard": 0.0, "simple": 1.0, "Total": 0.75}, "count": {"hard": 1, "simple": 3, "Total": 4}}
    b = {"accuracy": {"medium": 0.5, "hard": 0.5, "Total": 0.5}, "count": {"medium": 2, "hard": 2, "Total": 4}}
    pooled = merge_evaluations([content_to_evaluation(evaluation_to_content(e, "site", 0)) for e in (a, b)])
    assert pooled["accuracy"] == {"simple": 1.0, "medium": 0.5, "hard": 1 / 3, "Total": 0.625}
    assert pooled["count"] == {"simple": 3, "medium": 2, "hard": 3, "Total": 8}
    assert merge_evaluations([]) == {"accuracy": {}, "count": {}}


@pytest.mark.parametrize(("metrics", "message"), [
    ({"accuracy": 0.5}, "no 'metrics' MetricRecord with 'num-examples' and 'accuracy'"),
    ({"accuracy": float("nan"), "num-examples": 3}, "accuracy of 'Total' is no finite number"),
    ({"accuracy": 0.5, "num-examples": 0}, "row count of 'Total' is no positive integer"),
    ({"accuracy": 0.5, "num-examples": 3, "accuracy/hard": 0.5}, "row count of 'hard' is no positive integer"),
    ({"accuracy": 0.5, "num-examples": 3, "accuracy/hard": 0.5, "count/hard": 4}, "row count of 'hard'"),
    ({"accuracy": 0.5, "num-examples": 3, "accuracy/Total": 0.5, "count/Total": 3}, "is 'Total'"),
])  # fmt: skip
def test_a_malformed_evaluation_reply_is_refused_naming_the_fault(metrics, message):
    from flwr.app import MetricRecord

    from trl_federated.flower.records import content_to_evaluation

    with pytest.raises(ValueError, match=message):
        content_to_evaluation(RecordDict({"metrics": MetricRecord(metrics)}))


@pytest.mark.usefixtures("task_identity")
def test_clients_evaluate_the_round_adapter_on_their_own_held_out_data(tmp_path, tiny_model_dir, client_data_dirs):  # noqa: F811
    from trl_federated.core.evaluation import evaluate_adapter

    run_config = {
        "model-dir": str(tiny_model_dir),
        "output-dir": str(tmp_path / "flower"),
        "aggregation": "fedavg",
        "num-rounds": 1,
        "fraction-evaluate": 1.0,
    }
    node_configs = {
        11: {"partition-id": 0, "data-dir": client_data_dirs[0], "eval-rows": 4},
        12: {"partition-id": 1, "data-dir": client_data_dirs[1], "eval-rows": 2},
    }
    grid = LocalGrid(loopback_app.client_app, node_configs, run_config)
    strategy = loopback_app.build_strategy(grid.contexts[11])
    result = strategy.start(grid)

    (line,) = events(tmp_path / "flower", "client_evaluation")
    assert line["round_idx"] == 0 and line["failed"] == {} and set(line["clients"]) == {"client_0", "client_1"}
    # each client scored the global adapter the round made, on its own rows, as the server scores its eval_dataset
    args = loopback_app.federation_args(str(tmp_path / "scratch"), run_config)
    model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args.seed)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for index, client_id in enumerate(["client_0", "client_1"]):
        rows = Dataset.load_from_disk(client_data_dirs[index]).select(range(node_configs[11 + index]["eval-rows"]))
        expected = evaluate_adapter(model, strategy.global_state, tokenizer, rows, args, [loopback_app.length_reward])
        assert line["clients"][client_id]["count"] == {"Total": len(rows)}
        assert line["clients"][client_id]["accuracy"]["Total"] == pytest.approx(expected["accuracy"]["Total"])
    # pooled only from 3 clients on (issue 48: with 2, either reply would own the pool): each client's own
    assert line["accuracy"] == {} and line["count"] == {} and line["unpooled"] == ["Total"]
    assert 1 not in result.evaluate_metrics_clientapp


def test_the_runner_warns_that_only_flower_runs_client_evaluation(tmp_path, tiny_model_dir, caplog):
    # the same config file serves both paths: the runner says it ignores fraction_evaluate, and runs
    with caplog.at_level(logging.WARNING, logger="trl_federated.runner"):
        sampled_runner(tiny_model_dir, tmp_path / "run", fraction_evaluate=0.5)
    (line,) = [record.message for record in caplog.records if "fraction_evaluate" in record.message]
    assert "ignored by the in-process FederatedRunner: only the Flower deployment runs client evaluation" in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_federated.runner"):
        sampled_runner(tiny_model_dir, tmp_path / "off")
    assert "fraction_evaluate" not in caplog.text


@pytest.mark.usefixtures("task_identity")
def test_the_evaluate_round_samples_its_clients_and_names_those_without_an_evaluation(tmp_path, tiny_model_dir):
    from flwr.app import Error

    from trl_federated.flower.records import evaluation_to_content
    from trl_federated.sampling import sample_clients

    args = sampling_args(
        tmp_path / "flower",
        num_clients=NUM_CLIENTS,
        num_rounds=1,
        aggregation="fedavg",
        node_wait_timeout=0,
        fraction_train=1.0,
        fraction_evaluate=FRACTION,
    )
    strategy = FederatedStrategy(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), args, report_header=None, reply_timeout=5
    )
    initial = copy.deepcopy(strategy.global_state)
    evaluation = {"accuracy": {"Total": 0.5}, "count": {"Total": 4}}
    evaluated = sample_clients(NUM_CLIENTS, FRACTION, 1, SEED, 0, "evaluate")
    assert len(evaluated) == 2 and evaluated != SAMPLED[0]  # drawn apart from the training draw

    def respond(message, context):
        index = context.node_config["partition-id"]
        if message.metadata.message_type == IDENTIFY:
            return Message(RecordDict({CLIENT: client_identity_record(CLIENT_IDS[index], index)}), reply_to=message)
        if message.metadata.message_type == "train":
            update = ClientUpdate(CLIENT_IDS[index], moved(initial, seed=index), 10, 0.5, metrics={"train_loss": 0.5})
            return Message(update_to_content(update, index), reply_to=message)
        # the global adapter the round made, as a train message carries it
        assert_states_equal(TrainInstruction.from_content(message.content).global_state, strategy.global_state)
        if index == evaluated[0]:  # its site has no held-out data
            reason = '{"client-id": "x", "kind": "error", "reason": "ValueError: this site has no held-out data"}'
            return Message(Error(code=2, reason=reason), reply_to=message)
        return Message(evaluation_to_content(evaluation, CLIENT_IDS[index], index), reply_to=message)

    grid = LocalGrid(respond, {100 + index: {"partition-id": index} for index in range(NUM_CLIENTS)})
    strategy.aggregate_train(1, grid.send_and_receive(strategy.configure_train(1, None, None, grid)))
    messages = strategy.configure_evaluate(1, None, None, grid)
    assert sorted(grid.contexts[m.metadata.dst_node_id].node_config["partition-id"] for m in messages) == evaluated
    metrics = strategy.aggregate_evaluate(1, grid.send_and_receive(messages))
    assert metrics is None  # one evaluation: shown as that client's, not pooled (3 or more are)
    (line,) = events(args.output_dir, "client_evaluation")
    assert line["clients"][CLIENT_IDS[evaluated[1]]] == evaluation and line["accuracy"] == {}
    assert set(line["clients"]) == {CLIENT_IDS[evaluated[1]]}
    assert line["failed"] == {
        CLIENT_IDS[evaluated[0]]: "ValueError: this site has no held-out data (the report names client 'x')"
    }
    # off by default: no evaluate message
    strategy.args.fraction_evaluate = 0.0
    assert strategy.configure_evaluate(2, None, None, grid) == [] and strategy.aggregate_evaluate(2, []) is None


class ServerAppKilled(Exception):
    """The ServerApp's process dies while it sends a message."""


class RecordingGrid(LocalGrid):
    """A `LocalGrid` that records the (message type, group id) of every message sent, and dies (`ServerAppKilled`)
    instead of sending the first message of `crash_on`."""

    def __init__(self, respond, node_configs, crash_on=None):
        super().__init__(respond, node_configs)
        self.sent, self.crash_on = [], crash_on

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for message in messages:
            sent = (message.metadata.message_type, message.metadata.group_id)
            if sent == self.crash_on:
                raise ServerAppKilled(sent)
            self.sent.append(sent)
        return super().send_and_receive(messages, timeout=timeout)


@pytest.mark.parametrize("crash_on", [("evaluate", "0"), ("train", "1")], ids=["in-evaluate-round-0", "in-round-1"])
@pytest.mark.usefixtures("task_identity")
def test_a_resumed_run_redoes_the_evaluate_round_its_checkpoint_lacks_and_no_other(
    tmp_path, tiny_model_dir, caplog, crash_on
):
    # Round 0's checkpoint is written before its evaluate round: killed during it, the run has no client_evaluation
    # line of round 0, which the resumed run records first; killed in round 1, it has one, and nothing is redone.
    from trl_federated.flower.records import evaluation_to_content
    from trl_federated.sampling import sample_clients

    fraction = 0.75  # 3 of 4 clients evaluate: enough to pool

    def federation(node_offset, crash=None, **overrides):
        args = sampling_args(tmp_path / "flower", num_clients=NUM_CLIENTS, num_rounds=2, aggregation="fedavg",
                             node_wait_timeout=0, fraction_train=1.0, fraction_evaluate=fraction, **overrides)
        strategy = FederatedStrategy(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir), args, report_header=None, reply_timeout=5
        )
        grid = RecordingGrid(respond, {node_offset + index: {"partition-id": index} for index in range(NUM_CLIENTS)},
                             crash)
        return strategy, grid

    carried = {}  # round → the global adapter its evaluate messages carried

    def respond(message, context):
        index = context.node_config["partition-id"]
        if message.metadata.message_type == IDENTIFY:
            return Message(RecordDict({CLIENT: client_identity_record(CLIENT_IDS[index], index)}), reply_to=message)
        instruction = TrainInstruction.from_content(message.content)
        if message.metadata.message_type == "train":
            update = ClientUpdate(CLIENT_IDS[index], moved(instruction.global_state, seed=index), 10, 0.5)
            return Message(update_to_content(update, index), reply_to=message)
        carried[instruction.round_idx] = instruction.global_state
        evaluation = {"accuracy": {"Total": index / 4}, "count": {"Total": 2 + index}}
        return Message(evaluation_to_content(evaluation, CLIENT_IDS[index], index), reply_to=message)

    interrupted, grid = federation(100, crash_on)
    with pytest.raises(ServerAppKilled):
        interrupted.start(grid)
    round_0 = copy.deepcopy(interrupted.global_state)
    recorded = [event["round_idx"] for event in events(tmp_path / "flower", "client_evaluation")]
    assert recorded == ([] if crash_on == ("evaluate", "0") else [0])

    # The ServerApp restarts; its SuperNodes come back with new node ids, bound to no client yet.
    resumed, grid = federation(200, resume_from_checkpoint=True)
    with caplog.at_level(logging.INFO, logger="trl_federated"):
        result = resumed.start(grid)
    redone = f"Round 0 (1/{resumed.args.num_rounds}): redoing its evaluate round after the resume"
    lines = [json.loads(line) for line in (tmp_path / "flower" / "metrics.jsonl").read_text().splitlines()]
    evaluations = [line for line in lines if line["event"] == "client_evaluation"]
    assert [line["round_idx"] for line in evaluations] == [0, 1]  # each round's once
    evaluated = sample_clients(NUM_CLIENTS, fraction, 1, SEED, 0, "evaluate")
    later = len(sample_clients(NUM_CLIENTS, fraction, 1, SEED, 1, "evaluate"))
    assert set(evaluations[0]["clients"]) == sampled_ids(evaluated) and evaluations[0]["failed"] == {}
    # no reward functions declare a range here: the median of the clients' values (issue 48), over their rows, each
    # count bounded by the median count
    median = statistics.median(2 + index for index in evaluated)
    assert evaluations[0]["accuracy"]["Total"] == pytest.approx(statistics.median(index / 4 for index in evaluated))
    assert evaluations[0]["count"]["Total"] == sum(min(2 + index, median) for index in evaluated)
    assert_states_equal(carried[0], round_0)  # round 0's global adapter, as its own evaluate round sends it
    evaluate_messages = [sent for sent in grid.sent if sent[0] == "evaluate"]
    if crash_on == ("evaluate", "0"):
        # redone right after the resume, before round 1 begins, with Flower's Result holding it under server round 0
        resumed_at = lines.index(next(line for line in lines if line["event"] == "resumed"))
        assert lines.index(evaluations[0]) == resumed_at + 1
        assert evaluate_messages == [("evaluate", "0")] * len(evaluated) + [("evaluate", "1")] * later
        assert grid.sent.index(("evaluate", "0")) < grid.sent.index(("train", "1"))
        assert result.evaluate_metrics_clientapp[0]["accuracy"] == evaluations[0]["accuracy"]["Total"]
        assert caplog.text.count(redone) == 1
    else:
        assert evaluate_messages == [("evaluate", "1")] * later and 0 not in result.evaluate_metrics_clientapp
        assert redone not in caplog.text


@pytest.mark.usefixtures("task_identity")
def test_a_flower_client_writes_no_log_entry_of_a_client_that_sits_the_round_out(tmp_path, tiny_model_dir):
    """Issue 48, 4, through the Flower strategy: every node bound to a client counts as the federation's (sampled or
    not), so site-0's `site-2/loss` never shows on the curve of site-2, which sits round 0 out, and its `dp_epsilon`
    puts no ε in a run without DP."""
    args = sampling_args(tmp_path / "flower", num_clients=NUM_CLIENTS, num_rounds=1, aggregation="fedavg",
                         node_wait_timeout=0)
    strategy = FederatedStrategy(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), args, report_header=None, reply_timeout=5
    )
    initial = copy.deepcopy(strategy.global_state)
    forged = {"site-2/loss": 123.0, "dp_epsilon": 0.5, "train_loss": 0.5}

    def respond(message, context):
        index = context.node_config["partition-id"]
        if message.metadata.message_type == IDENTIFY:
            return Message(RecordDict({CLIENT: client_identity_record(CLIENT_IDS[index], index)}), reply_to=message)
        update = ClientUpdate(CLIENT_IDS[index], moved(initial, seed=index), 10, 0.5,
                              metrics=dict(forged) if index == 0 else {"train_loss": 0.25})
        return Message(update_to_content(update, index), reply_to=message)

    grid = LocalGrid(respond, {100 + index: {"partition-id": index} for index in range(NUM_CLIENTS)})
    _, metrics = strategy.aggregate_train(1, grid.send_and_receive(strategy.configure_train(1, None, None, grid)))
    assert sorted(strategy.history[0].weights) == [CLIENT_IDS[index] for index in SAMPLED[0]]  # site-2 sits out
    assert "site-2/loss" not in metrics and "site-0/site-2/loss" not in metrics
    assert not [name for name in metrics if "dp_" in name]
    assert metrics["site-0/loss"] == 0.5 and metrics["loss"] == pytest.approx(0.375)
