"""RPG (trl_federated/aggregation/rpg.py): each equation of the paper's weighting against numbers computed by hand;
the noise-aware gain against its equations, the predictiveness of the gain it reports every round, idle clients held
at their data share (through the server core), the diagnostics every round records, and the premise setting's
partition."""

import json
import math
from collections import Counter

import pytest
import torch
from datasets import Dataset
from scipy import stats

from test_aggregation import GLOBAL, rpg
from test_aggregation import update as adapter_update
from test_untrusted import honest_round, make_server, moved
from trl_federated import ClientUpdate, FedGRPOConfig, ServerAdam
from trl_federated.aggregation import FedAvgAggregator, RPGAggregator, aggregator_from_config
from trl_federated.aggregation.rpg import PredictionSums
from trl_federated.aggregation.update import cap_idle_weights, window_stderr
from trl_federated.data.partition import partition_clients
from trl_federated.reports.round_log import format_round_log
from trl_federated.reports.summary import write_summary

STATE = {"w": torch.zeros(2)}


def update(client_id, reward, step_rewards=(), num_samples=10, state=None, **metrics):
    return ClientUpdate(client_id, state if state is not None else {"w": torch.ones(2)}, num_samples, reward,
                        metrics={"step_rewards": list(step_rewards), **metrics})


# The gain ------------------------------------------------------------------------------------------------------


def paper_gain(reward, baseline, volatility, iota=0.9, sigma_min=0.05, sigma_max=0.2):
    gap = reward - baseline
    sigma = min(max(iota * volatility + (1 - iota) * abs(gap), sigma_min), sigma_max)
    return gap / (sigma + 1e-8), sigma


def test_the_paper_gain_follows_eq_rpg_and_ignores_the_step_rewards():
    rpg = RPGAggregator()
    rpg.client_weights([update("a", 0.2, [0.0, 0.4]), update("b", 0.5, [0.5, 0.5])], 0)
    assert rpg.last_gains == {"a": 0.0, "b": 0.0}  # first reports: φ = R̄
    rpg.client_weights([update("a", 0.6, [0.2, 1.0]), update("b", 0.45, [0.4, 0.5])], 1)
    phi_a, phi_b = 0.2, 0.5
    assert rpg.last_gains["a"] == pytest.approx(paper_gain(0.6, phi_a, 0.05)[0])
    assert rpg.last_gains["b"] == pytest.approx(paper_gain(0.45, phi_b, 0.05)[0])


def test_the_noise_aware_gain_soft_thresholds_the_gap_at_its_standard_error():
    rpg = RPGAggregator(gain="noise-aware", noise_threshold=1.0, lambda_base=0.8)
    rpg.client_weights([update("a", 0.2, [0.2, 0.2]), update("b", 0.5, [0.5, 0.5])], 0)
    # a: R̄ 0.6 from steps 0.5, 0.7: s = sd/√2 = 0.1414/1.414 = 0.1; s_g = 0.1 √(2 / 1.2)
    # b: R̄ 0.55 from steps 0.5, 0.6: s = 0.05; its gap 0.05 is within s_g = 0.0645: no gain
    rpg.client_weights([update("a", 0.6, [0.5, 0.7]), update("b", 0.55, [0.5, 0.6])], 1)
    s_a = 0.1 * math.sqrt(2 / 1.2)
    sigma_a = min(max(0.9 * 0.05 + 0.1 * 0.4, max(0.05, s_a)), max(0.2, s_a))
    assert sigma_a == pytest.approx(s_a)  # the floor at the gap's standard error binds
    assert rpg.last_gains["a"] == pytest.approx((0.4 - s_a) / sigma_a)
    assert rpg.last_gains["b"] == 0.0
    # with the paper's gain, b's gap of one step's luck earns h = 1
    paper = RPGAggregator()
    paper.client_weights([update("a", 0.2), update("b", 0.5)], 0)
    paper.client_weights([update("a", 0.6), update("b", 0.55)], 1)
    assert paper.last_gains["b"] == pytest.approx(1.0)


def test_without_step_rewards_the_noise_aware_gain_is_the_papers():
    noise_aware, paper = RPGAggregator(gain="noise-aware"), RPGAggregator()
    for round_idx, rewards in enumerate([(0.1, 0.3), (0.4, 0.2), (0.45, 0.6)]):
        updates = [update(client_id, reward) for client_id, reward in zip("ab", rewards)]
        assert noise_aware.client_weights(updates, round_idx) == paper.client_weights(updates, round_idx)


