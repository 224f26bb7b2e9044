"""Each equation of the paper's server step against numbers computed by hand."""

import copy
import math

import pytest
import torch

from trl_federated import ClientUpdate, FedAvgAggregator, RPGAggregator, ServerAdam, ServerSGD
from trl_federated.aggregation import (
    AggregationError,
    aggregator_from_config,
    pseudo_gradient,
)
from trl_federated.aggregation.blocks import blocks


def update(client_id, values, reward=0.0, num_samples=1):
    return ClientUpdate(client_id, {"w": torch.tensor(values, dtype=torch.float32)}, num_samples, reward)


GLOBAL = {"w": torch.tensor([1.0, -2.0, 0.5])}


def test_fedavg_weights_are_data_volume_and_sgd_gives_weighted_average():
    updates = [update("a", [2.0, 0.0, 1.0], num_samples=1), update("b", [4.0, 2.0, -1.0], num_samples=3)]
    aggregator = FedAvgAggregator(server_optimizer=ServerSGD(learning_rate=1.0))
    new = aggregator.aggregate(GLOBAL, updates, round_idx=0)
    assert aggregator.last_weights == {"a": 0.25, "b": 0.75}
    torch.testing.assert_close(new["w"], torch.tensor([0.25 * 2 + 0.75 * 4, 0.75 * 2, 0.25 - 0.75]))
    assert new["w"].dtype == torch.float32
    torch.testing.assert_close(GLOBAL["w"], torch.tensor([1.0, -2.0, 0.5]))  # input untouched


def test_fedavg_over_the_clients_that_reported_only():
    aggregator = FedAvgAggregator()
    aggregator.aggregate(GLOBAL, [update("a", [0, 0, 0], num_samples=2), update("c", [0, 0, 0], num_samples=6)], 0)
    assert aggregator.last_weights == {"a": 0.25, "c": 0.75}


def test_pseudo_gradient_is_weighted_sum_of_differences():
    states = [{"w": torch.tensor([3.0, 0.0, 0.5])}, {"w": torch.tensor([1.0, 2.0, 2.5])}]
    delta = pseudo_gradient(GLOBAL, states, [0.5, 0.5])
    torch.testing.assert_close(delta["w"], torch.tensor([1.0, 3.0, 1.0]))


def rpg(**kwargs):
    defaults = dict(lambda_base=0.8, iota=0.9, sigma_min=0.05, sigma_max=0.2, tau_min=1.5, tau_max=2.5,
                    lambda_anneal=0.1, eps=1e-8, server_optimizer=ServerSGD(1.0))
    return RPGAggregator(**{**defaults, **kwargs})


def test_aggregate_without_updates_is_an_error():
    with pytest.raises(ValueError, match="at least one client"):
        rpg().aggregate(GLOBAL, [], 0)


def test_aggregator_from_config(tmp_path):
    from trl_federated import FedGRPOConfig

    args = FedGRPOConfig(output_dir=str(tmp_path), bf16=False, aggregation="fedavg", server_optimizer="sgd")
    aggregator = aggregator_from_config(args)
    assert isinstance(aggregator, FedAvgAggregator) and isinstance(aggregator.server_optimizer, ServerSGD)
    assert aggregator.server_optimizer.learning_rate == 1.0
    args = FedGRPOConfig(output_dir=str(tmp_path), bf16=False, rpg_tau_min=1.0, rpg_h_max=3.0, learning_rate=1e-4,
                         server_optimizer="adam")
    aggregator = aggregator_from_config(args)
    assert isinstance(aggregator, RPGAggregator) and isinstance(aggregator.server_optimizer, ServerAdam)
    # the derived server rate: 0.5 x local_steps (10) x learning_rate
    assert (aggregator.tau_min, aggregator.h_max, aggregator.server_optimizer.learning_rate) == (1.0, 3.0, 5e-4)


def test_blocks_keep_key_order_and_stay_within_budget():
    sizes = {"a": 10, "b": 30, "c": 70, "d": 5, "e": 5, "f": 20}  # float32 elements
    state = {key: torch.zeros(n) for key, n in sizes.items()}
    runs = list(blocks(state, block_bytes=160))  # 40 floats per block
    assert [key for run in runs for key in run] == list(sizes)
    assert runs == [["a", "b"], ["c"], ["d", "e", "f"]]  # "c" alone exceeds the budget: a block of its own


def test_pseudo_gradient_accumulates_bfloat16_client_states_in_float32():
    states = [{"w": torch.tensor([3.0, 0.0, 0.5]).bfloat16()}, {"w": torch.tensor([1.0, 2.0, 2.5]).bfloat16()}]
    delta = pseudo_gradient(GLOBAL, states, [0.25, 0.75])
    assert delta["w"].dtype == torch.float32
    torch.testing.assert_close(delta["w"], 0.25 * states[0]["w"].float() + 0.75 * states[1]["w"].float() - GLOBAL["w"])


# The aggregators check their own inputs and their result -----------------------------------------------------


