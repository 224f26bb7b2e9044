"""Client-level differential privacy (`aggregation.privacy`): the noise against its formula, the accountant against
`dp_accounting` computed directly, the bound on one client's influence, R̄'s release, the budget, resume, and the
refusals (Flower's DP wrappers, SCAFFOLD, bad settings)."""

import json
import logging
import math

import pytest
import torch
from datasets import Dataset
from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trl_federated import ClientUpdate, FedAvgAggregator, FederatedRunner, FedGRPOConfig, RPGAggregator, ServerSGD
from trl_federated.aggregation import ScaffoldAggregator
from trl_federated.aggregation.privacy import AdaptiveClipping, ClientLevelPrivacy, privacy_from_config
from trl_federated.core.callbacks import read_metrics

# A global adapter of 2 × 2^18 coordinates in two tensors (more than one block of the aggregation).
SHAPE = (512, 512)


def global_state():
    return {"a.lora_A.weight": torch.zeros(SHAPE), "a.lora_B.weight": torch.ones(SHAPE)}


def moved(state, seed, norm):
    """`state` plus a random update of L2 norm `norm`."""
    generator = torch.Generator().manual_seed(seed)
    steps = {key: torch.randn(value.shape, generator=generator) for key, value in state.items()}
    scale = norm / math.sqrt(sum(float(step.square().sum()) for step in steps.values()))
    return {key: value + scale * steps[key] for key, value in state.items()}


def privacy(noise_multiplier=0.7, clip_norm=0.5, num_clients=3, sample_size=3, reward_range=None, **kwargs):
    return ClientLevelPrivacy(noise_multiplier, clip_norm, num_clients, sample_size, reward_range=reward_range,
                              noise_seed=kwargs.pop("noise_seed", 0), **kwargs)


def with_privacy(aggregator, mechanism):
    aggregator.privacy = mechanism
    return aggregator


def noise_of(aggregator, updates, round_idx=0):
    """The noise the aggregation added: with server SGD at learning rate 1 and every client sending θ back (u = 0),
    θ^{[t+1]} − θ is Δ̃ − 0, the noise alone, as one vector."""
    reference = global_state()
    new = aggregator.aggregate(reference, updates, round_idx)
    return torch.cat([(new[key] - reference[key]).view(-1) for key in reference])


def test_fedavg_noise_has_the_std_of_the_formula():
    # ω = D_i / ΣD = (0.25, 0.25, 0.5): σ_Δ = σ · 2 C max ω = 0.7 · 2 · 0.5 · 0.5
    aggregator = with_privacy(FedAvgAggregator(ServerSGD(1.0)), privacy())
    updates = [ClientUpdate(f"c{i}", global_state(), size, 0.0) for i, size in enumerate((1, 1, 2))]
    noise = noise_of(aggregator, updates)
    expected = 0.7 * 2 * 0.5 * 0.5
    assert aggregator.privacy.last_noise_std == pytest.approx(expected)
    assert float(noise.std()) == pytest.approx(expected, rel=0.01)  # 2^19 draws: ±0.1% of one std
    assert abs(float(noise.mean())) < 5 * expected / math.sqrt(noise.numel())


def test_the_noise_to_signal_floor_is_the_noise_of_equal_weights_against_the_clip_norm():
    # m = 3 equal weights, the least ω_max: the noise's norm is then 2σ√d/m times C, the longest Δ the clients can send
    aggregator = with_privacy(FedAvgAggregator(ServerSGD(1.0)), privacy())
    noise = noise_of(aggregator, [ClientUpdate(f"c{i}", global_state(), 1, 0.0) for i in range(3)])
    floor = aggregator.privacy.noise_to_signal_floor(noise.numel())
    assert floor == pytest.approx(2 * 0.7 * math.sqrt(2 * 512 * 512) / 3)
    assert float(noise.norm()) / 0.5 == pytest.approx(floor, rel=0.01)