def test_the_noise_aware_gain_is_refused_under_differential_privacy(tmp_path):
    with pytest.raises(ValueError, match="rpg_gain='noise-aware'` cannot run under differential privacy"):
        FedGRPOConfig(output_dir=str(tmp_path), bf16=False, num_clients=3, rpg_gain="noise-aware",
                      dp_noise_multiplier=1.0)
    # a held-out R̄'s standard error is computed from the released R̃ alone, so DP may run it
    FedGRPOConfig(output_dir=str(tmp_path), bf16=False, num_clients=3, rpg_gain="noise-aware", rpg_signal="held-out",
                  dp_noise_multiplier=1.0)
    with pytest.raises(ValueError, match="`rpg_gain` must be 'paper' or 'noise-aware'"):
        FedGRPOConfig(output_dir=str(tmp_path), bf16=False, rpg_gain="snr")
    with pytest.raises(ValueError, match="rpg_noise_threshold"):
        RPGAggregator(gain="noise-aware", noise_threshold=-1)


def test_window_stderr_is_the_standard_error_of_the_windows_finite_step_rewards():
    assert window_stderr([0.9, 0.1, 0.3, 0.5], 3) == pytest.approx(stats.sem([0.1, 0.3, 0.5]))
    assert window_stderr([0.1, float("nan"), 0.5], None) == pytest.approx(stats.sem([0.1, 0.5]))
    assert window_stderr([0.4], None) is None and window_stderr([], 2) is None


# Predictiveness ------------------------------------------------------------------------------------------------


def test_gain_predictiveness_is_the_correlation_of_h_with_the_next_change_of_r():
    rpg = RPGAggregator()
    history = [(0.1, 0.5, 0.3, 0.2), (0.4, 0.3, 0.35, 0.5), (0.2, 0.45, 0.5, 0.4), (0.6, 0.4, 0.3, 0.45)]
    pairs, round_values = [], []
    previous = None
    for round_idx, rewards in enumerate(history):
        rpg.client_weights([update(client_id, reward) for client_id, reward in zip("abcd", rewards)], round_idx)
        this_round = []
        if previous is not None:
            gains, old = previous
            this_round = [(gains[c], reward - old[c]) for c, reward in zip("abcd", rewards)]
        pairs += this_round
        # none in the first round; the first reports' gains are all 0 (φ = R̄): no spread, no correlation
        spread = this_round and all(len(set(values)) > 1 for values in zip(*this_round))
        expected = stats.pearsonr(*zip(*this_round)).statistic if spread else None
        assert rpg.last_predictiveness == (None if expected is None else pytest.approx(expected))
        round_values.append(rpg.last_predictiveness)
        previous = (dict(rpg.last_gains), dict(zip("abcd", rewards)))
    assert round_values[0] is round_values[1] is None and None not in round_values[2:]
    assert rpg.prediction_sums.correlation() == pytest.approx(stats.pearsonr(*zip(*pairs)).statistic)
    metrics = {metric.name: metric.value for metric in rpg.round_metrics()}
    assert metrics["gain_predictiveness"] == round_values[-1]
    assert metrics["gain_predictiveness_run"] == pytest.approx(stats.pearsonr(*zip(*pairs)).statistic)


def test_gain_predictiveness_survives_a_checkpoint_and_keeps_constant_state():
    first, second = RPGAggregator(), RPGAggregator()
    rounds = [(0.1, 0.5, 0.3), (0.4, 0.3, 0.35), (0.2, 0.45, 0.5), (0.6, 0.4, 0.3), (0.3, 0.6, 0.2)]
    for round_idx, rewards in enumerate(rounds[:3]):
        first.client_weights([update(c, r) for c, r in zip("abc", rewards)], round_idx)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for round_idx, rewards in enumerate(rounds[3:], start=3):
        updates = [update(c, r) for c, r in zip("abc", rewards)]
        assert first.client_weights(updates, round_idx) == second.client_weights(updates, round_idx)
    assert first.prediction_sums.correlation() == second.prediction_sums.correlation() is not None
    assert len(first.state_dict()["prediction_sums"]) == 6  # sums, not pairs: the same size after any rounds


