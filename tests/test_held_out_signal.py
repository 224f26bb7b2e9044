"""`rpg_signal: held-out` (issue 57): R̄ as the local model's greedy mean reward on a fixed slice of the client's own
rows. The slice against the rows trained on and across rounds, R̄ against a greedy decoding recomputed here, its
standard error and the noise-aware gain that reads it, the gate, the DP release, the option through YAML, flags and a
Flower run config, and the refusals by name."""

import math
import random
import statistics

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from trl_federated import ClientUpdate, FederatedRunner, FedGRPOConfig
from trl_federated.adapters import get_adapter_state, with_federated_adapter
from trl_federated.aggregation import aggregator_from_config
from trl_federated.aggregation.update import held_out_stderr
from trl_federated.arguments import parse_run_args
from trl_federated.core.admission import InvalidUpdateError, UpdateGate
from trl_federated.core.evaluation import evaluate_adapter
from trl_federated.data.partition import held_out_split, partition_clients
from trl_federated.flower.run_config import federation_arguments
from trl_federated.local.client import local_training_args, train_local_round


def parity_reward(completions, **kwargs):
    """A binary reward that varies on the tiny model's random text: 1 for a completion of even length."""
    return [float(len(completion) % 2 == 0) for completion in completions]


parity_reward.reward_range = (0.0, 1.0)


def rows(count, start=0):
    return Dataset.from_dict({"prompt": [f"What is {i} + 7? Count the letters." for i in range(start, start + count)]})


def test_the_slice_is_fixed_by_the_client_and_disjoint_from_the_rows_it_trains_on(fast_args):
    args = fast_args(rpg_signal="held-out", rpg_signal_items=6)
    data = rows(20)
    train, held_out = held_out_split(data, args, "client_0")
    assert len(held_out) == 6 and len(train) == 14
    assert set(train["prompt"]) | set(held_out["prompt"]) == set(data["prompt"])
    assert not set(train["prompt"]) & set(held_out["prompt"])
    # whatever the round's seed: the generator is the client's id alone
    again = held_out_split(data, fast_args(rpg_signal="held-out", rpg_signal_items=6, seed=7), "client_0")[1]
    assert again["prompt"] == held_out["prompt"]
    assert held_out_split(data, args, "client_1")[1]["prompt"] != held_out["prompt"]
    assert held_out_split(data, fast_args(), "client_0") == (data, None)  # the paper's R̄: every row trains


def test_the_reported_reward_is_the_local_models_greedy_reward_on_the_same_slice_every_round(tiny_model_dir,
                                                                                           tiny_tokenizer, fast_args):
    # batch 1 and no fast generation: the evaluation decodes each item as the loop below does
    args = fast_args(rpg_signal="held-out", rpg_signal_items=5, per_device_eval_batch_size=1, fast_generation=False)
    data = rows(15)
    held_out = held_out_split(data, args, "client_0")[1]["prompt"]
    model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), args.seed)
    trained, evaluated = set(), []

    def reward(prompts, completions, **kwargs):
        # TRL passes `trainer_state` to a reward function, the evaluation does not
        (trained.update(prompts) if "trainer_state" in kwargs else evaluated.append(list(prompts)))
        return parity_reward(completions)

    state = get_adapter_state(model)
    for round_idx in range(2):
        update = train_local_round(
            model, state, "client_0", data, local_training_args(args, round_idx, 0, 1, "client_0"), [reward],
            tiny_tokenizer, evaluate=evaluate_adapter,
        )
        state = update.state
        # recomputed: the local model (which the round leaves in place) decodes each held-out item greedily
        scores = []
        for prompt in held_out:
            inputs = tiny_tokenizer(prompt, return_tensors="pt")
            with torch.inference_mode():
                output = model.generate(**inputs, do_sample=False, max_new_tokens=args.max_completion_length,
                                        pad_token_id=tiny_tokenizer.pad_token_id, stop_strings=["</answer>"],
                                        tokenizer=tiny_tokenizer)
            scores += parity_reward(tiny_tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:],
                                                                skip_special_tokens=True))
        assert update.reward == pytest.approx(sum(scores) / len(scores), abs=1e-12)
        assert update.num_samples == 15 and len(update.metrics["step_rewards"]) == 2
        assert update.metrics["signal_seconds"] > 0
        assert sorted(prompt for batch in evaluated for prompt in batch) == sorted(held_out)
        evaluated.clear()
    assert trained and not trained & set(held_out)


def update(client_id, reward, step_rewards=(), state=None):
    return ClientUpdate(client_id, state or {"w": torch.ones(2)}, 10, reward,
                        metrics={"step_rewards": list(step_rewards)})