def test_rpg_noise_follows_the_weights_of_the_released_rewards_within_the_h_max_bound():
    # σ = 0.7, C = 0.5; R̄ in [0, 1] released with σ_R = 0.1. Round 0 sets the baselines (h = 0); in round 1 the
    # weights come from R̃, and the noise on Δ from the largest of them.
    rpg = RPGAggregator(h_max=2.0, server_optimizer=ServerSGD(1.0))
    aggregator = with_privacy(rpg, privacy(reward_range=(0.0, 1.0), reward_noise_multiplier=0.1))
    for round_idx, rewards in enumerate(((0.5, 0.5, 0.5), (0.9, 0.5, 0.1))):
        updates = [ClientUpdate(f"c{i}", global_state(), 1, reward) for i, reward in enumerate(rewards)]
        noise = noise_of(aggregator, updates, round_idx)
    weights = list(rpg.last_weights.values())
    assert max(weights) > 0.4  # unequal: the noise is not uniform FedAvg's
    expected = 0.7 * 2 * 0.5 * max(weights)
    assert float(noise.std()) == pytest.approx(expected, rel=0.01)
    # docs/privacy.md: |h| ≤ h_max gives ω_i ≤ 1 / (1 + (n − 1) exp(−2 h_max / τ)) whatever R̃
    bound = 1 / (1 + 2 * math.exp(-2 * 2.0 / rpg.temperature(1)))
    assert max(weights) <= bound
    # the gains are those of R̃, not of the R̄ the clients reported (recorded as reported)
    released = aggregator.privacy.last_rewards
    assert released != {"c0": 0.9, "c1": 0.5, "c2": 0.1}
    assert {metric.name for metric in rpg.round_metrics()} >= {"dp_epsilon", "dp_noise_std", "dp_rewards"}


@pytest.mark.parametrize("make", [lambda: FedAvgAggregator(ServerSGD(1.0)),
                                  lambda: RPGAggregator(server_optimizer=ServerSGD(1.0))])
def test_an_update_of_any_size_moves_the_sum_by_at_most_its_weight_times_the_clip_norm(make):
    # The same noise in both worlds (seed, round): the difference of the results is that of the sums before noise.
    clip_norm, results = 0.5, {}
    for world, attacker_norm in (("absent", 0.0), ("attacking", 1e6)):
        aggregator = with_privacy(make(), privacy(clip_norm=clip_norm, reward_range=(0.0, 1.0),
                                                  reward_noise_multiplier=1.0))
        honest = [ClientUpdate(f"c{i}", moved(global_state(), i, 0.2), 1, 0.5) for i in range(2)]
        attacker = ClientUpdate("attacker", moved(global_state(), 9, attacker_norm), 1, 0.5)
        results[world] = (aggregator.aggregate(global_state(), [*honest, attacker], 0),
                          aggregator.last_weights["attacker"])
    (absent, weight), (attacking, same_weight) = results["absent"], results["attacking"]
    assert weight == same_weight
    moved_by = math.sqrt(sum(float((attacking[key] - absent[key]).double().square().sum()) for key in absent))
    assert weight * clip_norm * 0.99 < moved_by <= weight * clip_norm * (1 + 1e-5)


def test_the_released_reward_is_the_clamped_reward_plus_noise_on_the_declared_range():
    # R̄ in [-1, 3] (B = 4) with σ_R = 0.25: R̃ − clamp(R̄) ~ N(0, 1); a reported 10 counts as 3.
    mechanism = privacy(num_clients=4000, sample_size=4000, reward_range=(-1.0, 3.0), reward_noise_multiplier=0.25)
    updates = [ClientUpdate(f"c{i}", {}, 1, 10.0) for i in range(4000)]
    released = torch.tensor([update.reward for update in mechanism.released_rewards(updates, 0)], dtype=torch.float64)
    assert [update.reward for update in updates] == [10.0] * 4000  # the reports are kept as they came
    assert float(released.mean()) == pytest.approx(3.0, abs=5 / math.sqrt(4000))
    assert float(released.std()) == pytest.approx(1.0, rel=0.05)
    again = mechanism.released_rewards(updates, 0)
    assert [update.reward for update in again] == released.tolist()  # a function of (seed, round)


@pytest.mark.parametrize("reward_noise", [None, 2.0])
def test_the_accountant_matches_dp_accounting_computed_directly(reward_noise):
    # 5 of 20 clients sampled without replacement, 7 rounds; with R̄ released too, the round is one Gaussian of
    # noise multiplier (σ⁻² + σ_R⁻²)^(-1/2).
    mechanism = privacy(noise_multiplier=1.1, num_clients=20, sample_size=5,
                        reward_range=None if reward_noise is None else (0.0, 1.0), reward_noise_multiplier=reward_noise)
    for _ in range(7):
        mechanism.compose_round(noise_std=1.0, round_idx=0)
    effective = 1.1 if reward_noise is None else (1.1**-2 + reward_noise**-2) ** -0.5
    direct = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    direct.compose(dp_event.SampledWithoutReplacementDpEvent(20, 5, dp_event.GaussianDpEvent(effective)), 7)
    assert mechanism.last_epsilon == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    assert mechanism.ledger == [(mechanism.round_event(), 7)]


