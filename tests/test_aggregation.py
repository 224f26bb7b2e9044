"""Each equation of the paper's server step against numbers computed by hand."""

import copy
import math

import pytest
import torch

from trl_federated import ClientUpdate, FedAvgAggregator, RPGAggregator, ServerAdam, ServerSGD
from trl_federated.aggregation import (
    AggregationError,
    CoordinateMedian,
    TrimmedMean,
    aggregator_from_config,
    pseudo_gradient,
)
from trl_federated.aggregation.blocks import BLOCK_BYTES, blocks


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


def test_server_adam_matches_hand_computation_over_two_steps():
    adam = ServerAdam(learning_rate=0.1, beta1=0.9, beta2=0.99, epsilon=1e-8)
    params = {"w": torch.tensor([1.0, 1.0])}
    delta1 = {"w": torch.tensor([0.2, -0.4])}
    out1 = adam.step(params, delta1)
    # m = 0.1 Δ, v = 0.01 Δ², update = m / (sqrt(v) + eps) = sign(Δ) (no bias correction)
    torch.testing.assert_close(adam.m["w"], torch.tensor([0.02, -0.04]))
    torch.testing.assert_close(adam.v["w"], torch.tensor([0.0004, 0.0016]))
    torch.testing.assert_close(out1["w"], torch.tensor([1.1, 0.9]))

    delta2 = {"w": torch.tensor([0.1, 0.0])}
    out2 = adam.step(out1, delta2)
    m = torch.tensor([0.9 * 0.02 + 0.1 * 0.1, 0.9 * -0.04])
    v = torch.tensor([0.99 * 0.0004 + 0.01 * 0.01, 0.99 * 0.0016])
    torch.testing.assert_close(adam.m["w"], m)
    torch.testing.assert_close(adam.v["w"], v)
    torch.testing.assert_close(out2["w"], torch.tensor([1.1, 0.9]) + 0.1 * m / (v.sqrt() + 1e-8))


def test_server_adam_bias_correction_option():
    adam = ServerAdam(learning_rate=0.1, bias_correction=True)
    out = adam.step({"w": torch.tensor([0.0])}, {"w": torch.tensor([0.5])})
    # m̂ = Δ, v̂ = Δ² after one step
    torch.testing.assert_close(out["w"], torch.tensor([0.1 * 0.5 / (0.5 + 1e-8)]))


def test_server_adam_state_round_trip_continues_identically():
    a, b = ServerAdam(learning_rate=0.05), ServerAdam(learning_rate=0.05)
    params = {"w": torch.tensor([0.3, -0.1])}
    params = a.step(params, {"w": torch.tensor([0.2, 0.1])})
    b.load_state_dict(a.state_dict())
    delta = {"w": torch.tensor([-0.3, 0.4])}
    assert torch.equal(a.step(params, delta)["w"], b.step(params, delta)["w"])


def rpg(**kwargs):
    defaults = dict(lambda_base=0.8, iota=0.9, sigma_min=0.05, sigma_max=0.2, tau_min=1.5, tau_max=2.5,
                    lambda_anneal=0.1, eps=1e-8, server_optimizer=ServerSGD(1.0))
    return RPGAggregator(**{**defaults, **kwargs})


def test_rpg_first_report_gives_zero_gain_and_uniform_weights():
    aggregator = rpg()
    aggregator.aggregate(GLOBAL, [update("a", [0, 0, 0], 0.2), update("b", [0, 0, 0], 0.9)], round_idx=0)
    assert aggregator.last_gains == {"a": 0.0, "b": 0.0}
    assert aggregator.last_weights == pytest.approx({"a": 0.5, "b": 0.5})
    assert aggregator.last_temperature == pytest.approx(2.5)  # τ^{[0]} = τ_max
    # φ^{[0]} = λ R̄ + (1 − λ) R̄ = R̄; σ^{[0]} = clip(ι σ_min + 0, ...) = σ_min
    assert aggregator.baselines == pytest.approx({"a": 0.2, "b": 0.9})
    assert aggregator.volatilities == pytest.approx({"a": 0.05, "b": 0.05})