def test_tied_step_rewards_give_the_papers_gain_under_the_noise_aware_gain():
    """se(R̄) = 0 when every step reward of the window ties: the noise-aware gain then is the paper's (documented)."""
    noise_aware, paper = RPGAggregator(gain="noise-aware"), RPGAggregator()
    for round_idx, rewards in enumerate([(0.1, 0.3), (0.4, 0.2), (0.45, 0.6)]):
        updates = [update(client_id, reward, [reward] * 4) for client_id, reward in zip("ab", rewards)]
        assert noise_aware.client_weights(updates, round_idx) == paper.client_weights(updates, round_idx)
    assert noise_aware.last_gains == paper.last_gains and any(noise_aware.last_gains.values())


def predictiveness_run(rewards_of, num_rounds, gain="paper"):
    """An RPG aggregator after `num_rounds` rounds of reports `rewards_of(client, round)` from 8 clients."""
    rpg = RPGAggregator(gain=gain)
    for round_idx in range(num_rounds):
        rpg.client_weights([update(f"c{client}", rewards_of(client, round_idx)) for client in range(8)], round_idx)
    return rpg


def test_gain_predictiveness_z_reads_noise_as_zero_and_a_trend_as_information():
    """Pure noise: the statistic sits near its analytic no-information value −1/√(2(1 + λ/(2 − λ))) = −0.548, not
    0, and z ≈ 0 (mean over 8 runs within ±0.8; each within ±3). Persistent trends of different slopes per client, which
    the paper's gain reads: z > 2."""
    zs, statistics_, nulls = [], [], []
    for seed in range(8):
        noise = torch.Generator().manual_seed(seed)
        draws = torch.rand(8, 14, generator=noise, dtype=torch.float64)
        rpg = predictiveness_run(lambda client, round_idx: 0.3 + 0.1 * float(draws[client, round_idx]), 14)
        metrics = {metric.name: metric.value for metric in rpg.round_metrics()}
        zs.append(metrics["gain_predictiveness_z"])
        statistics_.append(metrics["gain_predictiveness_run"])
        nulls.append(metrics["gain_predictiveness_null"])
    assert abs(sum(zs) / len(zs)) < 0.8 and max(map(abs, zs)) < 3
    assert sum(statistics_) / len(statistics_) == pytest.approx(-1 / math.sqrt(2 * (1 + 0.8 / 1.2)), abs=0.1)
    assert all(-0.7 < null < -0.4 for null in nulls)
    noise = torch.Generator().manual_seed(0)
    draws = torch.rand(8, 14, generator=noise, dtype=torch.float64)
    trend = predictiveness_run(lambda c, t: 0.1 + 0.01 * c * t + 0.01 * float(draws[c, t]), 14)
    assert trend.last_z > 2 and trend.prediction_sums.correlation() > trend.last_null


def test_gain_predictiveness_z_survives_a_checkpoint_and_is_none_without_its_history():
    first, second, old = RPGAggregator(), RPGAggregator(), RPGAggregator()
    rounds = [(0.1, 0.5, 0.3), (0.4, 0.3, 0.35), (0.2, 0.45, 0.5), (0.6, 0.4, 0.3), (0.3, 0.6, 0.2)]
    for round_idx, rewards in enumerate(rounds[:3]):
        first.client_weights([update(c, r) for c, r in zip("abc", rewards)], round_idx)
    state = json.loads(json.dumps(first.state_dict()))
    second.load_state_dict(state)
    old.load_state_dict({key: value for key, value in state.items() if key != "report_history"})
    for round_idx, rewards in enumerate(rounds[3:], start=3):
        updates = [update(c, r) for c, r in zip("abc", rewards)]
        first.client_weights(updates, round_idx), second.client_weights(updates, round_idx)
        old.client_weights(updates, round_idx)
    assert first.last_z == second.last_z is not None and first.last_null == second.last_null
    assert old.last_z is None  # its sums hold pairs from before the history was kept


def test_prediction_sums_need_three_pairs_with_spread():
    sums = PredictionSums()
    for x, y in [(1, 2), (2, 4)]:
        sums.add(x, y)
    assert sums.correlation() is None
    sums.add(3, 6)
    assert sums.correlation() == pytest.approx(1.0)
    flat = PredictionSums()
    for x in (1, 2, 3):
        flat.add(x, 0.5)
    assert flat.correlation() is None


# Idle clients --------------------------------------------------------------------------------------------------