def test_the_budget_allows_the_rounds_whose_epsilon_stays_within_it():
    mechanism = privacy(noise_multiplier=1.0, num_clients=10, sample_size=5)
    epsilons = [mechanism.epsilon_after(rounds) for rounds in range(1, 9)]
    mechanism.max_epsilon = (epsilons[3] + epsilons[4]) / 2
    assert mechanism.affordable_rounds(8) == 4
    assert mechanism.affordable_rounds(3) == 3
    mechanism.compose_round(noise_std=1.0, round_idx=0)
    assert mechanism.affordable_rounds(8) == 3


def test_the_accountant_and_the_noise_seed_survive_a_checkpoint():
    aggregator = with_privacy(FedAvgAggregator(ServerSGD(1.0)), privacy(noise_seed=None))
    updates = [ClientUpdate(f"c{i}", global_state(), 1, 0.0) for i in range(3)]
    for round_idx in range(2):
        noise_of(aggregator, updates, round_idx)
    state = json.loads(json.dumps(aggregator.state_dict()))  # the checkpoint keeps it as JSON
    resumed = with_privacy(FedAvgAggregator(ServerSGD(1.0)), privacy(noise_seed=None))  # another drawn seed
    resumed.load_state_dict(state)
    assert resumed.privacy.noise_seed == aggregator.privacy.noise_seed
    assert resumed.privacy.last_epsilon == aggregator.privacy.last_epsilon
    # the resumed process mixes its own randomness in (issue 59): it cannot know that round 2 was never released
    assert not torch.equal(noise_of(resumed, updates, 2), noise_of(aggregator, updates, 2))
    assert resumed.privacy.last_epsilon == aggregator.privacy.last_epsilon > 0


def test_the_noise_leaves_every_other_random_stream_alone():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    aggregator = with_privacy(FedAvgAggregator(ServerSGD(1.0)), privacy())
    noise_of(aggregator, [ClientUpdate("c0", global_state(), 1, 0.0)])
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"dp_noise_multiplier": -1.0}, "`dp_noise_multiplier` must be > 0"),
        ({"dp_noise_multiplier": 1.0, "dp_clip_norm": 0.0}, "`dp_clip_norm` must be > 0"),
        ({"dp_noise_multiplier": 1.0, "dp_target_delta": 1.0}, "`dp_target_delta` must lie in"),
        ({"dp_noise_multiplier": 1.0, "dp_reward_noise_multiplier": 0.0}, "`dp_reward_noise_multiplier` must be"),
        ({"dp_noise_multiplier": 1.0, "dp_target_quantile": 1.5}, "`dp_target_quantile` must lie in \\[0, 1\\]"),
        ({"dp_noise_multiplier": 1.0, "dp_clip_norm_lr": -0.1}, "`dp_clip_norm_lr` must be > 0"),
        ({"dp_noise_multiplier": 1.0, "dp_clipped_count_stddev": -1.0}, "`dp_clipped_count_stddev` must be > 0"),
        ({"dp_noise_multiplier": 2.0, "dp_adaptive_clipping": True, "dp_clipped_count_stddev": 1.5},
         "`dp_clipped_count_stddev` \\(1.5\\) must exceed `dp_noise_multiplier` \\(2.0\\)"),
        ({"dp_noise_multiplier": 1.0, "aggregation": "scaffold"}, "`aggregation='scaffold'` cannot run under"),
        ({"dp_noise_multiplier": 1.0, "robust_aggregation": "median"}, "`robust_aggregation='median'` cannot"),
    ],
)
def test_bad_privacy_settings_are_refused_by_name(tmp_path, settings, named):
    with pytest.raises(ValueError, match=named):
        FedGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **settings)


def test_an_aggregation_the_mechanism_does_not_cover_is_refused(tmp_path):
    args = FedGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none",
                         dp_noise_multiplier=1.0)
    with pytest.raises(ValueError, match="ScaffoldAggregator exchanges per-client state"):
        privacy_from_config(args, ScaffoldAggregator(), 4, 4, 1.0, (0.0, 1.0))
    with pytest.raises(ValueError, match="declare none: give every reward function a `reward_range`"):
        privacy_from_config(args, RPGAggregator(), 4, 4, 1.0, None)
    assert privacy_from_config(args, FedAvgAggregator(), 4, 2, 1.0, None).reward_range is None


def test_flowers_dp_wrappers_around_the_strategy_are_refused(tiny_model_dir, fast_args):
    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy import (
        DifferentialPrivacyClientSideFixedClipping,
        DifferentialPrivacyServerSideFixedClipping,
    )

    from trl_federated.flower import FederatedStrategy

    strategy = FederatedStrategy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), fast_args(num_clients=2),
                                 report_header=None)
    for wrapper in (DifferentialPrivacyServerSideFixedClipping, DifferentialPrivacyClientSideFixedClipping):
        wrapped = wrapper(strategy, noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=2)
        with pytest.raises(TypeError, match="set `dp_noise_multiplier`"):
            wrapped.start(grid=None, initial_arrays=ArrayRecord(), num_rounds=1)