def test_rpg_second_round_matches_hand_computation():
    aggregator = rpg()
    aggregator.aggregate(GLOBAL, [update("a", [0, 0, 0], 0.2), update("b", [0, 0, 0], 0.5)], round_idx=0)
    updates = [update("a", [2.0, 0.0, 0.0], 0.5), update("b", [0.0, 2.0, 0.0], 0.45)]
    new = aggregator.aggregate(GLOBAL, updates, round_idx=1)

    # client a: gap = 0.5 − 0.2 = 0.3; σ = clip(0.9·0.05 + 0.1·0.3, .05, .2) = 0.075; h = 0.3 / 0.075 = 4
    # client b: gap = −0.05; σ = clip(0.045 + 0.005) = 0.05; h = −0.05 / 0.05 = −1
    assert aggregator.volatilities == pytest.approx({"a": 0.075, "b": 0.05})
    assert aggregator.last_gains == pytest.approx({"a": 4.0, "b": -1.0}, rel=1e-6)
    tau = 1.5 + 1.0 * math.exp(-0.1)
    assert aggregator.last_temperature == pytest.approx(tau)
    wa = math.exp(4 / tau) / (math.exp(4 / tau) + math.exp(-1 / tau))
    assert aggregator.last_weights == pytest.approx({"a": wa, "b": 1 - wa}, rel=1e-6)
    # φ^{[1]} = 0.8 R̄ + 0.2 φ^{[0]}
    assert aggregator.baselines == pytest.approx({"a": 0.8 * 0.5 + 0.2 * 0.2, "b": 0.8 * 0.45 + 0.2 * 0.5})
    # SGD(lr=1): θ + Σ ω_i (θ_i − θ) = Σ ω_i θ_i
    torch.testing.assert_close(new["w"], torch.tensor([2 * wa, 2 * (1 - wa), 0.0]))


def test_rpg_volatility_is_clipped_to_sigma_max():
    aggregator = rpg(iota=0.5)
    aggregator.aggregate(GLOBAL, [update("a", [0, 0, 0], 0.0)], 0)
    aggregator.aggregate(GLOBAL, [update("a", [0, 0, 0], 1.0)], 1)
    # 0.5·0.05 + 0.5·1.0 = 0.525 → 0.2; h = 1 / 0.2 = 5
    assert aggregator.volatilities["a"] == pytest.approx(0.2)
    assert aggregator.last_gains["a"] == pytest.approx(5.0)


def test_rpg_partial_participation_keeps_absent_client_state():
    aggregator = rpg()
    aggregator.aggregate(GLOBAL, [update(c, [0, 0, 0], r) for c, r in [("a", 0.1), ("b", 0.4), ("c", 0.6)]], 0)
    before = (dict(aggregator.baselines), dict(aggregator.volatilities))
    aggregator.aggregate(GLOBAL, [update("a", [0, 0, 0], 0.3), update("c", [0, 0, 0], 0.6)], 1)
    assert aggregator.baselines["b"] == before[0]["b"] and aggregator.volatilities["b"] == before[1]["b"]
    assert set(aggregator.last_weights) == {"a", "c"}
    assert sum(aggregator.last_weights.values()) == pytest.approx(1.0)
    # c did not move: h = 0; a gained 0.2 / clip(0.045 + 0.02) = 0.2 / 0.065
    assert aggregator.last_gains == pytest.approx({"a": 0.2 / 0.065, "c": 0.0}, rel=1e-6)

    # b returns in round 2 against its round-0 baseline 0.4
    aggregator.aggregate(GLOBAL, [update("b", [0, 0, 0], 0.5)], 2)
    assert aggregator.last_gains["b"] == pytest.approx(0.1 / (0.045 + 0.01), rel=1e-6)
    assert aggregator.last_weights == {"b": 1.0}


def test_rpg_h_max_bounds_the_weight_of_a_lying_client():
    honest = [("a", 0.30), ("b", 0.32)]
    aggregator = rpg(h_max=2.0)
    aggregator.aggregate(GLOBAL, [update(c, [0, 0, 0], r) for c, r in honest + [("liar", 0.3)]], 0)
    aggregator.aggregate(GLOBAL, [update(c, [0, 0, 0], r) for c, r in honest + [("liar", 1e6)]], 1)
    tau = aggregator.last_temperature
    assert aggregator.last_gains["liar"] == 2.0
    # the liar's weight is at most that of a client with h = h_max against two at h ≥ −h_max... and in fact
    # against these honest gains:
    bound = math.exp(2.0 / tau) / (math.exp(2.0 / tau) + 2 * math.exp(-2.0 / tau))
    assert aggregator.last_weights["liar"] <= bound
    unbounded = rpg(h_max=None)
    unbounded.aggregate(GLOBAL, [update(c, [0, 0, 0], r) for c, r in honest + [("liar", 0.3)]], 0)
    unbounded.aggregate(GLOBAL, [update(c, [0, 0, 0], r) for c, r in honest + [("liar", 1e6)]], 1)
    assert unbounded.last_weights["liar"] > 0.999


