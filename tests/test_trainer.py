import math

import pytest
from datasets import Dataset
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from conftest import FAST_GRPO, length_reward
from trl_federated import FedGRPOTrainer

PROMPTS = Dataset.from_dict({"prompt": [f"What is {i} + {2 * i}?" for i in range(16)]})
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")


def grpo_args(tmp_path, config_class=GRPOConfig, **overrides):
    values = dict(FAST_GRPO, output_dir=str(tmp_path), max_steps=4, seed=7, disable_tqdm=True)
    values.update(overrides)
    return config_class(**values)


def train_log(trainer_class, model_dir, tokenizer, args):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = trainer_class(
        model=model, reward_funcs=length_reward, args=args, train_dataset=PROMPTS, processing_class=tokenizer,
        peft_config=LORA,
    )
    trainer.train()
    return trainer, [
        {key: entry[key] for key in ("loss", "reward", "reward_std", "grad_norm")}
        for entry in trainer.state.log_history
        if "reward" in entry
    ]


def test_drop_in_trains_exactly_like_grpo_trainer(tmp_path, tiny_model_dir, tiny_tokenizer):
    _, reference = train_log(GRPOTrainer, tiny_model_dir, tiny_tokenizer, grpo_args(tmp_path / "a"))
    trainer, federated = train_log(FedGRPOTrainer, tiny_model_dir, tiny_tokenizer, grpo_args(tmp_path / "b"))
    assert len(reference) == 4
    assert federated == reference
    # and the recorded step rewards are the rewards TRL logged, step by step
    assert trainer.step_rewards == pytest.approx([entry["reward"] for entry in reference])


def test_window_reward_is_mean_of_last_w_steps(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args):
    from trl_federated import FedGRPOConfig

    args = grpo_args(tmp_path, FedGRPOConfig, max_steps=5, local_steps=5, reward_window=3)
    trainer, log = train_log(FedGRPOTrainer, tiny_model_dir, tiny_tokenizer, args)
    rewards = trainer.step_rewards
    assert len(rewards) == 5 and len(set(rewards)) > 1
    assert trainer.window_reward() == pytest.approx(sum(rewards[-3:]) / 3)
    assert trainer.window_reward(1) == pytest.approx(rewards[-1])


def test_step_reward_of_reused_generations(tmp_path, tiny_model_dir, tiny_tokenizer):
    """With num_iterations=2 each generation batch trains two optimisation steps; both are credited with it."""
    args = grpo_args(tmp_path, max_steps=4, num_iterations=2)
    trainer, log = train_log(FedGRPOTrainer, tiny_model_dir, tiny_tokenizer, args)
    rewards = trainer.step_rewards
    assert len(rewards) == 4 and not any(math.isnan(r) for r in rewards)
    assert rewards[0] == rewards[1] and rewards[2] == rewards[3]


def test_window_reward_before_training_is_an_error(tmp_path, tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    trainer = FedGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward,
        args=grpo_args(tmp_path), train_dataset=PROMPTS, processing_class=tiny_tokenizer, peft_config=LORA,
    )
    with pytest.raises(RuntimeError, match="train"):
        trainer.window_reward()