def bounded_length_reward(completions, **kwargs):
    return [min(len(completion) / 64, 1.0) for completion in completions]


bounded_length_reward.reward_range = (0.0, 1.0)


def test_a_budget_ends_the_run_checkpointed_and_a_resume_continues_its_accountant(tmp_path, tiny_model_dir,
                                                                                   tiny_tokenizer, fast_args, caplog):
    # RPG under DP, 3 clients of which 2 train a round. The run without a budget (A) against one that a budget ends
    # after round 0 (B), then resumed without it: same adapter, same ε, its noise seed taken from the checkpoint.
    datasets = [Dataset.from_dict({"prompt": [f"Client {c} asks: what is {i} times {c}?" for i in range(4)]})
                for c in range(3)]
    settings = dict(num_rounds=2, local_steps=1, reward_window=1, fraction_train=0.67, dp_noise_multiplier=1.0,
                    dp_noise_seed=7, eval_initial=False)

    def run(output_dir, **overrides):
        args = fast_args(**{**settings, "output_dir": str(tmp_path / output_dir), **overrides})
        runner = FederatedRunner(AutoModelForCausalLM.from_pretrained(tiny_model_dir), bounded_length_reward, args,
                                 datasets, processing_class=tiny_tokenizer, report_header="")
        return runner.run()

    with caplog.at_level(logging.WARNING, logger="trl_federated.core.server"):
        whole = run("a")
    # 2 clients a round at σ = 1: the noise is at least √d times the longest Δ, and the start of the run says so
    (floor,) = [r.getMessage() for r in caplog.records if "this run cannot learn" in r.getMessage()]
    d = sum(value.numel() for value in load_file(tmp_path / "a" / "adapter_model.safetensors").values())
    assert f"at least {math.sqrt(d):.3g} times" in floor and f"d = {d:,} adapter coordinates" in floor
    epsilons = [record.dp_epsilon for record in whole]
    assert 0 < epsilons[0] < epsilons[1]
    stopped = run("b", dp_max_epsilon=(epsilons[0] + epsilons[1]) / 2)
    assert [record.round_idx for record in stopped] == [0]
    assert (tmp_path / "b" / "checkpoint-0").is_dir() and (tmp_path / "b" / "adapter_model.safetensors").is_file()
    assert "Differential privacy | client-level, ε = " in (tmp_path / "b" / "README.md").read_text()
    resumed = run("b", dp_noise_seed=None, resume_from_checkpoint="true")
    assert [record.dp_epsilon for record in resumed] == epsilons
    # the resumed process draws fresh noise (issue 59): round 1 is released once, with other noise than run A's
    final_a, final_b = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("a", "b"))
    assert not all(torch.equal(final_a[key], final_b[key]) for key in final_a)
    rounds = [line for line in read_metrics(tmp_path / "b" / "metrics.jsonl") if line.get("event") == "round"]
    assert [line["dp_epsilon"] for line in rounds] == epsilons
    assert "| ε |" in (tmp_path / "b" / "summary.md").read_text()


# Issue: a mechanism without leaks -----------------------------------------------------------------------------


def test_frozen_entries_take_no_noise_and_are_not_counted_in_the_noise_floor():
    """`lora_aggregation: freeze_a`: no client changes LoRA A, so the release keeps it as seeded (before, 2 rounds
    left ‖A_server − A_seeded‖ at 220 against ‖A‖ = 8.7)."""
    frozen = frozenset({"a.lora_A.weight"})
    aggregator = with_privacy(FedAvgAggregator(ServerSGD(1.0)), privacy(frozen_keys=frozen))
    reference = global_state()
    updates = [ClientUpdate(f"c{i}", moved(reference, i, 0.1) | {"a.lora_A.weight": reference["a.lora_A.weight"]},
                            1, 0.0) for i in range(3)]
    state = reference
    for round_idx in range(2):
        state = aggregator.aggregate(state, updates, round_idx)
    assert torch.equal(state["a.lora_A.weight"], reference["a.lora_A.weight"])
    assert not torch.equal(state["a.lora_B.weight"], reference["a.lora_B.weight"])


