"""The defaults a user gets are the paper's Algorithm 1: one local learning-rate schedule over the whole federation,
a fixed KL reference, the baselines' own server step, the paper's loss, and an R̄ that sees local progress."""

import logging

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, get_scheduler

from conftest import length_reward
from trl_federated import FedDAPOConfig, FederatedRunner, FedGRPOConfig, FedGRPOTrainer, FedGSPOConfig, RoundCallback
from trl_federated.aggregation import FedAvgAggregator, RPGAggregator, ServerAdam, ServerSGD, aggregator_from_config
from trl_federated.runner import NotEnoughClientsError


def client_datasets(num_clients=2, per_client=8):
    return [
        Dataset.from_dict({"prompt": [f"Client {c} asks: what is {i} times {c}?" for i in range(per_client)]})
        for c in range(num_clients)
    ]


class LogRecorder(RoundCallback):
    """The clients' per-step training logs, by round, and what each client trainer starts with."""

    def __init__(self):
        self.round_idx = None
        self.logs: dict[int, list[dict]] = {}
        self.reference_adapters: dict[int, list[dict]] = {}

    def on_round_begin(self, args, round_idx, **kwargs):
        self.round_idx = round_idx

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if "ref" in model.peft_config:
            state_dict = get_peft_model_state_dict(model, adapter_name="ref")
            self.reference_adapters.setdefault(self.round_idx, []).append(
                {key: value.detach().clone() for key, value in state_dict.items()}
            )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.logs.setdefault(self.round_idx, []).append(dict(logs))


def run_federation(tiny_model_dir, tokenizer, args, model=None, num_clients=2):
    recorder = LogRecorder()
    runner = FederatedRunner(
        model if model is not None else AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args,
        client_datasets(num_clients), processing_class=tokenizer, callbacks=[recorder],
    )
    initial = {key: value.clone() for key, value in runner.global_state.items()}
    history = runner.run()
    return runner, recorder, initial, history


# 1. The local learning-rate schedule -------------------------------------------------------------------------


def reference_schedule(name: str, warmup_steps: int, total_steps: int, learning_rate: float) -> list[float]:
    """The learning rate of each of `total_steps` steps under `name`, as a single uninterrupted schedule."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=learning_rate)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)
    rates = []
    for _ in range(total_steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


def test_local_learning_rate_is_constant_by_default():
    assert FedGRPOConfig(output_dir="unused", use_cpu=True, bf16=False).lr_scheduler_type == "constant"


def test_local_schedule_runs_once_over_the_federation(tiny_model_dir, tiny_tokenizer, fast_args):
    """Local step e of round t gets the configured schedule's value at t·E + e, in every client."""
    rounds, steps = 2, 3
    args = fast_args(
        num_rounds=rounds, local_steps=steps, reward_window=1, lr_scheduler_type="linear", warmup_steps=2,
        aggregation="fedavg",
    )
    _, recorder, _, _ = run_federation(tiny_model_dir, tiny_tokenizer, args)
    expected = reference_schedule("linear", 2, rounds * steps, args.learning_rate)
    for round_idx in range(rounds):
        logged = [entry["learning_rate"] for entry in recorder.logs[round_idx]]
        per_client = expected[round_idx * steps:(round_idx + 1) * steps]
        assert logged == pytest.approx(per_client * 2, rel=1e-6), f"round {round_idx}"


def test_constant_schedule_keeps_the_local_step_size(tiny_model_dir, tiny_tokenizer, fast_args):
    _, recorder, _, _ = run_federation(tiny_model_dir, tiny_tokenizer, fast_args(aggregation="fedavg"))
    rates = [entry["learning_rate"] for logs in recorder.logs.values() for entry in logs]
    assert len(rates) == 2 * 2 * 2 and set(rates) == {fast_args().learning_rate}


def test_schedule_that_is_not_a_function_of_the_step_is_refused(tiny_model_dir, tiny_tokenizer, fast_args):
    args = fast_args(num_rounds=1, lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="steps", eval_steps=1)
    with pytest.raises(NotEnoughClientsError, match="cannot continue across rounds"):
        run_federation(tiny_model_dir, tiny_tokenizer, args)


# 2. A fixed KL reference ----------------------------------------------------------------------------------------