def test_cap_idle_weights_holds_an_idle_client_at_its_data_share():
    weights = cap_idle_weights([0.7, 0.2, 0.1], [1 / 3, 1 / 3, 1 / 3], [True, False, False])
    assert weights[0] == pytest.approx(1 / 3)
    assert weights[1] / weights[2] == pytest.approx(2.0) and sum(weights) == pytest.approx(1.0)
    assert cap_idle_weights([0.2, 0.8], [0.5, 0.5], [True, False]) == [0.2, 0.8]  # under its share: kept
    assert cap_idle_weights([0.7, 0.3], [0.5, 0.5], [True, True]) == [0.7, 0.3]  # all idle: Δ is 0 anyway


def test_an_idle_client_whose_r_climbs_gets_no_more_than_its_data_share(tiny_model_dir, fast_args):
    """Through the server core: client a sends back the adapter it was sent (no gradient: every group scored
    alike) with an R̄ that climbs every round; RPG would give it most of the weight, and so shrink the step of the
    two clients that learned."""
    server = make_server(tiny_model_dir, fast_args, aggregation="rpg", num_rounds=4, local_steps=2, reward_window=2)
    unguarded = RPGAggregator(server_optimizer=None)
    for round_idx, idle_reward in enumerate([0.1, 0.4, 0.7, 1.0]):
        replies = {
            "a": {"state": dict(server.global_state), "reward": idle_reward,
                  "metrics": {"step_rewards": [idle_reward, idle_reward], "frac_reward_zero_std": 1.0}},
            "b": {"reward": 0.3, "metrics": {"step_rewards": [0.3, 0.3]}},
            "c": {"reward": 0.3, "metrics": {"step_rewards": [0.3, 0.3]}, "state": moved(server, -1.0, 0.3)},
        }
        record = honest_round(server, round_idx, **replies)
        raw = unguarded.client_weights([update(c, replies[c]["reward"]) for c in "abc"], round_idx)
        assert record.weights["a"] <= 1 / 3 + 1e-9
        assert record.weights["b"] / record.weights["c"] == pytest.approx(raw[1] / raw[2])
        assert server.aggregator.last_idle == {"a": True, "b": False, "c": False}
    assert max(raw) == raw[0] > 0.5  # unguarded, the idle client took the round


def test_fedavg_weights_are_unchanged_by_the_idle_rule():
    fedavg = FedAvgAggregator()
    updates = [update("a", 0.5, num_samples=30, state={"w": torch.zeros(2)}), update("b", 0.1, num_samples=10)]
    fedavg.aggregate(dict(STATE), updates, 0)
    assert fedavg.last_idle == {"a": True, "b": False}
    assert fedavg.last_weights == {"a": 0.75, "b": 0.25}


# Diagnostics in the run's files --------------------------------------------------------------------------------


def test_every_round_records_the_diagnostics_in_metrics_and_result(tiny_model_dir, fast_args, tmp_path):
    server = make_server(tiny_model_dir, fast_args, aggregation="rpg", rpg_gain="noise-aware", num_rounds=4,
                         local_steps=2, reward_window=2)
    server.start_run()
    for round_idx, rewards in enumerate([(0.1, 0.5, 0.3), (0.4, 0.3, 0.35), (0.2, 0.45, 0.5), (0.6, 0.4, 0.3)]):
        replies = {c: {"reward": r, "metrics": {"step_rewards": [r - 0.1, r + 0.1], "frac_reward_zero_std": 0.25}}
                   for c, r in zip("abc", rewards)}
        honest_round(server, round_idx, **replies)
    path = server.write_result(tmp_path / "result.json", 1.0)
    last = json.loads(path.read_text())["rounds"][-1]
    assert last["reward_stderr"] == pytest.approx(dict.fromkeys("abc", 0.1))
    assert last["zero_signal_share"] == dict.fromkeys("abc", 0.25)
    assert last["idle"] == dict.fromkeys("abc", 0)
    assert last["gain_predictiveness"] is not None and last["gain_predictiveness_run"] is not None
    logged = [json.loads(line) for line in open(server.args.output_dir + "/metrics.jsonl")]
    rounds = [entry for entry in logged if entry.get("event") == "round"]
    assert rounds[-1]["gain_predictiveness_run"] == pytest.approx(last["gain_predictiveness_run"])
    assert rounds[-1]["reward_stderr"]["b"] == pytest.approx(0.1)
    assert last["gain_predictiveness_z"] == pytest.approx(rounds[-1]["gain_predictiveness_z"])
    assert -1 < last["gain_predictiveness_null"] < 0  # the no-information value, negative by construction
    summary = write_summary(tmp_path / "summary.md", server.history, {}).read_text(encoding="utf-8")
    assert f"z = {last['gain_predictiveness_z']:+.2f}" in summary and "RPG's weights carried" in summary
    log = format_round_log(server.history[-1], 4, 3)
    assert f"z vs no information = {last['gain_predictiveness_z']:+.2f}" in log
    server.close()