def test_a_round_redone_after_its_release_draws_fresh_noise_and_is_counted_again(tmp_path):
    """Resuming from checkpoint 0 after round 1 was released redoes round 1: with the same noise, the difference of
    the two releases would cancel it and expose the clients' updates. The release ledger outside the checkpoints
    gives the redo a fresh ordinal, and counts both releases in ε."""
    log = tmp_path / "dp-releases.jsonl"
    updates = [ClientUpdate(f"c{i}", global_state(), 1, 0.0) for i in range(3)]
    first = with_privacy(FedAvgAggregator(ServerSGD(1.0)), privacy(release_log=log))
    noise_of(first, updates, 0)
    checkpoint_0 = json.loads(json.dumps(first.state_dict()))
    released_1 = noise_of(first, updates, 1)
    checkpoint_1 = json.loads(json.dumps(first.state_dict()))
    next_round = noise_of(first, updates, 2)

    redo = with_privacy(FedAvgAggregator(ServerSGD(1.0)), privacy(release_log=log))
    redo.load_state_dict(checkpoint_0)  # the ledger holds 3 releases: rounds 0, 1, 2
    assert redo.privacy.releases == 3
    redone_1 = noise_of(redo, updates, 1)
    assert not torch.equal(redone_1, released_1)
    assert (redone_1 - released_1).std() > 0.5 * released_1.std()  # independent draws, not a shifted copy
    assert len(log.read_text().splitlines()) == 4
    assert redo.privacy.last_epsilon == pytest.approx(privacy().epsilon_after(4))

    # A resume from the latest checkpoint, with nothing released after it in this ledger, still draws fresh noise:
    # round 2 may have been released from another copy of the run (issue 59). It is counted once here.
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:2]))
    resumed = with_privacy(FedAvgAggregator(ServerSGD(1.0)), privacy(release_log=log))
    resumed.load_state_dict(checkpoint_1)
    assert not torch.equal(noise_of(resumed, updates, 2), next_round)
    assert resumed.privacy.last_epsilon == pytest.approx(privacy().epsilon_after(3))


def test_a_torn_last_line_of_the_release_ledger_is_not_counted(tmp_path):
    log = tmp_path / "dp-releases.jsonl"
    mechanism = privacy(release_log=log)
    mechanism.compose_round(1.0, 0)
    with open(log, "a") as stream:
        stream.write('{"event": {"noise')
    resumed = privacy(release_log=log)
    resumed.load_state_dict(mechanism.state_dict())
    assert resumed.releases == 1 and resumed.last_epsilon == mechanism.last_epsilon
    # the next release is not glued onto the torn line: it and every later one count
    resumed.compose_round(1.0, 1)
    resumed.compose_round(1.0, 2)
    again = privacy(release_log=log)  # resumed from the earlier checkpoint: the ledger alone knows of the two
    again.load_state_dict(mechanism.state_dict())
    assert again.releases == 3 and again.last_epsilon == resumed.last_epsilon


def test_under_dp_the_clients_sample_is_drawn_from_a_server_secret(tiny_model_dir, fast_args):
    """Clients know `seed` (42 by default): the amplification by sampling assumes they cannot tell when they are
    sampled. Under DP the draw comes from the secret noise seed, the same after a checkpoint."""
    from test_untrusted import make_server
    from trl_federated.sampling import sample_clients

    def server(**dp):
        return make_server(tiny_model_dir, fast_args, num_clients=10, fraction_train=0.3, min_clients_per_round=1,
                           **dp)

    plain = server()
    public = [sample_clients(10, 0.3, 1, plain.args.seed, t) for t in range(6)]
    assert [plain.begin_round(t) for t in range(6)] == public
    private = server(dp_noise_multiplier=1.0)
    secret = private.aggregator.privacy.sampling_seed
    assert [private.begin_round(t) for t in range(6)] == [sample_clients(10, 0.3, 1, secret, t) for t in range(6)]
    assert [private.begin_round(t) for t in range(6)] != public
    state = json.loads(json.dumps(private.aggregator.state_dict()))
    resumed = server(dp_noise_multiplier=1.0)
    resumed.aggregator.load_state_dict(state)
    assert [resumed.begin_round(t) for t in range(6)] == [sample_clients(10, 0.3, 1, secret, t) for t in range(6)]