def test_rpg_with_server_adam_state_round_trip():
    a = rpg(server_optimizer=ServerAdam(learning_rate=0.01))
    b = rpg(server_optimizer=ServerAdam(learning_rate=0.01))
    updates = [update("a", [2.0, 0.0, 0.0], 0.3), update("b", [0.0, 1.0, 1.0], 0.6)]
    state = a.aggregate(GLOBAL, updates, 0)
    b.load_state_dict(a.state_dict())
    updates = [update("a", [1.0, 0.0, 0.0], 0.5), update("b", [0.0, 1.0, 0.0], 0.55)]
    assert torch.equal(a.aggregate(state, updates, 1)["w"], b.aggregate(state, updates, 1)["w"])
    assert a.last_weights == b.last_weights


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


def test_blocked_server_step_matches_the_equations_on_a_multi_block_adapter():
    """RPG + Adam over an adapter of several cache-sized blocks equals Eqs. model_diff, momentum, model_update
    computed tensor by tensor."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(300, 1000), (1000, 300), (64, 2000), (2000, 64), (2, 3), (600, 600)]

    def adapter():
        return {f"t{i}": torch.randn(*shape, generator=generator) for i, shape in enumerate(shapes)}

    theta = adapter()
    assert len(list(blocks(theta))) > 2 and sum(t.numel() * 4 for t in theta.values()) > 2 * BLOCK_BYTES
    aggregator = rpg(server_optimizer=ServerAdam(learning_rate=0.01, beta1=0.9, beta2=0.99, epsilon=1e-8))
    m = {key: torch.zeros_like(value) for key, value in theta.items()}
    v = {key: torch.zeros_like(value) for key, value in theta.items()}
    for round_idx, rewards in enumerate([(0.2, 0.5, 0.4), (0.6, 0.45, 0.5)]):
        # Clients that moved away from θ (Δ bounded away from 0, where m / √v is ill-conditioned).
        moves = [adapter() for _ in rewards]
        updates = [
            ClientUpdate(f"c{i}", {key: theta[key] + 1 + move[key].abs() for key in theta}, 1, reward)
            for i, (move, reward) in enumerate(zip(moves, rewards))
        ]
        new = aggregator.aggregate(theta, updates, round_idx)
        weights = [aggregator.last_weights[update.client_id] for update in updates]
        for key in theta:
            delta = sum(w * (update.state[key] - theta[key]) for w, update in zip(weights, updates))
            m[key] = 0.9 * m[key] + 0.1 * delta
            v[key] = 0.99 * v[key] + 0.01 * delta**2
            torch.testing.assert_close(aggregator.server_optimizer.m[key], m[key])
            torch.testing.assert_close(aggregator.server_optimizer.v[key], v[key])
            torch.testing.assert_close(new[key], theta[key] + 0.01 * m[key] / (v[key].sqrt() + 1e-8))
        assert list(new) == list(theta)
        theta = new
    assert aggregator.server_optimizer.num_steps == 2


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


def test_trimmed_mean_and_median_by_hand():
    theta = {"w": torch.zeros(2)}
    values = [[1.0, -5.0], [2.0, 0.0], [3.0, 1.0], [100.0, 2.0], [4.0, 1e6]]
    updates = [update(f"c{i}", v, num_samples=n) for i, (v, n) in enumerate(zip(values, [1, 1, 2, 1, 1]))]
    weights = [0.1, 0.2, 0.3, 0.2, 0.2]
    # β = 0.2 of 5 clients: one trimmed at each end, per coordinate; the rest weighted by their renormalised ω
    delta = TrimmedMean(0.2).pseudo_gradient(theta, [u.state for u in updates], weights)
    # coordinate 0 keeps 2, 3, 4 (weights .2, .3, .2); coordinate 1 keeps 0, 1, 2 (weights .2, .3, .2)
    torch.testing.assert_close(
        delta["w"], torch.tensor([(0.2 * 2 + 0.3 * 3 + 0.2 * 4) / 0.7, (0.3 * 1 + 0.2 * 2) / 0.7])
    )
    delta = CoordinateMedian().pseudo_gradient(theta, [u.state for u in updates[:4]], weights[:4])
    torch.testing.assert_close(delta["w"], torch.tensor([2.5, 0.5]))  # even n: the mean of the two middle values
    # ⌊β n⌋ = 0 still trims one at each end: 4 clients at β = 0.2 keep the middle two per coordinate
    delta = TrimmedMean(0.2).pseudo_gradient(theta, [u.state for u in updates[:4]], weights[:4])
    torch.testing.assert_close(delta["w"], torch.tensor([(0.2 * 2 + 0.3 * 3) / 0.5, (0.2 * 0 + 0.3 * 1) / 0.5]))
    with pytest.raises(ValueError, match="needs at least 3 clients for it; this aggregation has 2"):
        TrimmedMean(0.2).pseudo_gradient(theta, [u.state for u in updates[:2]], weights[:2])
    with pytest.raises(ValueError, match=r"must lie in \(0, 0.5\)"):
        TrimmedMean(0.0)


@pytest.mark.parametrize("aggregation", ["rpg", "fedavg", "fedprox", "scaffold"])
@pytest.mark.parametrize("robust", ["trimmed_mean", "median"])
def test_robust_aggregation_is_selectable_for_every_method(tmp_path, aggregation, robust):
    from trl_federated import FedGRPOConfig

    args = FedGRPOConfig(output_dir=str(tmp_path), bf16=False, aggregation=aggregation, server_optimizer="sgd",
                         robust_aggregation=robust, robust_trim_fraction=0.25, num_clients=4,
                         min_clients_per_round=3)
    aggregator = aggregator_from_config(args)
    assert isinstance(aggregator.combiner, TrimmedMean if robust == "trimmed_mean" else CoordinateMedian)
    # one client far off in every coordinate: both robust combinations ignore it
    updates = [scaffold_update(f"c{i}", [1.0 + i, 1.0 + i, 1.0 + i], 0.5, 1) for i in range(3)]
    updates.append(scaffold_update("poison", [1e6, -1e6, 1e6], 0.5, 1))
    new = aggregator.aggregate(GLOBAL, updates, 0)
    assert new["w"].abs().max() < 10


def test_rpg_h_max_is_on_by_default(tmp_path):
    from trl_federated import FedGRPOConfig

    assert RPGAggregator().h_max == 10.0
    assert aggregator_from_config(FedGRPOConfig(output_dir=str(tmp_path), bf16=False)).h_max == 10.0
    # an honest client at the default ι, σ_max, with a reward jumping across the whole of [0, 2], stays within it
    aggregator = rpg()
    for round_idx, reward in enumerate([0.0, 2.0, 0.0, 2.0, 2.0, 0.0]):
        aggregator.aggregate(GLOBAL, [update("a", [0, 0, 0], reward), update("b", [0, 0, 0], 1.0)], round_idx)
        assert abs(aggregator.last_gains["a"]) < 10.0


def test_check_finite_false_skips_only_the_value_pass():
    """For callers that checked every value already (the runner and the Flower strategy, through their admission
    gate): the structure is still checked, and a NaN that got through is still caught in the result."""
    aggregator = FedAvgAggregator(ServerAdam(0.1))
    with pytest.raises(ValueError, match=r"is torch.float32 \(4,\)"):
        aggregator.aggregate(GLOBAL, faulty("shape"), 0, check_finite=False)
    with pytest.raises(AggregationError, match=r"non-finite values in global adapter\['w'\]"):
        aggregator.aggregate(GLOBAL, faulty("nan"), 0, check_finite=False)


def test_server_step_geometry_over_blocks():
    """`last_step`: ‖Δ‖, the step's size and each client's update norm and cosine with Δ, accumulated over blocks;
    FedAvg's step is Δ (ratio 1), server Adam's first step is α per coordinate whatever Δ."""
    count, e = BLOCK_BYTES // 4, 2.0**-10  # a block's worth of float32 values per tensor; a step exact in float32
    global_state = {"a": torch.zeros(count), "b": torch.ones(count)}
    up = {"a": torch.full((count,), e), "b": torch.full((count,), 1.0 + e)}  # moves every coordinate by +e
    back = {"a": torch.full((count,), -e), "b": torch.ones(count)}  # moves only "a", by −e
    updates = [ClientUpdate("up", up, 3, 0.0), ClientUpdate("back", back, 1, 0.0)]
    assert len(list(blocks(global_state))) == 2
    aggregator = FedAvgAggregator(ServerSGD(1.0))
    aggregator.aggregate(global_state, updates, 0)
    step = aggregator.last_step
    # Δ = 3/4 up + 1/4 back: e/2 on "a", 3e/4 on "b"
    delta_norm = math.sqrt(count) * e * math.sqrt(0.5**2 + 0.75**2)
    assert step.delta_norm == pytest.approx(delta_norm, rel=1e-6) and step.ratio == pytest.approx(1.0, rel=1e-6)
    norms = {"up": math.sqrt(2 * count) * e, "back": math.sqrt(count) * e}
    assert step.update_norms == pytest.approx(norms, rel=1e-6)
    assert step.cosines["up"] == pytest.approx(1.25 * count * e * e / (norms["up"] * delta_norm), rel=1e-6)
    assert step.cosines["back"] == pytest.approx(-0.5 * count * e * e / (norms["back"] * delta_norm), rel=1e-6)
    adam = FedAvgAggregator(ServerAdam(learning_rate=1e-2))
    adam.aggregate(global_state, updates, 0)
    assert adam.last_step.step_norm == pytest.approx(1e-2 * math.sqrt(2 * count), rel=1e-4)