def test_its_standard_error_is_binomial_and_the_noise_aware_gain_reads_it(tmp_path):
    assert held_out_stderr(0.5, 100) == pytest.approx(0.05)
    assert held_out_stderr(0.25, 160) == pytest.approx(math.sqrt(0.25 * 0.75 / 160))
    assert held_out_stderr(1.3, 160) == held_out_stderr(-0.2, 160) == 0.0  # a noised R̃ outside [0, 1]
    args = FedGRPOConfig(output_dir=str(tmp_path), bf16=False, rpg_signal="held-out", rpg_signal_items=160,
                         rpg_gain="noise-aware")
    rpg = aggregator_from_config(args, 2)
    # R̄'s own p and n, not the step rewards sent with it
    assert rpg.reward_stderr(update("a", 0.4, [0.0, 1.0])) == pytest.approx(math.sqrt(0.4 * 0.6 / 160))
    rpg.client_weights([update("a", 0.2, [0.0, 1.0]), update("b", 0.5, [0.0, 1.0])], 0)
    rpg.client_weights([update("a", 0.4, [0.0, 1.0]), update("b", 0.52, [0.0, 1.0])], 1)
    # a: gap 0.2, s_g = √(0.4·0.6/160) √(2/1.2) = 0.05; σ = clip(0.9·0.05 + 0.1·0.2, 0.05, 0.2) = 0.065
    s_g = math.sqrt(0.4 * 0.6 / 160) * math.sqrt(2 / 1.2)
    assert rpg.last_gains["a"] == pytest.approx((0.2 - s_g) / 0.065)
    assert rpg.last_gains["b"] == 0.0  # its gap 0.02 is within s_g ≈ 0.051
    assert aggregator_from_config(FedGRPOConfig(output_dir=str(tmp_path), bf16=False), 2).reward_stderr(
        update("a", 0.5, [0.0, 1.0])) == pytest.approx(0.5)  # the window's: sd 0.707 / √2


def test_its_standard_error_bounds_any_reward_in_the_declared_range(tmp_path):
    # accuracy + format: rewards 0, 1 or 2; a mean of 1.5 would read se 0 if held to [0, 1]
    assert held_out_stderr(1.5, 100, (0.0, 2.0)) == pytest.approx(math.sqrt(0.5 * 1.5 / 100))
    assert held_out_stderr(-1.0, 40, (-2.0, 2.0)) == pytest.approx(math.sqrt(3.0 * 1.0 / 40))
    assert held_out_stderr(0.5, 100, None) is None  # a reward model: nothing bounds it
    rng = random.Random(0)  # Bhatia-Davis: the bound holds for any rewards in the range, with equality at its ends
    for values in ([rng.choice([0.0, 1.0, 2.0]) for _ in range(50)], [rng.uniform(0, 2) for _ in range(50)]):
        mean = statistics.fmean(values)
        assert statistics.pstdev(values) / math.sqrt(50) <= held_out_stderr(mean, 50, (0.0, 2.0))
    ends = [0.0] * 30 + [2.0] * 20
    assert statistics.pstdev(ends) / math.sqrt(50) == pytest.approx(held_out_stderr(statistics.fmean(ends), 50,
                                                                                     (0.0, 2.0)))
    args = FedGRPOConfig(output_dir=str(tmp_path), bf16=False, rpg_signal="held-out", rpg_signal_items=100,
                         rpg_gain="noise-aware")
    rpg = aggregator_from_config(args, 2)
    rpg.reward_range = (0.0, 2.0)  # as the server sets it from its reward functions
    assert rpg.reward_stderr(update("a", 1.5, [2.0, 1.0])) == pytest.approx(math.sqrt(0.5 * 1.5 / 100))
    rpg.reward_range = None
    assert rpg.reward_stderr(update("a", 1.5, [2.0, 1.0])) is None
    assert any("declare none" in message for message in args.federation_warnings(None))
    assert not any("declare none" in message for message in args.federation_warnings((0.0, 2.0)))


def test_the_gate_admits_a_held_out_reward_that_is_no_mean_of_the_step_rewards(tmp_path):
    state = {"w": torch.zeros(2)}
    for signal, admitted in (("held-out", True), ("reward-window", False)):
        gate = UpdateGate.from_config(FedGRPOConfig(output_dir=str(tmp_path), bf16=False, rpg_signal=signal,
                                                    local_steps=2, reward_window=2), state, reward_range=(0.0, 1.0))
        gate.open_round(state)
        if admitted:
            assert gate.check("a", update("a", 0.3, [0.5, 0.9], state)).reward == 0.3
        else:
            with pytest.raises(InvalidUpdateError, match="is not the mean of its last 2 step rewards"):
                gate.check("a", update("a", 0.3, [0.5, 0.9], state))


