"""RPG (trl_federated/aggregation/rpg.py): each equation of the paper's weighting against numbers computed by hand."""

import math

import pytest
import torch

from test_aggregation import GLOBAL, rpg, update
from trl_federated import RPGAggregator, ServerAdam
from trl_federated.aggregation import aggregator_from_config


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


def test_rpg_h_max_is_on_by_default(tmp_path):
    from trl_federated import FedGRPOConfig

    assert RPGAggregator().h_max == 10.0
    assert aggregator_from_config(FedGRPOConfig(output_dir=str(tmp_path), bf16=False)).h_max == 10.0
    # an honest client at the default ι, σ_max, with a reward jumping across the whole of [0, 2], stays within it
    aggregator = rpg()
    for round_idx, reward in enumerate([0.0, 2.0, 0.0, 2.0, 2.0, 0.0]):
        aggregator.aggregate(GLOBAL, [update("a", [0, 0, 0], reward), update("b", [0, 0, 0], 1.0)], round_idx)
        assert abs(aggregator.last_gains["a"]) < 10.0
