"""`skip_zero_advantage_rows`: the loss without the rows whose advantage is 0 is the full micro-batch's loss, with the
same adapter gradients, for every loss it takes; a micro-batch with no other row still gives every parameter its
(zero) gradient; settings that give those rows a gradient keep the standard loss; and training is unchanged."""

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from conftest import FAST_GRPO, FastFedGRPOTrainer, relative_difference
from trl_federated import FastGRPOMixin, FedGRPOConfig, FedGRPOTrainer

PROMPTS = Dataset.from_dict({"prompt": [f"What is {i} + {2 * i}?" for i in range(16)]})
TOLERANCE = 1e-5  # relative, float32
LOSSES = {
    "grpo": dict(loss_type="grpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
}


def even_prompts_score_zero(completions, prompts, **_):
    """0 for every completion of an even-numbered prompt (a group that scored alike: advantage 0), the completion's
    length otherwise (a group with a learning signal)."""
    return [0.0 if int(prompt.split()[2]) % 2 == 0 else len(completion) / 64
            for completion, prompt in zip(completions, prompts, strict=True)]  # fmt: skip


def make_trainer(tmp_path, model_dir, tokenizer, **overrides):
    values = dict(FAST_GRPO, output_dir=str(tmp_path), max_steps=2, seed=3, disable_tqdm=True)
    values.update(overrides)
    return FastFedGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=even_prompts_score_zero,
        args=FedGRPOConfig(**values), train_dataset=PROMPTS, processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False),
    )  # fmt: skip


def micro_batch(tokenizer, advantages, completion_length=7):
    """A micro-batch of len(advantages) rows: three left-padded prompts, completions right-padded at random lengths."""
    generator = torch.Generator().manual_seed(0)
    rows = len(advantages)
    lengths = torch.tensor([5, 11, 8])[torch.arange(rows) % 3]
    width = int(lengths.max())
    prompt_ids = torch.full((rows, width), tokenizer.pad_token_id)
    prompt_mask = torch.zeros_like(prompt_ids)
    for row, length in enumerate(lengths.tolist()):
        prompt_ids[row, width - length :] = torch.randint(3, len(tokenizer), (length,), generator=generator)
        prompt_mask[row, width - length :] = 1
    completion_ids = torch.randint(3, len(tokenizer), (rows, completion_length), generator=generator)
    ends = torch.randint(1, completion_length + 1, (rows,), generator=generator)
    completion_mask = (torch.arange(completion_length) < ends[:, None]).long()
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": torch.tensor(advantages),
        "num_items_in_batch": completion_mask.sum() * 2,  # the generation batch's tokens: two such micro-batches
    }  # fmt: skip


def loss_and_gradients(trainer, batch, skip):
    trainer.args.skip_zero_advantage_rows = skip
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), [param.grad for param in trainer.model.parameters() if param.requires_grad]