@pytest.mark.parametrize("adaptive_clipping", [False, True])
def test_under_dp_report_to_receives_no_clients_raw_values(adaptive_clipping):
    # With adaptive clipping, the released C and b̃ are logged, and no client's bit b_i
    from trl_federated.core.callbacks import round_logs
    from trl_federated.core.round_record import RoundRecord

    aggregator = with_privacy(RPGAggregator(server_optimizer=ServerSGD(1.0)), privacy(
        reward_range=(0.0, 1.0), reward_noise_multiplier=1.0,
        adaptive_clipping=AdaptiveClipping(2.0) if adaptive_clipping else None))
    reference = global_state()
    updates = [ClientUpdate(f"c{i}", moved(reference, i, 0.1), 1, 0.2 * i,
                            metrics={"loss": 0.5, "kl": 0.01, "step_rewards": [0.1, 0.3]}) for i in range(3)]
    aggregator.aggregate(reference, updates, 0)
    step = aggregator.last_step
    record = RoundRecord(
        round_idx=0, rewards={u.client_id: u.reward for u in updates}, weights=dict(aggregator.last_weights),
        client_metrics={u.client_id: u.metrics for u in updates}, update_norms=step.update_norms,
        update_cosines=step.cosines, round_metrics=aggregator.round_metrics(),
    )
    logs = round_logs(record)
    assert logs["dp_epsilon"] > 0 and {f"c{i}/dp_reward" for i in range(3)} <= set(logs)
    assert {f"c{i}/weight" for i in range(3)} <= set(logs)
    leaked = [name for name in logs if name.split("/")[-1] in
              ("reward_window", "update_norm", "update_cosine", "loss", "kl", "reward_stderr", "zero_signal_share")
              or name == "reward"]
    assert leaked == []
    assert ({"dp_clip_norm", "dp_unclipped_share"} <= set(logs)) == adaptive_clipping
    assert not [name for name in logs if "/" in name and "clip" in name]


# Adaptive clipping (Andrew et al., NeurIPS 2021) -------------------------------------------------------------------


def adaptive(count_stddev=2.0, target_quantile=0.5, learning_rate=0.2):
    return AdaptiveClipping(count_stddev, target_quantile, learning_rate)


def count_noise(mechanism, round_idx):
    """The standard normal the next release of round `round_idx` adds to the count (σ_b times it)."""
    return float(torch.randn(1, generator=mechanism.generator(round_idx, "clipped_count"), dtype=torch.float64))


def test_adaptive_clipping_moves_the_clip_norm_by_the_geometric_update_of_the_released_count():
    # C⁰ = 0.5, γ = 0.5, η_C = 0.2, σ_b = 2: each round C^{t+1} = C^t exp(−η_C ((Σ b_i + σ_b ξ)/n − γ)), ξ the
    # round's count noise; Δ's noise is calibrated to the C^t that clipped the round, at σ_Δ = (σ⁻² − σ_b⁻²)^(-1/2).
    mechanism = privacy(noise_multiplier=0.7, clip_norm=0.5, adaptive_clipping=adaptive(2.0))
    aggregator = with_privacy(FedAvgAggregator(ServerSGD(1.0)), mechanism)
    sigma_update = (0.7**-2 - 2.0**-2) ** -0.5
    clip_norm = 0.5
    for round_idx, norms in enumerate([(0.1, 0.2, 0.3), (0.1, 0.9, 2.0), (1.0, 1.5, 3.0), (0.2, 0.3, 5.0)]):
        updates = [ClientUpdate(f"c{i}", moved(global_state(), i, norm), 1, 0.0) for i, norm in enumerate(norms)]
        unclipped = sum(norm <= clip_norm for norm in norms)
        released = (unclipped + 2.0 * count_noise(mechanism, round_idx)) / 3
        aggregator.aggregate(global_state(), updates, round_idx)
        assert mechanism.last_noise_std == pytest.approx(sigma_update * 2 * clip_norm / 3)
        assert mechanism.last_clip_norm == pytest.approx(clip_norm)
        assert mechanism.last_unclipped_share == pytest.approx(released)
        clip_norm *= math.exp(-0.2 * (released - 0.5))
        assert mechanism.clip_norm == pytest.approx(clip_norm)
    metrics = {metric.name: metric.value for metric in aggregator.round_metrics()}
    assert metrics["dp_clip_norm"] == mechanism.last_clip_norm and metrics["dp_unclipped_share"] == released


def test_adaptive_clipping_tracks_the_target_quantile_of_the_update_norms():
    # 400 clients a round with norms spread over [0.1, 2] and σ_b = 1 (b̃'s noise std 0.0025): from C = 5, C settles
    # at the 0.3-quantile of the norms, however far it started; with the count of clipped updates in place of
    # Andrew et al.'s unclipped one (as Flower 1.42's wrapper counts), it would run away (to 607 from 5).
    norms = torch.linspace(0.1, 2.0, 400).tolist()
    reference = {"w": torch.zeros(8)}
    updates = [ClientUpdate(f"c{i}", moved(reference, i, norm), 1, 0.0) for i, norm in enumerate(norms)]
    mechanism = privacy(noise_multiplier=0.5, clip_norm=5.0, num_clients=400, sample_size=400,
                        adaptive_clipping=adaptive(1.0, target_quantile=0.3))
    aggregator = with_privacy(FedAvgAggregator(ServerSGD(1.0)), mechanism)
    for round_idx in range(80):
        aggregator.aggregate(reference, updates, round_idx)
    quantile = float(torch.quantile(torch.tensor(norms), 0.3))
    assert mechanism.clip_norm == pytest.approx(quantile, rel=0.05)
    assert sum(norm <= mechanism.clip_norm for norm in norms) / 400 == pytest.approx(0.3, abs=0.03)