def test_kl_reference_is_the_initial_adapter_in_every_round(tiny_model_dir, tiny_tokenizer, fast_args):
    runner, recorder, initial, _ = run_federation(tiny_model_dir, tiny_tokenizer, fast_args(beta=0.1))
    # every client trainer of every round scores against θ^{[0]} ...
    assert set(recorder.reference_adapters) == {0, 1}
    for adapters in recorder.reference_adapters.values():
        assert len(adapters) == 2
        for adapter in adapters:
            assert all(torch.equal(adapter[key], initial[key]) for key in initial)
    # ... so the KL term is 0 only where the policy is θ^{[0]}: the first step of round 0, not of round 1
    assert recorder.logs[0][0]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert recorder.logs[1][0]["kl"] > 1e-5
    assert "ref" not in runner.model.peft_config  # released with each trainer


def test_kl_reference_of_a_pretrained_adapter_is_that_adapter(tiny_model_dir, tiny_tokenizer, fast_args):
    """Federating an adapter that already moves the model: π_ref is that adapter, as in one-process TRL."""
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False),
    )
    _, recorder, initial, _ = run_federation(tiny_model_dir, tiny_tokenizer, fast_args(beta=0.1), model=model)
    assert any(value.abs().sum() > 0 for key, value in initial.items() if "lora_B" in key)
    assert all(torch.equal(recorder.reference_adapters[1][0][key], initial[key]) for key in initial)
    assert recorder.logs[0][0]["kl"] == pytest.approx(0.0, abs=1e-7)


def test_a_users_adapter_named_ref_is_kept(tiny_model_dir, tiny_tokenizer, fast_args):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    model.add_adapter("ref", lora)
    own = {key: value.clone() for key, value in get_peft_model_state_dict(model, adapter_name="ref").items()}
    runner, _, _, _ = run_federation(tiny_model_dir, tiny_tokenizer, fast_args(num_rounds=1), model=model)
    assert "ref" in runner.model.peft_config
    kept = get_peft_model_state_dict(runner.model, adapter_name="ref")
    assert all(torch.equal(kept[key], own[key]) for key in own)

    # with a KL term TRL would overwrite it: refused by name
    with pytest.raises(NotEnoughClientsError, match="adapter named 'ref'"):
        args = fast_args(num_rounds=1, beta=0.1, overwrite_output_dir=True)
        run_federation(tiny_model_dir, tiny_tokenizer, args, model=runner.model)


# 3. Baselines that are what they are called -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("aggregation", "optimizer", "learning_rate"),
    [("rpg", ServerSGD, 1.0), ("fedavg", ServerSGD, 1.0), ("fedprox", ServerSGD, 1.0), ("scaffold", ServerSGD, 1.0)],
)
def test_server_optimizer_follows_the_method(aggregation, optimizer, learning_rate, caplog):
    """Each method's server step: the weighted mean (FGRPO's chosen by experiment, the others' by their papers)."""
    args = FedGRPOConfig(
        output_dir="unused", use_cpu=True, bf16=False, aggregation=aggregation, num_clients=2, learning_rate=1e-4
    )
    with caplog.at_level(logging.INFO, logger="trl_federated.aggregation"):
        aggregator = aggregator_from_config(args)
    assert type(aggregator.server_optimizer) is optimizer
    assert aggregator.server_optimizer.learning_rate == learning_rate
    assert f"server optimizer {args.server_optimizer!r}" in caplog.text


def test_without_rpg_ablation_stays_selectable():
    args = FedGRPOConfig(output_dir="unused", use_cpu=True, bf16=False, aggregation="fedavg", server_optimizer="adam")
    aggregator = aggregator_from_config(args)
    assert isinstance(aggregator, FedAvgAggregator) and isinstance(aggregator.server_optimizer, ServerAdam)
    assert aggregator.server_optimizer.learning_rate == args.derived_server_learning_rate() == 5e-6
    rpg = aggregator_from_config(FedGRPOConfig(output_dir="unused", use_cpu=True, bf16=False, server_optimizer="sgd"))
    assert isinstance(rpg, RPGAggregator) and isinstance(rpg.server_optimizer, ServerSGD)