@pytest.mark.parametrize("shared_prefix", [False, True])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_the_loss_without_its_zero_advantage_rows_is_the_micro_batchs(tmp_path, tiny_model_dir, tiny_tokenizer, loss,
                                                                      shared_prefix):
    trainer = make_trainer(tmp_path, tiny_model_dir, tiny_tokenizer, shared_prefix=shared_prefix, **LOSSES[loss])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # set by the training loop
    batch = micro_batch(tiny_tokenizer, [0.0, 0.8, 0.0, -1.1, 0.0, 0.0, 0.5, -0.2, 0.0, 1e-13])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off-policy log-probabilities, so that the ratios and the clipping act
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_ids"].size(1),
        )  # fmt: skip
    batch["old_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=generator)

    reference_loss, reference_gradients = loss_and_gradients(trainer, batch, skip=False)
    loss_value, gradients = loss_and_gradients(trainer, batch, skip=True)

    assert relative_difference(loss_value, reference_loss) <= TOLERANCE
    assert all(gradient.norm() > 0 for gradient in reference_gradients)
    assert max(map(relative_difference, gradients, reference_gradients)) <= TOLERANCE
    stats = trainer.zero_advantage_stats
    assert stats.rows == 10 and stats.skipped == 5 and not stats.fallbacks  # 1e-13 is not 0: that row is kept


@pytest.mark.parametrize("loss", ["grpo", "dapo"])
def test_a_micro_batch_without_informative_rows_gives_every_parameter_a_zero_gradient(tmp_path, tiny_model_dir,
                                                                                      tiny_tokenizer, loss):
    trainer = make_trainer(tmp_path, tiny_model_dir, tiny_tokenizer, **LOSSES[loss])
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    loss_value, gradients = loss_and_gradients(trainer, micro_batch(tiny_tokenizer, [0.0] * 6), skip=True)
    assert loss_value == 0.0
    assert len(gradients) == 2 * 2 * 7 and all(torch.equal(g, torch.zeros_like(g)) for g in gradients)
    assert trainer.zero_advantage_stats.skipped == 5  # one row of six ran, its loss × 0


def test_settings_that_give_zero_advantage_rows_a_gradient_keep_the_standard_loss(tmp_path, tiny_model_dir,
                                                                                    tiny_tokenizer, caplog):
    trainer = make_trainer(tmp_path, tiny_model_dir, tiny_tokenizer, beta=0.04)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = micro_batch(tiny_tokenizer, [0.0, 0.8, 0.0, -1.1])
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_ids"].size(1),
        )  # fmt: skip
    batch["ref_per_token_logps"] = logps + 0.3  # a KL term with a gradient on every row
    reference_loss, reference_gradients = loss_and_gradients(trainer, batch, skip=False)
    for _ in range(2):
        loss_value, gradients = loss_and_gradients(trainer, batch, skip=True)
        assert torch.equal(loss_value, reference_loss)
        assert all(map(torch.equal, gradients, reference_gradients))
    stats = trainer.zero_advantage_stats
    assert stats.skipped == 0 and stats.fallbacks == {"a KL term (beta != 0): every row has a gradient": 2}
    assert caplog.text.count("keeps its zero-advantage rows") == 1


def test_training_without_zero_advantage_rows_matches_standard(tmp_path, tiny_model_dir, tiny_tokenizer):
    """Two steps of two micro-batches (2 prompts x 4): the same losses, gradient norms, rewards and adapter, with
    rows left out."""
    logs, adapters = [], []
    for skip in (False, True):
        trainer = make_trainer(tmp_path / str(skip), tiny_model_dir, tiny_tokenizer, gradient_accumulation_steps=2,
                               shared_prefix=True, skip_zero_advantage_rows=skip)  # fmt: skip
        trainer.train()
        logs.append([{key: entry[key] for key in ("loss", "grad_norm", "reward")}
                     for entry in trainer.state.log_history if "grad_norm" in entry])  # fmt: skip
        adapters.append([param.detach().clone() for param in trainer.model.parameters() if param.requires_grad])
    stats = trainer.zero_advantage_stats
    assert stats.rows == 2 * 2 * 4 and stats.skipped > 0 and not stats.fallbacks
    assert len(logs[0]) == 2 and logs[0][0]["grad_norm"] > 0
    for standard, skipped in zip(*logs, strict=True):
        assert skipped == pytest.approx(standard, rel=1e-4, abs=1e-6)
    assert max(map(relative_difference, adapters[1], adapters[0])) <= 1e-4


def test_a_compute_loss_override_below_the_mixin_is_refused(tmp_path, tiny_model_dir, tiny_tokenizer):
    class OwnLoss(FedGRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs)

    class FastOwnLoss(FastGRPOMixin, OwnLoss):
        pass

    args = FedGRPOConfig(**dict(FAST_GRPO, output_dir=str(tmp_path), skip_zero_advantage_rows=True))
    with pytest.raises(ValueError, match="`skip_zero_advantage_rows` wraps `_compute_loss`"):
        FastOwnLoss(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=even_prompts_score_zero,
                    args=args, train_dataset=PROMPTS, processing_class=tiny_tokenizer,
                    peft_config=LoraConfig(r=4, target_modules="all-linear"))  # fmt: skip