def scaffold_update(client_id, values, reward=0.0, num_samples=1):
    result = update(client_id, values, reward, num_samples)
    result.extras = {"control_delta": {"w": torch.zeros(3)}}
    return result


def faulty(fault):
    updates = [scaffold_update("a", [1.0, 2.0, 3.0], 0.5, 4), scaffold_update("b", [0.0, 1.0, 0.0], 0.4, 2)]
    bad = updates[1]
    if fault == "nan":
        bad.state["w"][0] = math.nan
    elif fault == "extra key":
        bad.state["v"] = torch.zeros(1)
    elif fault == "missing key":
        bad.state = {}
    elif fault == "shape":
        bad.state["w"] = torch.zeros(4)
    elif fault == "integer dtype":
        bad.state["w"] = torch.zeros(3, dtype=torch.int64)
    elif fault == "duplicate id":
        bad.client_id = "a"
    elif fault == "not a ClientUpdate":
        updates[1] = {"client_id": "b", "state": bad.state}
    elif fault == "num_samples":
        bad.num_samples = True
    elif fault == "reward":
        bad.reward = math.nan
    elif fault == "control":
        bad.extras["control_delta"]["w"][1] = math.inf
    return updates


COMMON_FAULTS = {
    "nan": r"client 'b'.s adapter\['w'\] holds NaN or Inf",
    "extra key": r"client 'b'.s adapter must have the global adapter's keys \(missing \[\], unexpected \['v'\]\)",
    "missing key": r"missing \['w'\]",
    "shape": r"is torch.float32 \(4,\), expected floating point \(3,\)",
    "integer dtype": r"is torch.int64 \(3,\)",
    "duplicate id": "Client 'a' has two updates in one aggregation",
    "not a ClientUpdate": "takes ClientUpdates with a string client_id",
}


@pytest.mark.parametrize("method", ["fedavg", "rpg", "scaffold"])
@pytest.mark.parametrize("fault", [*COMMON_FAULTS, "num_samples", "reward", "control"])
def test_aggregators_validate_their_own_inputs(method, fault):
    from trl_federated.aggregation import ScaffoldAggregator

    aggregator = {"fedavg": lambda: FedAvgAggregator(ServerAdam(0.1)),
                  "rpg": lambda: rpg(server_optimizer=ServerAdam(0.1)),
                  "scaffold": lambda: ScaffoldAggregator(ServerAdam(0.1))}[method]()
    aggregator.aggregate(GLOBAL, faulty(None), 0)
    before = copy.deepcopy(aggregator.state_dict())
    message = COMMON_FAULTS.get(fault) or {
        ("fedavg", "num_samples"): "FedAvg: client 'b'.s num_samples must be a positive integer, got True",
        ("scaffold", "num_samples"): "num_samples must be a positive integer",
        ("rpg", "reward"): "RPG: client 'b'.s reward must be a finite number, got nan",
        ("scaffold", "control"): r"SCAFFOLD: client 'b'.s control_delta\['w'\] holds NaN or Inf",
    }.get((method, fault))
    if message is None:  # a field this method does not use
        aggregator.aggregate(GLOBAL, faulty(fault), 1)
        return
    with pytest.raises(ValueError, match=message):
        aggregator.aggregate(GLOBAL, faulty(fault), 1)
    after = aggregator.state_dict()  # a refused call leaves the server state as it was
    assert after["server_optimizer"]["num_steps"] == before["server_optimizer"]["num_steps"] == 1
    assert torch.equal(after["server_optimizer"]["v"]["w"], before["server_optimizer"]["v"]["w"])
    if method == "rpg":
        assert after["baselines"] == before["baselines"]


def test_a_non_finite_result_is_refused():
    """Values around 1e30 are finite, but Adam's Δ² is not: the round is refused instead of freezing the adapter."""
    aggregator = rpg(server_optimizer=ServerAdam(learning_rate=0.1))
    with pytest.raises(AggregationError, match=r"non-finite values in server optimizer\['v'\]\['w'\]"):
        aggregator.aggregate(GLOBAL, [update("a", [1e30, 0.0, 0.0], 0.5)], 0)
    sgd = FedAvgAggregator(ServerSGD(2.0))
    with pytest.raises(AggregationError, match=r"non-finite values in global adapter\['w'\]"):
        sgd.aggregate(GLOBAL, [update("a", [3e38, 0, 0]), update("b", [3e38, 0, 0])], 0)


def test_check_finite_false_skips_only_the_value_pass():
    """For callers that checked every value already (the runner and the Flower strategy, through their admission
    gate): the structure is still checked, and a NaN that got through is still caught in the result."""
    aggregator = FedAvgAggregator(ServerAdam(0.1))
    with pytest.raises(ValueError, match=r"is torch.float32 \(4,\)"):
        aggregator.aggregate(GLOBAL, faulty("shape"), 0, check_finite=False)
    with pytest.raises(AggregationError, match=r"non-finite values in global adapter\['w'\]"):
        aggregator.aggregate(GLOBAL, faulty("nan"), 0, check_finite=False)


