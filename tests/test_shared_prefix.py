"""Shared-prefix log-probabilities give the standard GRPO loss and adapter gradients, for every loss, with and
without the KL term, on left-padded micro-batches of unequal prompts that hold partial, shuffled groups."""

import logging

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import use_adapter

from conftest import FAST_GRPO, FastFedGRPOTrainer, length_reward, relative_difference
from trl_federated import FastGRPOMixin, FedGRPOConfig
from trl_federated.local.shared_prefix import micro_batches_by_prompt, unsupported_reason

PROMPTS = Dataset.from_dict({"prompt": [f"What is {i} + {2 * i}?" for i in range(16)]})
TOLERANCE = 1e-5  # relative, float32
LOSSES = {
    "grpo": dict(loss_type="grpo"),
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
}


def make_trainer(tmp_path, model, tokenizer, **overrides):
    values = dict(FAST_GRPO, output_dir=str(tmp_path), max_steps=2, seed=3, disable_tqdm=True)
    values.update(overrides)
    # `FastGRPOMixin` joins a trainer's class only when its config turns a speed-up on: the trainer is built with the
    # mixin (`FastFedGRPOTrainer`) and `shared_prefix` as asked (off by default), which a test may switch per call.
    return FastFedGRPOTrainer(
        model=model, reward_funcs=length_reward, args=FedGRPOConfig(**values), train_dataset=PROMPTS,
        processing_class=tokenizer,
        # init_lora_weights=False: a random B, so that the adapter changes the logits and A gets a gradient too.
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False),
    )  # fmt: skip


def tiny_llama(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def micro_batch(vocab_size, pad_token_id, prompt_lengths=(5, 11, 8), num_generations=4, rows=10, completion_length=7):
    """A shuffled slice of a generation batch, as TRL's `_prepare_inputs` hands it to the loss: prompts left-padded
    to the longest, completions right-padded at random lengths, and groups split (3 x 4 rows, 10 kept)."""
    generator = torch.Generator().manual_seed(0)
    width = max(prompt_lengths)
    prompt_ids = torch.full((len(prompt_lengths) * num_generations, width), pad_token_id)
    prompt_mask = torch.zeros_like(prompt_ids)
    for group, length in enumerate(prompt_lengths):
        prompt = torch.randint(3, vocab_size, (length,), generator=generator)
        prompt_ids[group * num_generations : (group + 1) * num_generations, width - length :] = prompt
        prompt_mask[group * num_generations : (group + 1) * num_generations, width - length :] = 1
    order = torch.randperm(prompt_ids.size(0), generator=generator)[:rows]
    completion_ids = torch.randint(3, vocab_size, (rows, completion_length), generator=generator)
    lengths = torch.randint(1, completion_length + 1, (rows,), generator=generator)
    completion_mask = (torch.arange(completion_length) < lengths[:, None]).long()
    return {
        "prompt_ids": prompt_ids[order], "prompt_mask": prompt_mask[order],
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": torch.randn(rows, generator=generator),
        "num_items_in_batch": completion_mask.sum(),
    }  # fmt: skip


def sequence_inputs(batch):
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    return input_ids, torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)


