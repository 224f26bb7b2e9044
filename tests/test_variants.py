"""Baselines and GRPO-family variants on the tiny model: FedProx's gradient, DAPO/GSPO federated rounds."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from conftest import length_reward
from trl_federated import FedGRPOConfig, FederatedRunner, FedGRPOTrainer
from trl_federated.aggregation import FedAvgAggregator, aggregator_from_config
from trl_federated.config import FedDAPOConfig, FedGSPOConfig
from trl_federated.runner import default_lora_config

PROMPTS = Dataset.from_dict({"prompt": [f"Question {i}: add {i} and {i + 3}." for i in range(16)]})


class GradientProbe(TrainerCallback):
    def __init__(self):
        self.grads, self.params = [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.grads.append([p.grad.detach().clone() for p in trainable])
        self.params.append([p.detach().clone() for p in trainable])


def test_fedprox_adds_mu_times_distance_to_round_start(tiny_model_dir, tiny_tokenizer, fast_args):
    mu = 0.5
    args = fast_args(aggregation="fedprox", fedprox_mu=mu, max_steps=3, disable_tqdm=True)
    before, after = GradientProbe(), GradientProbe()
    trainer = FedGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward, args=args,
        train_dataset=PROMPTS, processing_class=tiny_tokenizer, peft_config=default_lora_config(), callbacks=[before],
    )
    trainer.add_callback(after)  # runs after the proximal term, `before` runs ahead of it
    trainer.train()
    start = before.params[0]
    assert len(before.grads) == 3
    for step in range(3):
        for g0, g1, theta, theta0 in zip(before.grads[step], after.grads[step], after.params[step], start):
            torch.testing.assert_close(g1 - g0, mu * (theta - theta0))
    # the term is not vacuous: after the first step the adapter has moved away from the round start
    assert any(not torch.equal(t, t0) for t, t0 in zip(after.params[2], start))


def test_fedprox_aggregates_like_fedavg(fast_args):
    args = fast_args(aggregation="fedprox")
    assert args.fedprox_mu == 0.01
    assert isinstance(aggregator_from_config(args), FedAvgAggregator)
    assert fast_args().fedprox_mu == 0.0


def test_dapo_and_gspo_recipes():
    dapo = FedDAPOConfig(output_dir="unused", bf16=False)
    assert (dapo.loss_type, dapo.epsilon_high, dapo.mask_truncated_completions, dapo.beta) == ("dapo", 0.28, True, 0.0)
    gspo = FedGSPOConfig(output_dir="unused", bf16=False)
    assert (gspo.importance_sampling_level, gspo.epsilon, gspo.epsilon_high) == ("sequence", 3e-4, 4e-4)
    assert gspo.steps_per_generation > 1  # off-policy steps, or GSPO's ratio is always 1
    assert isinstance(dapo, FedGRPOConfig) and dapo.reward_window == 5


@pytest.mark.parametrize("config_class", [FedDAPOConfig, FedGSPOConfig])
@pytest.mark.parametrize("aggregation", ["rpg", "fedavg"])
def test_variant_trains_one_federated_round(tmp_path, tiny_model_dir, tiny_tokenizer, config_class, aggregation):
    args = config_class(
        output_dir=str(tmp_path), bf16=False, use_cpu=True, gradient_checkpointing=False, report_to="none",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=12, learning_rate=1e-2,
        num_rounds=1, local_steps=2, reward_window=2, aggregation=aggregation, server_optimizer="adam",
    )
    clients = [PROMPTS.select(range(0, 8)), PROMPTS.select(range(8, 16))]
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args, clients,
        processing_class=tiny_tokenizer,
    )
    initial = {key: value.clone() for key, value in runner.global_state.items()}
    (record,) = runner.run()
    assert set(record.rewards) == {"client_0", "client_1"}
    assert all(len(m["step_rewards"]) == 2 for m in record.client_metrics.values())
    assert any(not torch.equal(initial[k], runner.global_state[k]) for k in initial)