def test_the_raised_noise_multiplier_is_theorem_1s_under_replace_one_and_flowers_under_add_or_remove():
    # Replace-one moves the count by 1, add-or-remove the centred count by ½: Flower's (z⁻² − (2σ_b)⁻²)^(-1/2)
    # at σ_b/2 is this σ_Δ; the pair (σ_Δ, σ_b) is one Gaussian of σ.
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params

    sigma_update = adaptive(3.0).update_noise_multiplier(1.2)
    assert sigma_update == pytest.approx((1.2**-2 - 3.0**-2) ** -0.5)
    assert sigma_update**-2 + 3.0**-2 == pytest.approx(1.2**-2)
    assert compute_adaptive_noise_params(1.2, 8, 3.0 / 2)[1] == pytest.approx(sigma_update)
    aggregator = with_privacy(FedAvgAggregator(ServerSGD(1.0)), privacy(noise_multiplier=1.2,
                                                                         adaptive_clipping=adaptive(3.0)))
    noise = noise_of(aggregator, [ClientUpdate(f"c{i}", global_state(), 1, 0.0) for i in range(3)])
    assert float(noise.std()) == pytest.approx(sigma_update * 2 * 0.5 / 3, rel=0.01)
    with pytest.raises(ValueError, match="`dp_clipped_count_stddev` \\(1.0\\) must exceed `dp_noise_multiplier`"):
        privacy(noise_multiplier=1.2, adaptive_clipping=adaptive(1.0))


@pytest.mark.parametrize("reward_noise", [None, 2.0])
def test_with_adaptive_clipping_the_accountant_spends_the_epsilon_of_sigma_alone(reward_noise):
    # 5 of 20 clients, 7 rounds, σ = 1.1: Δ's σ_Δ and the count's σ_b compose to one Gaussian of σ (and R̄'s, under RPG)
    rewards = None if reward_noise is None else (0.0, 1.0)
    mechanism = privacy(noise_multiplier=1.1, num_clients=20, sample_size=5, reward_range=rewards,
                        reward_noise_multiplier=reward_noise, adaptive_clipping=adaptive(2.5))
    aggregator = with_privacy(FedAvgAggregator(ServerSGD(1.0)), mechanism)
    updates = [ClientUpdate(f"c{i}", moved(global_state(), i, 0.3 + 0.2 * i), 1, 0.5) for i in range(5)]
    for round_idx in range(7):
        aggregator.aggregate(global_state(), updates, round_idx)
    effective = 1.1 if reward_noise is None else (1.1**-2 + reward_noise**-2) ** -0.5
    direct = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    direct.compose(dp_event.SampledWithoutReplacementDpEvent(20, 5, dp_event.GaussianDpEvent(effective)), 7)
    assert mechanism.last_epsilon == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    fixed = privacy(noise_multiplier=1.1, num_clients=20, sample_size=5, reward_range=rewards,
                    reward_noise_multiplier=reward_noise)
    assert mechanism.last_epsilon == pytest.approx(fixed.epsilon_after(7), rel=1e-9)
    assert mechanism.ledger == [(mechanism.round_event(), 7)]
    assert mechanism.round_event()["clipped_count_noise_multiplier"] == 2.5