# The premise setting's partition ---------------------------------------------------------------------------------


def test_one_label_per_client_with_equal_sizes(tmp_path):
    rows = [{"prompt": f"{task}{i}", "category": task} for task, count in (("x", 40), ("y", 25), ("z", 31), ("w", 50))
            for i in range(count)]
    dataset = Dataset.from_list(rows)
    args = FedGRPOConfig(output_dir=str(tmp_path), bf16=False, num_clients=4, partition_column="category",
                         labels_per_client=1, equal_partition_sizes=True, min_partition_size=20)
    partitions = partition_clients(dataset, args)
    assert [set(p["category"]) for p in partitions] == [{"w"}, {"x"}, {"y"}, {"z"}]  # dealt in sorted order
    assert [len(p) for p in partitions] == [25] * 4
    prompts = [prompt for partition in partitions for prompt in partition["prompt"]]
    assert len(set(prompts)) == len(prompts) == 100  # disjoint
    unequal = partition_clients(dataset, FedGRPOConfig(
        output_dir=str(tmp_path), bf16=False, num_clients=4, partition_column="category", labels_per_client=1))
    assert sorted(Counter(len(p) for p in unequal)) == [25, 31, 40, 50]
    with pytest.raises(ValueError, match="fewer than `min_partition_size` \\(30\\)"):
        partition_clients(dataset, FedGRPOConfig(output_dir=str(tmp_path), bf16=False, num_clients=4,
                                                 partition_column="category", labels_per_client=1,
                                                 equal_partition_sizes=True, min_partition_size=30))
    with pytest.raises(ValueError, match="has only 4 values"):
        partition_clients(dataset, FedGRPOConfig(output_dir=str(tmp_path), bf16=False, num_clients=4,
                                                 partition_column="category", labels_per_client=5))
    with pytest.raises(ValueError, match="name that column"):
        FedGRPOConfig(output_dir=str(tmp_path), bf16=False, num_clients=4, partition_column=None,
                      labels_per_client=1)


# The paper's weighting, equation by equation ------------------------------------------------------------------

def test_rpg_first_report_gives_zero_gain_and_uniform_weights():
    aggregator = rpg()
    first = [adapter_update("a", [0, 0, 0], 0.2), adapter_update("b", [0, 0, 0], 0.9)]
    aggregator.aggregate(GLOBAL, first, round_idx=0)
    assert aggregator.last_gains == {"a": 0.0, "b": 0.0}
    assert aggregator.last_weights == pytest.approx({"a": 0.5, "b": 0.5})
    assert aggregator.last_temperature == pytest.approx(2.5)  # τ^{[0]} = τ_max
    # φ^{[0]} = λ R̄ + (1 − λ) R̄ = R̄; σ^{[0]} = clip(ι σ_min + 0, ...) = σ_min
    assert aggregator.baselines == pytest.approx({"a": 0.2, "b": 0.9})
    assert aggregator.volatilities == pytest.approx({"a": 0.05, "b": 0.05})


def test_rpg_second_round_matches_hand_computation():
    aggregator = rpg()
    first = [adapter_update("a", [0, 0, 0], 0.2), adapter_update("b", [0, 0, 0], 0.5)]
    aggregator.aggregate(GLOBAL, first, round_idx=0)
    updates = [adapter_update("a", [2.0, 0.0, 0.0], 0.5), adapter_update("b", [0.0, 2.0, 0.0], 0.45)]
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
    aggregator.aggregate(GLOBAL, [adapter_update("a", [0, 0, 0], 0.0)], 0)
    aggregator.aggregate(GLOBAL, [adapter_update("a", [0, 0, 0], 1.0)], 1)
    # 0.5·0.05 + 0.5·1.0 = 0.525 → 0.2; h = 1 / 0.2 = 5
    assert aggregator.volatilities["a"] == pytest.approx(0.2)
    assert aggregator.last_gains["a"] == pytest.approx(5.0)