def loss_and_gradients(trainer, batch, shared_prefix):
    trainer.args.shared_prefix = shared_prefix
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), [param.grad.clone() for param in trainer.model.parameters() if param.requires_grad]


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_loss_and_adapter_gradients_equal_the_standard_forward(tmp_path, tiny_model_dir, tiny_tokenizer, loss, beta):
    trainer = make_trainer(
        tmp_path, AutoModelForCausalLM.from_pretrained(tiny_model_dir), tiny_tokenizer, beta=beta, **LOSSES[loss]
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    batch = micro_batch(len(tiny_tokenizer), tiny_tokenizer.pad_token_id)
    input_ids, attention_mask = sequence_inputs(batch)
    logits_to_keep = batch["completion_ids"].size(1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, logits_to_keep
        )
    generator = torch.Generator().manual_seed(1)
    # Off-policy and reference log-probabilities near the policy's, so that ratios, clipping and the KL all act.
    batch["old_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=generator)
    batch["ref_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=generator)

    reference_loss, reference_gradients = loss_and_gradients(trainer, batch, shared_prefix=False)
    shared_loss, shared_gradients = loss_and_gradients(trainer, batch, shared_prefix=True)

    assert relative_difference(shared_loss, reference_loss) <= TOLERANCE
    assert len(shared_gradients) == 2 * 2 * 7  # lora_A and lora_B of 7 projections in 2 layers
    assert all(gradient.norm() > 0 for gradient in reference_gradients)
    assert max(map(relative_difference, shared_gradients, reference_gradients)) <= TOLERANCE
    stats = trainer.shared_prefix_stats
    assert stats.rows == 10 and stats.prompt_rows == 3 and not stats.fallbacks  # 10 rows, 3 prompt passes


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_old_and_reference_logps_in_chunks_that_split_groups(tmp_path, tiny_model_dir, tiny_tokenizer, architecture):
    """The no-grad passes of the old (num_iterations > 1) and reference (beta > 0, adapter disabled) log-probs,
    in chunks of `batch_size` rows, as `_generate_and_score_completions` runs them."""
    if architecture == "qwen2":
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    else:
        model = tiny_llama(tiny_tokenizer)
    trainer = make_trainer(tmp_path, model, tiny_tokenizer)
    batch = micro_batch(len(tiny_tokenizer), tiny_tokenizer.pad_token_id, prompt_lengths=(2, 13, 6))
    input_ids, attention_mask = sequence_inputs(batch)
    logits_to_keep = batch["completion_ids"].size(1)

    def logps(shared_prefix):
        trainer.args.shared_prefix = shared_prefix
        return trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, logits_to_keep, batch_size=4
        )[0] * batch["completion_mask"]

    with torch.no_grad():
        assert relative_difference(logps(True), logps(False)) <= TOLERANCE
        with use_adapter(trainer.model, adapter_name=None):
            assert relative_difference(logps(True), logps(False)) <= TOLERANCE
    chunks = [batch["prompt_ids"][start : start + 4].tolist() for start in (0, 4, 8)]
    distinct_prompts = sum(len({tuple(row) for row in chunk}) for chunk in chunks)
    stats = trainer.shared_prefix_stats
    assert stats.rows == 2 * 10 and stats.prompt_rows == 2 * distinct_prompts and not stats.fallbacks


def test_training_with_shared_prefix_matches_standard(tmp_path, tiny_model_dir, tiny_tokenizer):
    """Two steps with the KL term and two iterations per generation batch (so old and reference log-probs are
    computed too): the same logs and the same adapter."""
    logs, adapters = [], []
    for shared_prefix in (False, True):
        trainer = make_trainer(
            tmp_path / str(shared_prefix), AutoModelForCausalLM.from_pretrained(tiny_model_dir), tiny_tokenizer,
            beta=0.04, num_iterations=2, shared_prefix=shared_prefix,
        )  # fmt: skip
        trainer.train()
        logs.append([
            {key: entry[key] for key in ("loss", "kl", "entropy", "clip_ratio/region_mean", "grad_norm")}
            for entry in trainer.state.log_history if "grad_norm" in entry
        ] + [trainer.step_rewards])  # fmt: skip
        adapters.append([param.detach().clone() for param in trainer.model.parameters() if param.requires_grad])
    stats = trainer.shared_prefix_stats
    # one generation batch, scored by the old and the reference pass, and two loss passes: 4 rows of 1 prompt each
    assert stats.rows == 2 * 4 + 2 * 4 and stats.prompt_rows == 2 + 2 and not stats.fallbacks
    assert len(logs[0]) == 3 and logs[0][1]["clip_ratio/region_mean"] > 0  # the second step is off-policy
    for standard, shared in zip(*logs):
        assert shared == pytest.approx(standard, rel=1e-4, abs=1e-6)
    assert max(map(relative_difference, adapters[1], adapters[0])) <= 1e-4


def test_fallback_is_exact_counted_and_logged_once(tmp_path, tiny_model_dir, tiny_tokenizer, caplog):
    trainer = make_trainer(tmp_path, AutoModelForCausalLM.from_pretrained(tiny_model_dir), tiny_tokenizer)
    trainer.model.activation_checkpointing_enable({"use_reentrant": False})  # as `train()` does when asked to
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = micro_batch(len(tiny_tokenizer), tiny_tokenizer.pad_token_id)
    with caplog.at_level(logging.WARNING, logger="trl_federated.local.shared_prefix"):
        shared = [loss_and_gradients(trainer, batch, shared_prefix=True)[0] for _ in range(2)]
    standard, _ = loss_and_gradients(trainer, batch, shared_prefix=False)
    assert shared == [standard, standard]
    assert trainer.shared_prefix_stats.fallbacks == {"gradient checkpointing": 2}
    assert trainer.shared_prefix_stats.rows == 0
    assert [record.message.count("gradient checkpointing") for record in caplog.records] == [1]


def test_unsupported_inputs_and_models_are_named(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert unsupported_reason(model, 8, False, {"pixel_values": None}) is None
    assert unsupported_reason(model, 8, False, {"pixel_values": torch.zeros(1)}) == "multimodal inputs"
    assert unsupported_reason(model, 8, True, {}).startswith("MoE")
    assert unsupported_reason(model, 1, False, {}) == "prompts of fewer than 2 tokens"
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert unsupported_reason(model, 8, False, {}) == "model without a full-attention key/value cache"


def test_active_dropout_falls_back(tiny_model_dir):
    """A prompt's K rows would share one dropout mask: exact only without dropout, or in eval mode."""
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.05),
    )
    model.train()
    assert unsupported_reason(model, 8, False, {}).startswith("active dropout")
    model.eval()
    assert unsupported_reason(model, 8, False, {}) is None


def test_micro_batches_are_recut_by_prompt_with_their_rows_intact():
    """Two micro-batches of a shuffled generation batch of 2 prompts x 4: re-cut, each holds one prompt, and every
    per-row value still belongs to its row."""
    prompts = torch.tensor([[0, 5, 6]] * 4 + [[7, 8, 9]] * 4)
    shuffled = torch.tensor([0, 4, 5, 1, 2, 6, 7, 3])
    generation = {
        "prompt_ids": prompts[shuffled], "prompt_mask": (prompts[shuffled] > 0).long(),
        "completion_ids": shuffled[:, None] * 10, "advantages": shuffled.float(), "rows": shuffled.tolist(),
        "num_items_in_batch": torch.tensor(40), "old_per_token_logps": None,
    }  # fmt: skip
    per_row = ("prompt_ids", "prompt_mask", "completion_ids", "advantages", "rows")
    micro_batches = [
        {key: value[start : start + 4] if key in per_row else value for key, value in generation.items()}
        for start in (0, 4)
    ]
    regrouped = micro_batches_by_prompt(micro_batches)
    assert [batch["rows"] for batch in regrouped] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for batch in regrouped:
        assert len({tuple(row) for row in batch["prompt_ids"].tolist()}) == 1
        assert batch["completion_ids"][:, 0].tolist() == [row * 10 for row in batch["rows"]]
        assert batch["advantages"].tolist() == [float(row) for row in batch["rows"]]
        assert batch["num_items_in_batch"] == 40 and batch["old_per_token_logps"] is None


@pytest.mark.parametrize("loss", ["grpo", "dapo"])
def test_training_in_micro_batches_grouped_by_prompt_matches_standard(tmp_path, tiny_model_dir, tiny_tokenizer, loss):
    """Micro-batches of 4 rows and 2 accumulation steps: with shared_prefix each prompt is computed once per step
    (its micro-batches are re-cut by prompt), and the logs and adapter are those of the standard computation."""
    logs, adapters = [], []
    for shared_prefix in (False, True):
        trainer = make_trainer(
            tmp_path / str(shared_prefix), AutoModelForCausalLM.from_pretrained(tiny_model_dir), tiny_tokenizer,
            gradient_accumulation_steps=2, shared_prefix=shared_prefix, **LOSSES[loss],
        )  # fmt: skip
        trainer.train()
        logs.append([
            {key: entry[key] for key in ("loss", "reward", "entropy", "grad_norm")}
            for entry in trainer.state.log_history if "grad_norm" in entry
        ])  # fmt: skip
        adapters.append([param.detach().clone() for param in trainer.model.parameters() if param.requires_grad])
    stats = trainer.shared_prefix_stats
    assert stats.rows == 2 * 8 and stats.prompt_rows == 2 * 2 and not stats.fallbacks  # 2 steps of 2 prompts x 4
    assert len(logs[0]) == 2
    for standard, shared in zip(*logs):
        assert shared == pytest.approx(standard, rel=1e-4, abs=1e-6)
    assert max(map(relative_difference, adapters[1], adapters[0])) <= 1e-4


class FastGRPOTrainer(FastGRPOMixin, GRPOTrainer):
    """TRL's GRPOTrainer with the speed-ups, and no federation."""


def test_a_plain_grpo_trainer_with_the_speedups_trains_like_grpo_trainer(tmp_path, tiny_model_dir, tiny_tokenizer):
    """`FastGRPOMixin` on `GRPOTrainer`, with `shared_prefix` and `recompute_gated_mlp` set on a plain `GRPOConfig`:
    two steps of 2 accumulated micro-batches with the KL term give GRPOTrainer's logs and adapter, each prompt
    computed once per pass (its micro-batches re-cut by prompt)."""
    logs, adapters = [], []
    for trainer_class in (GRPOTrainer, FastGRPOTrainer):
        args = GRPOConfig(
            **FAST_GRPO, output_dir=str(tmp_path / trainer_class.__name__), max_steps=2, seed=3, disable_tqdm=True,
            beta=0.04, gradient_accumulation_steps=2,
        )  # fmt: skip
        if trainer_class is FastGRPOTrainer:
            args.shared_prefix = args.recompute_gated_mlp = True
        trainer = trainer_class(
            model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward, args=args,
            train_dataset=PROMPTS, processing_class=tiny_tokenizer,
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False),
        )  # fmt: skip
        trainer.train()
        logs.append([
            {key: entry[key] for key in ("loss", "reward", "kl", "entropy", "grad_norm")}
            for entry in trainer.state.log_history if "grad_norm" in entry
        ])  # fmt: skip
        adapters.append([param.detach().clone() for param in trainer.model.parameters() if param.requires_grad])
    stats = trainer.shared_prefix_stats
    # per step, 2 prompts x 4: the reference pass in chunks of 4 rows (one prompt each) and two regrouped loss passes
    assert stats.rows == 2 * (8 + 8) and stats.prompt_rows == 2 * (2 + 2) and not stats.fallbacks
    assert len(logs[0]) == 2 and logs[0][1]["kl"] > 0
    for standard, fast in zip(*logs):
        assert fast == pytest.approx(standard, rel=1e-4, abs=1e-6)
    assert max(map(relative_difference, adapters[1], adapters[0])) <= 1e-4