def test_a_resume_continues_the_adapted_clip_norm_and_a_redone_round_draws_fresh_count_noise(tmp_path):
    log = tmp_path / "dp-releases.jsonl"

    def mechanism(clip_norm=0.5):
        return with_privacy(FedAvgAggregator(ServerSGD(1.0)),
                            privacy(clip_norm=clip_norm, release_log=log, adaptive_clipping=adaptive()))

    updates = [ClientUpdate(f"c{i}", moved(global_state(), i, norm), 1, 0.0) for i, norm in enumerate((0.1, 0.4, 2))]
    first = mechanism()
    noise_of(first, updates, 0)
    checkpoint_0 = json.loads(json.dumps(first.state_dict()))
    noise_of(first, updates, 1)
    clip_norm_1, released_1 = first.privacy.last_clip_norm, first.privacy.last_unclipped_share
    clip_norm_2 = first.privacy.clip_norm
    checkpoint_1 = json.loads(json.dumps(first.state_dict()))
    assert checkpoint_1["privacy"]["clip_norm"] == clip_norm_2 != 0.5
    noise_of(first, updates, 2)

    # From the last checkpoint, nothing released after it: round 2 clips at the C the run had reached, whatever C
    # the resumed run was configured with, and draws fresh count noise (the resumed process's own, issue 59).
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:2]))
    resumed = mechanism(clip_norm=9.0)
    resumed.load_state_dict(checkpoint_1)
    assert resumed.privacy.clip_norm == clip_norm_2
    noise_of(resumed, updates, 2)
    assert resumed.privacy.last_clip_norm == first.privacy.last_clip_norm
    assert resumed.privacy.last_unclipped_share != first.privacy.last_unclipped_share

    # Redoing round 1 after its release: the same C and the same count, fresh noise on it, and counted again in ε.
    redo = mechanism()
    redo.load_state_dict(checkpoint_0)
    assert redo.privacy.releases == 3
    noise_of(redo, updates, 1)
    assert redo.privacy.last_clip_norm == clip_norm_1
    assert redo.privacy.last_unclipped_share != released_1
    assert redo.privacy.last_epsilon == pytest.approx(privacy(adaptive_clipping=adaptive()).epsilon_after(4))


def test_the_server_sets_adaptive_clipping_up_from_the_config_for_both_transports(tiny_model_dir, fast_args):
    # 3 of 10 clients a round at σ = 1: σ_b = max(3/20, 2σ) = 2; C starts at dp_clip_norm U. The Flower strategy
    # runs the same server core.
    from test_untrusted import make_server, unit
    from trl_federated.flower import FederatedStrategy

    server = make_server(tiny_model_dir, fast_args, num_clients=10, fraction_train=0.3, min_clients_per_round=1,
                         dp_noise_multiplier=1.0, dp_adaptive_clipping=True)
    mechanism = server.aggregator.privacy
    assert mechanism.adaptive.count_stddev == 2.0
    assert mechanism.update_noise_multiplier == pytest.approx((1 - 0.25) ** -0.5)
    assert mechanism.clip_norm == pytest.approx(0.6 * unit(server))
    strategy = FederatedStrategy(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                 fast_args(num_clients=2, aggregation="fedavg", dp_noise_multiplier=1.0,
                                           dp_adaptive_clipping=True,
                                           dp_clipped_count_stddev=4.0, dp_target_quantile=0.8),
                                 report_header=None)
    flower_mechanism = strategy.server.aggregator.privacy
    assert (flower_mechanism.adaptive.count_stddev, flower_mechanism.adaptive.target_quantile) == (4.0, 0.8)


def test_a_run_resumed_from_its_checkpoint_goes_on_with_the_adapted_clip_norm(tmp_path, tiny_model_dir, tiny_tokenizer,
                                                                               fast_args):
    # The runner end to end: FedAvg under DP with adaptive clipping, 2 of 3 clients a round; a budget ends run B after
    # round 0, and B resumed from its checkpoint clips, counts and spends as the uninterrupted run A.
    datasets = [Dataset.from_dict({"prompt": [f"Client {c} asks: what is {i} times {c}?" for i in range(4)]})
                for c in range(3)]
    settings = dict(num_rounds=2, local_steps=1, reward_window=1, fraction_train=0.67, aggregation="fedavg",
                    dp_noise_multiplier=1.0, dp_adaptive_clipping=True, dp_noise_seed=7, eval_initial=False)

    def run(output_dir, **overrides):
        args = fast_args(**{**settings, "output_dir": str(tmp_path / output_dir), **overrides})
        runner = FederatedRunner(AutoModelForCausalLM.from_pretrained(tiny_model_dir), bounded_length_reward, args,
                                 datasets, processing_class=tiny_tokenizer, report_header="")
        return runner.run()

    whole = run("a")
    clip_norms = [record.dp_clip_norm for record in whole]
    assert clip_norms[0] != clip_norms[1]
    run("b", dp_max_epsilon=(whole[0].dp_epsilon + whole[1].dp_epsilon) / 2)
    resumed = run("b", resume_from_checkpoint="true")
    assert [record.dp_clip_norm for record in resumed] == clip_norms
    # round 0's count is the checkpoint's; round 1's is drawn afresh by the resumed process (issue 59)
    shares = [record.dp_unclipped_share for record in resumed]
    assert shares[0] == whole[0].dp_unclipped_share and shares[1] != whole[1].dp_unclipped_share
    assert [record.dp_epsilon for record in resumed] == [record.dp_epsilon for record in whole]
    assert "| C | b̃ |" in (tmp_path / "b" / "summary.md").read_text()