def test_rpg_partial_participation_keeps_absent_client_state():
    aggregator = rpg()
    aggregator.aggregate(GLOBAL, [adapter_update(c, [0, 0, 0], r) for c, r in [("a", 0.1), ("b", 0.4), ("c", 0.6)]], 0)
    before = (dict(aggregator.baselines), dict(aggregator.volatilities))
    aggregator.aggregate(GLOBAL, [adapter_update("a", [0, 0, 0], 0.3), adapter_update("c", [0, 0, 0], 0.6)], 1)
    assert aggregator.baselines["b"] == before[0]["b"] and aggregator.volatilities["b"] == before[1]["b"]
    assert set(aggregator.last_weights) == {"a", "c"}
    assert sum(aggregator.last_weights.values()) == pytest.approx(1.0)
    # c did not move: h = 0; a gained 0.2 / clip(0.045 + 0.02) = 0.2 / 0.065
    assert aggregator.last_gains == pytest.approx({"a": 0.2 / 0.065, "c": 0.0}, rel=1e-6)

    # b returns in round 2 against its round-0 baseline 0.4
    aggregator.aggregate(GLOBAL, [adapter_update("b", [0, 0, 0], 0.5)], 2)
    assert aggregator.last_gains["b"] == pytest.approx(0.1 / (0.045 + 0.01), rel=1e-6)
    assert aggregator.last_weights == {"b": 1.0}


def test_rpg_h_max_bounds_the_weight_of_a_lying_client():
    honest = [("a", 0.30), ("b", 0.32)]
    aggregator = rpg(h_max=2.0)
    aggregator.aggregate(GLOBAL, [adapter_update(c, [0, 0, 0], r) for c, r in honest + [("liar", 0.3)]], 0)
    aggregator.aggregate(GLOBAL, [adapter_update(c, [0, 0, 0], r) for c, r in honest + [("liar", 1e6)]], 1)
    tau = aggregator.last_temperature
    assert aggregator.last_gains["liar"] == 2.0
    # the liar's weight is at most that of a client with h = h_max against two at h ≥ −h_max... and in fact
    # against these honest gains:
    bound = math.exp(2.0 / tau) / (math.exp(2.0 / tau) + 2 * math.exp(-2.0 / tau))
    assert aggregator.last_weights["liar"] <= bound
    unbounded = rpg(h_max=None)
    unbounded.aggregate(GLOBAL, [adapter_update(c, [0, 0, 0], r) for c, r in honest + [("liar", 0.3)]], 0)
    unbounded.aggregate(GLOBAL, [adapter_update(c, [0, 0, 0], r) for c, r in honest + [("liar", 1e6)]], 1)
    assert unbounded.last_weights["liar"] > 0.999


def test_rpg_with_server_adam_state_round_trip():
    a = rpg(server_optimizer=ServerAdam(learning_rate=0.01))
    b = rpg(server_optimizer=ServerAdam(learning_rate=0.01))
    updates = [adapter_update("a", [2.0, 0.0, 0.0], 0.3), adapter_update("b", [0.0, 1.0, 1.0], 0.6)]
    state = a.aggregate(GLOBAL, updates, 0)
    b.load_state_dict(a.state_dict())
    updates = [adapter_update("a", [1.0, 0.0, 0.0], 0.5), adapter_update("b", [0.0, 1.0, 0.0], 0.55)]
    assert torch.equal(a.aggregate(state, updates, 1)["w"], b.aggregate(state, updates, 1)["w"])
    assert a.last_weights == b.last_weights


def test_rpg_h_max_is_on_by_default(tmp_path):
    from trl_federated import FedGRPOConfig

    assert RPGAggregator().h_max == 10.0
    assert aggregator_from_config(FedGRPOConfig(output_dir=str(tmp_path), bf16=False)).h_max == 10.0
    # an honest client at the default ι, σ_max, with a reward jumping across the whole of [0, 2], stays within it
    aggregator = rpg()
    for round_idx, reward in enumerate([0.0, 2.0, 0.0, 2.0, 2.0, 0.0]):
        reports = [adapter_update("a", [0, 0, 0], reward), adapter_update("b", [0, 0, 0], 1.0)]
        aggregator.aggregate(GLOBAL, reports, round_idx)
        assert abs(aggregator.last_gains["a"]) < 10.0