def test_under_dp_the_server_releases_the_held_out_reward_as_it_releases_the_windows(tiny_model_dir, tiny_tokenizer,
                                                                                   fast_args):
    # the noise-aware gain too: it reads a held-out R̄'s standard error from the released R̃ alone
    args = fast_args(rpg_signal="held-out", rpg_signal_items=4, num_rounds=1, num_clients=2, dp_noise_multiplier=1.0,
                     dp_reward_noise_multiplier=0.5, rpg_gain="noise-aware")
    runner = FederatedRunner(AutoModelForCausalLM.from_pretrained(tiny_model_dir), parity_reward, args,
                             [rows(10), rows(10, start=10)], processing_class=tiny_tokenizer)
    assert runner.aggregator.reward_range == (0.0, 1.0)  # the server's, from parity_reward's declared range
    privacy, expected = runner.aggregator.privacy, []
    release = privacy.released_rewards

    def watched(updates, round_idx):
        # R̃ = clamp(R̄, 0, 1) + N(0, (σ_R B)²), B = 1, from the noise the release is about to draw
        noise = torch.randn(len(updates), generator=privacy.generator(round_idx, "rewards"), dtype=torch.float64)
        expected.append({u.client_id: min(max(u.reward, 0.0), 1.0) + 0.5 * float(z) for u, z in zip(updates, noise)})
        return release(updates, round_idx)

    privacy.released_rewards = watched
    (record,) = runner.run()
    assert all(4 * reward == round(4 * reward) for reward in record.rewards.values())  # means of 4 binary items
    released = next(metric.value for metric in record.round_metrics if metric.name == "dp_rewards")
    assert expected == [pytest.approx(released)] and set(released) == set(record.rewards) == {"client_0", "client_1"}
    assert released != record.rewards
    factor = math.sqrt(2 / (2 - args.rpg_lambda_base))  # the gap's standard error from R̄'s (rpg.py)
    assert runner.aggregator.report_history == {
        client: [(pytest.approx(reward), pytest.approx(held_out_stderr(reward, 4) * factor))]
        for client, reward in released.items()}


def test_the_option_round_trips_through_yaml_flags_and_a_flower_run_config(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("rpg_signal: held-out\nrpg_signal_items: 40\n", encoding="utf-8")
    flags = ["--output_dir", str(tmp_path / "run"), "--bf16", "false", "--use_cpu", "true"]
    for argv in (["--config", str(config), *flags], [*flags, "--rpg_signal", "held-out", "--rpg_signal_items", "40"]):
        args, _, _ = parse_run_args(argv)
        assert (args.rpg_signal, args.rpg_signal_items) == ("held-out", 40)
    args, _, _ = federation_arguments({"rpg-signal": "held-out", "rpg-signal-items": 40, "output-dir": str(tmp_path),
                                       "bf16": False, "use-cpu": True}, tmp_path)
    assert (args.rpg_signal, args.rpg_signal_items) == ("held-out", 40)
    assert FedGRPOConfig(output_dir=str(tmp_path), bf16=False).rpg_signal == "reward-window"  # the paper's R̄


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"rpg_signal_items": 0}, "`rpg_signal_items` must be a positive integer, got 0"),
        ({"rpg_signal_items": 1.5}, "`rpg_signal_items` must be of type int"),
        ({"rpg_signal": "held_out"}, "`rpg_signal` must be 'reward-window' or 'held-out', got 'held_out'"),
        ({"rpg_signal": "held-out", "dp_record_noise_multiplier": 1.0},
         "`rpg_signal='held-out'` cannot run under record-level DP"),
    ],
)
def test_bad_settings_are_refused_by_name(tmp_path, settings, named):
    with pytest.raises((ValueError, TypeError), match=named):  # a value of the wrong type is a TypeError
        FedGRPOConfig(output_dir=str(tmp_path), bf16=False, **settings)


def test_a_slice_that_leaves_too_little_to_train_on_is_refused_naming_rpg_signal_items(tmp_path, tiny_model_dir,
                                                                                       tiny_tokenizer, fast_args):
    data = Dataset.from_dict({"prompt": [f"q{i}" for i in range(40)], "category": ["a", "b"] * 20})
    args = fast_args(rpg_signal="held-out", rpg_signal_items=15, num_clients=2, partition_column="category",
                     labels_per_client=1, min_partition_size=10)
    with pytest.raises(ValueError, match=r"`rpg_signal_items` \(15\) leaves client 'client_0' 5 of its 20 rows"):
        partition_clients(data, args)
    with pytest.raises(ValueError, match="`rpg_signal_items`"):  # a runner given the clients' data directly
        FederatedRunner(AutoModelForCausalLM.from_pretrained(tiny_model_dir), parity_reward, args,
                        [rows(20), rows(20, start=20)], processing_class=tiny_tokenizer)
    assert [len(client) for client in partition_clients(data, fast_args(
        rpg_signal="held-out", rpg_signal_items=10, num_clients=2, partition_column="category", labels_per_client=1,
        min_partition_size=10))] == [20, 20]
