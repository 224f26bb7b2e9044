"""The frozen projections cast once to the autocast dtype (`local.frozen_casts`): under bf16 autocast, the same
log-probabilities and LoRA gradients bit for bit as autocast's per-call casts, through the projections and TRL's fused
LM head; each weight cast once while it stays as it is; nothing changed outside autocast or after the context."""

import contextlib

import torch
from accelerate.state import AcceleratorState
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl.trainer.utils import add_fused_lm_head

from conftest import FAST_GRPO, length_reward
from trl_federated import FedGRPOConfig, FedGRPOTrainer
from trl_federated.local import speedups
from trl_federated.local.frozen_casts import FrozenCasts, autocast_dtype, cast_once

BF16 = torch.bfloat16


def lora_model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    add_fused_lm_head(model)
    # init_lora_weights=False: a random B, so that every LoRA matrix gets a gradient.
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))


def log_probs_and_gradients(model, casts: FrozenCasts | None):
    """The shared prefix's two kinds of call under bf16 autocast: a prompt pass keeping one position's logits, and the
    fused head's log-probabilities; the backward runs after the context has closed."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 128, (3, 12), generator=generator)
    model.zero_grad()
    with cast_once(model, casts, BF16) if casts is not None else torch.autocast("cpu", enabled=False):
        with torch.autocast("cpu", dtype=BF16):
            last_logits = model(input_ids=input_ids[:, :-1], logits_to_keep=1).logits
            log_probs = model(input_ids=input_ids, labels=input_ids, fused_lm_head=True).log_probs
    (log_probs.sum() + last_logits.float().logsumexp(-1).sum()).backward()
    gradients = {name: param.grad.clone() for name, param in model.named_parameters() if param.requires_grad}
    return last_logits.detach(), log_probs.detach(), gradients


def test_the_same_log_probabilities_and_gradients_bit_for_bit():
    model = lora_model()
    logits, log_probs, gradients = log_probs_and_gradients(model, None)
    casts = FrozenCasts()
    for _ in range(2):  # the first call casts, the second reuses the casts
        cast_logits, cast_log_probs, cast_gradients = log_probs_and_gradients(model, casts)
        assert torch.equal(cast_log_probs, log_probs)
        assert torch.allclose(cast_logits, logits, rtol=1e-2)  # a one-row product: another kernel, same operands
        assert gradients.keys() == cast_gradients.keys() and len(gradients) == 2 * 2 * 7
        for name, gradient in gradients.items():
            assert gradient.norm() > 0 and torch.equal(cast_gradients[name], gradient), name


def test_each_frozen_weight_is_cast_once_while_it_stays_the_same():
    model = lora_model()
    casts = FrozenCasts()
    log_probs_and_gradients(model, casts)
    frozen = [
        module for module in model.modules() if type(module) is torch.nn.Linear and not module.weight.requires_grad
    ]
    first = {module: casts.weight(module, BF16) for module in frozen}
    assert len(frozen) == 2 * 7 + 1  # the projections and the LM head
    log_probs_and_gradients(model, casts)
    assert all(casts.weight(module, BF16) is cast for module, cast in first.items())
    projection = frozen[0]
    with torch.no_grad():
        projection.weight.add_(1.0)  # changed in place: cast again
    assert torch.equal(casts.weight(projection, BF16), projection.weight.to(BF16))


def test_nothing_changes_outside_autocast_or_after_the_context():
    model = lora_model()
    head_weight = model.get_output_embeddings().weight
    input_ids = torch.arange(10).view(2, 5)
    with torch.no_grad():
        plain = model(input_ids=input_ids).logits
        with cast_once(model, FrozenCasts()):
            inside = model(input_ids=input_ids).logits  # no autocast: float32 weights
    assert torch.equal(inside, plain) and inside.dtype == torch.float32
    with cast_once(model, FrozenCasts(), BF16):
        assert model.get_output_embeddings().weight.dtype == BF16  # what the fused head reads, under autocast only
    assert model.get_output_embeddings().weight is head_weight
    assert not any("forward" in vars(module) for module in model.modules() if isinstance(module, torch.nn.Linear))


def test_autocast_dtype_reads_what_an_autocast_context_casts_to():
    assert autocast_dtype(lambda: torch.autocast("cpu", dtype=BF16), "cpu") == BF16
    assert autocast_dtype(lambda: torch.autocast("cpu", enabled=False), "cpu") is None


def test_a_trainer_with_the_speedups_casts_once_with_the_same_loss_and_gradients(tmp_path, tiny_model_dir, monkeypatch):
    """`FastGRPOMixin`'s loss under bf16 autocast (`bf16=True` on the CPU): the casts kept, the loss and the adapter
    gradients those of autocast's per-call casts bit for bit, through the shared prefix and TRL's fused head."""
    AcceleratorState._reset_state(reset_partial_state=True)  # the mixed precision is the process's
    args = FedGRPOConfig(**{**FAST_GRPO, "bf16": True}, output_dir=str(tmp_path), shared_prefix=True, max_steps=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer = FedGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": ["What is 1 + 2?", "Name a colour."]}), processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False),
    )  # fmt: skip
    try:
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by the training loop
        prompt_ids = tokenizer(["What is 1 + 2?"] * 4, return_tensors="pt").input_ids
        completion_ids = torch.randint(3, len(tokenizer), (4, 6), generator=torch.Generator().manual_seed(0))
        batch = {
            "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
            "completion_mask": torch.ones_like(completion_ids), "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
            "num_items_in_batch": torch.tensor(24),
        }  # fmt: skip

        def loss_and_gradients():
            trainer.model.zero_grad()
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(trainer.model, batch)
            loss.backward()
            return loss.detach(), [param.grad.clone() for param in trainer.model.parameters() if param.requires_grad]

        with monkeypatch.context() as patch:
            patch.setattr(speedups, "cast_once", lambda *args: contextlib.nullcontext())
            loss, gradients = loss_and_gradients()
        assert not trainer._frozen_casts._casts
        cast_loss, cast_gradients = loss_and_gradients()
        assert len(trainer._frozen_casts._casts) == 2 * 7 + 1  # every frozen projection and the LM head
        assert torch.equal(cast_loss, loss) and len(gradients) == 2 * 2 * 7
        assert all(torch.equal(cast, gradient) for cast, gradient in zip(cast_gradients, gradients, strict=True))
        assert any(gradient.norm() > 0 for gradient in gradients)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