def test_fedavg_round_is_the_weighted_mean_of_the_clients(tiny_model_dir, tiny_tokenizer, fast_args):
    """With the default server step, FedAvg's global adapter is exactly Σ (n_i / n) θ_i."""
    captured = []

    class Updates(RoundCallback):
        def on_client_end(self, args, round_idx, update, **kwargs):
            captured.append(update)

    args = fast_args(num_rounds=1, aggregation="fedavg")
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args,
        [client_datasets(1, 8)[0], client_datasets(2, 12)[1]], processing_class=tiny_tokenizer, callbacks=[Updates()],
    )
    runner.run()
    total = sum(update.num_samples for update in captured)
    for key, value in runner.global_state.items():
        mean = sum(update.state[key] * update.num_samples / total for update in captured)
        torch.testing.assert_close(value, mean, rtol=1e-5, atol=1e-7)


# 4. The paper's objective --------------------------------------------------------------------------------------


def test_loss_is_the_papers_per_sequence_normalised_grpo():
    common = dict(output_dir="unused", use_cpu=True, bf16=False)
    assert FedGRPOConfig(**common).loss_type == "grpo"
    assert FedDAPOConfig(**common).loss_type == "dapo"
    assert FedGSPOConfig(**common).loss_type == "grpo"


# 5. R̄ from TRL's logs, and a window that can see local progress ----------------------------------------------


def test_reward_is_read_from_trls_logs_not_its_internals():
    from trl_federated import FederatedGRPOMixin

    # the mixin holds everything FedGRPOTrainer adds to GRPOTrainer
    assert FedGRPOTrainer.__mro__[1] is FederatedGRPOMixin
    for cls in (FedGRPOTrainer, FederatedGRPOMixin):
        assert "_generate_and_score_completions" not in cls.__dict__


def test_clients_log_every_step_whatever_the_users_logging_steps(tiny_model_dir, tiny_tokenizer, fast_args):
    args = fast_args(num_rounds=1, local_steps=3, reward_window=3, logging_steps=50)
    _, recorder, _, history = run_federation(tiny_model_dir, tiny_tokenizer, args)
    logged = [entry["reward"] for entry in recorder.logs[0]]
    step_rewards = [r for metrics in history[0].client_metrics.values() for r in metrics["step_rewards"]]
    assert step_rewards == pytest.approx(logged) and len(logged) == 6


def test_window_that_only_sees_the_global_models_generations_is_warned(
    tiny_model_dir, tiny_tokenizer, fast_args, caplog
):
    common = dict(output_dir="unused", use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4)
    blind = FedGSPOConfig(**common, local_steps=4, reward_window=2)
    (message,) = blind.federation_warnings()
    assert "`local_steps` (4)" in message and "`steps_per_generation` (4)" in message
    assert FedGSPOConfig(**common, local_steps=10, reward_window=5).federation_warnings() == []
    assert FedGRPOConfig(**common, local_steps=2, reward_window=2).federation_warnings() == []
    assert "lower `steps_per_generation` towards `gradient_accumulation_steps` (1)" in message
    (iterated,) = FedGRPOConfig(**common, local_steps=2, reward_window=2, num_iterations=2).federation_warnings()
    # steps_per_generation is already 1: the advice names only what can change
    assert iterated.endswith("raise `local_steps` above 2 or lower `num_iterations`.")
    assert "lower `steps_per_generation`" not in iterated

    with caplog.at_level(logging.WARNING, logger="trl_federated.runner"):
        FederatedRunner(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward,
            fast_args(local_steps=2, reward_window=2, steps_per_generation=2), client_datasets(),
            processing_class=tiny_tokenizer,
        )
    assert "R̄ measures θ^{[t]}" in caplog.text


def test_sigma_bounds_warn_on_a_wider_reward_scale(fast_args):
    def points(completions, **kwargs):
        return [0.0] * len(completions)

    points.reward_range = (0.0, 10.0)
    args = fast_args()
    from trl_federated.scoring.rewards import combined_reward_range

    (message,) = args.federation_warnings(combined_reward_range([points], None))
    assert "rpg_sigma_min" in message and "rpg_sigma_max" in message and "[0.0, 10.0]" in message
    assert fast_args().federation_warnings((0.0, 1.0)) == []
    assert fast_args(aggregation="fedavg").federation_warnings((0.0, 10.0)) == []


def test_trainer_schedule_fields_a_federation_ignores_are_warned(fast_args):
    steps, evaluation = fast_args(max_steps=100, eval_strategy="steps", eval_steps=10).federation_warnings()
    assert "`max_steps` (100) is ignored" in steps and "`local_steps`" in steps and "`num_rounds`" in steps
    assert "`eval_strategy` (steps) is ignored" in evaluation and "`eval_every`" in evaluation
    assert fast_args().federation_warnings() == []
