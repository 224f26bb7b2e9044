"""Fast generation (`fast_generation=True`) against TRL's transformers generation and the standard evaluation.

What is exact and what has a tolerance:
- float32 merged copy: its logits equal the adapted model's within 1e-5 (relative to the largest logit);
- float32 shared prefill: greedy completions are token for token those of `generate` on the adapted model, and
  sampled completions (temperature, top-k, top-p, min-p, repetition penalty) too under the same seed (a draw within
  rounding of a sampling boundary could differ: the seeds here have none);
- packed projections (CPU): bfloat16 products bit for bit `torch.nn.functional.linear`'s, float32 within 1e-5;
- bfloat16 copy: teacher-forced per-token log-probabilities within 0.05 of float32's (mean within 0.01).
"""

import logging
import os
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, GenerationConfig
from trl import GRPOTrainer

from conftest import FAST_GRPO, FastFedGRPOTrainer, length_reward
from trl_federated import FastGRPOMixin, FedGRPOConfig, FedGRPOTrainer
from trl_federated.core.evaluation import evaluate_accuracy
from trl_federated.local.fast_generation import (
    FastGenerationStats,
    MergedGenerationModel,
    PackedLinear,
    packs_linears,
    resolve_generation_dtype,
    shared_prefill_generate,
    unsupported_reason,
)
from trl_federated.runtime.devices import has_native_bf16

PROMPTS = Dataset.from_dict({"prompt": [f"What is {i} + {2 * i}?" for i in range(16)]})
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)  # random B: it matters


def adapted(tiny_model_dir, **lora):
    torch.manual_seed(0)
    config = LoraConfig(**{**LORA.to_dict(), **lora}) if lora else LORA
    return get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config).eval()


def grouped_prompts(tokenizer, num_generations=4):
    """Three prompts of unequal lengths, each repeated `num_generations` times, left-padded, rows shuffled."""
    tokenizer.padding_side = "left"
    texts = ["What is 1 + 2?", "Name a prime number larger than twenty", "Hi"]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    order = torch.randperm(len(texts) * num_generations, generator=torch.Generator().manual_seed(0))
    ids = inputs["input_ids"].repeat_interleave(num_generations, 0)[order]
    return ids, inputs["attention_mask"].repeat_interleave(num_generations, 0)[order]


def generation_config(tokenizer, **sampling):
    return GenerationConfig(
        max_new_tokens=12, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        disable_compile=True, **(sampling or {"do_sample": False}),
    )  # fmt: skip


def test_merged_copy_follows_the_adapter(tiny_model_dir, tiny_tokenizer):
    model = adapted(tiny_model_dir)
    merged = MergedGenerationModel(model, torch.float32)
    ids, mask = grouped_prompts(tiny_tokenizer)
    for _ in range(2):  # a changed adapter is picked up by the next refresh
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).logits
            logits = merged.refresh()(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()  # a padding position attends to nothing: eager and sdpa attention fill it differently
        assert (logits[real] - expected[real]).abs().max() <= 1e-5 * expected[real].abs().max()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_" in name:
                    parameter.add_(0.1 * torch.randn_like(parameter))
    assert not any(name for name, _ in merged.model.named_modules() if "lora" in name)


@pytest.mark.parametrize(
    "sampling",
    [
        None,
        dict(do_sample=True, temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1),
        dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0),
    ],
    ids=["greedy", "all-processors", "plain-sampling"],
)
def test_shared_prefill_gives_generates_tokens(tiny_model_dir, tiny_tokenizer, sampling):
    model = adapted(tiny_model_dir)
    ids, mask = grouped_prompts(tiny_tokenizer)
    config = generation_config(tiny_tokenizer, **(sampling or {}))
    stats = FastGenerationStats()
    with torch.no_grad():
        torch.manual_seed(1)
        expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        torch.manual_seed(1)
        fast = shared_prefill_generate(MergedGenerationModel(model, torch.float32).refresh(), ids, mask, config, stats)
    assert torch.equal(fast, expected)
    assert (stats.rows, stats.prompt_rows) == (12, 3)


def test_bfloat16_log_probabilities_within_tolerance(tiny_model_dir, tiny_tokenizer):
    model = adapted(tiny_model_dir)
    ids, mask = grouped_prompts(tiny_tokenizer)
    with torch.no_grad():
        fp32, bf16 = (
            MergedGenerationModel(model, dtype).refresh()(input_ids=ids, attention_mask=mask).logits.float()
            for dtype in (torch.float32, torch.bfloat16)
        )
    labels = ids[:, 1:].unsqueeze(-1)
    difference = (bf16.log_softmax(-1)[:, :-1].gather(-1, labels) - fp32.log_softmax(-1)[:, :-1].gather(-1, labels))
    difference = difference.squeeze(-1)[mask[:, 1:].bool()].abs()
    assert difference.max() <= 0.05 and difference.mean() <= 0.01


ONEDNN_BF16 = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="oneDNN has no bf16 path on this CPU (AVX2 only): no bf16 projection is packed (the next test runs there)",
)


FLOAT32_PACKED = pytest.mark.skipif(
    not packs_linears(torch.device("cpu"), torch.float32),
    reason="float32 projections stay dense without AVX-512 (packing was slower there): the AVX2 test runs there",
)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=FLOAT32_PACKED),
                                   pytest.param(torch.bfloat16, marks=ONEDNN_BF16)])
def test_packed_projections_compute_the_dense_products(tiny_model_dir, dtype):
    model = adapted(tiny_model_dir)
    merged = MergedGenerationModel(model, dtype)
    copy = merged.refresh()
    packed = {name: module for name, module in copy.named_modules() if isinstance(module, PackedLinear)}
    base = model.get_base_model()
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    linears = {name for name, module in plain.named_modules() if type(module) is torch.nn.Linear}
    assert set(packed) == linears and "lm_head" in linears  # every projection, LoRA-adapted or not, the tied head
    hidden = torch.randn(3, 5, 2 * copy.config.hidden_size, dtype=dtype)[:, :, ::2]  # not contiguous, as a slice
    for name, linear in packed.items():
        if linear.in_features != copy.config.hidden_size or name == "lm_head":
            continue
        source = base.get_submodule(name)
        weight = source.get_base_layer().weight + source.get_delta_weight("default")
        dense = torch.nn.functional.linear(hidden, weight.detach().to(dtype), linear.bias)
        output = linear(hidden)
        if dtype == torch.bfloat16:
            assert torch.equal(output, dense), name
        else:
            assert (output - dense).abs().max() <= 1e-5 * dense.abs().max(), name
    with torch.no_grad():  # the tied head follows the embedding it shares
        base.get_input_embeddings().weight.mul_(2)
    ids = torch.tensor([[1, 2, 3]])
    logits = merged.refresh()(input_ids=ids).logits
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    assert (logits.float() - expected).abs().max() <= (1e-5 if dtype == torch.float32 else 0.1) * expected.abs().max()


def test_generation_dtype_auto_follows_the_device():
    assert resolve_generation_dtype("float32", torch.device("cpu")) == torch.float32
    # "auto" is bf16 exactly where `has_native_bf16` (the CPU's flags and oneDNN's bf16 path, which an imitated AVX2
    # CPU, ONEDNN_MAX_CPU_ISA=AVX2, lacks though cpuid still lists AVX512-BF16) says so
    native = has_native_bf16(torch.device("cpu"))
    assert resolve_generation_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    with pytest.raises(ValueError, match="generation_dtype"):
        resolve_generation_dtype("float16", torch.device("cpu"))


def make_trainer(tmp_path, tiny_model_dir, tokenizer, trainer_class=FedGRPOTrainer, **overrides):
    values = dict(FAST_GRPO, output_dir=str(tmp_path), max_steps=2, seed=3, disable_tqdm=True)
    values.update(overrides)
    lora = LoraConfig(**{**LORA.to_dict(), "lora_dropout": values.pop("lora_dropout", 0.0)})
    return trainer_class(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward,
        args=FedGRPOConfig(**values), train_dataset=PROMPTS, processing_class=tokenizer, peft_config=lora,
    )  # fmt: skip


def recorded_completions(trainer) -> list:
    completions = []
    generate = trainer._generate_single_turn

    def recording(*args, **kwargs):
        completion_ids, logprobs = generate(*args, **kwargs)
        completions.append(completion_ids)
        return completion_ids, logprobs

    trainer._generate_single_turn = recording
    trainer.train()
    return completions


def test_trainer_samples_trls_completions_in_float32(tmp_path, tiny_model_dir, tiny_tokenizer):
    """Two sampled GRPO steps: the same completions (so the same rewards and updates) as TRL's generation."""
    runs = {}
    for fast in (False, True):
        # Both with `FastGRPOMixin` (a trainer takes it by itself only when a speed-up is on): the standard path is
        # the mixin's with `fast_generation` off.
        trainer = make_trainer(
            tmp_path / str(fast), tiny_model_dir, tiny_tokenizer, trainer_class=FastFedGRPOTrainer,
            fast_generation=fast, generation_dtype="float32", top_k=20, top_p=0.95,
        )  # fmt: skip
        runs[fast] = recorded_completions(trainer), trainer
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 2
    stats = runs[True][1].fast_generation_stats
    assert (stats.rows, stats.prompt_rows) == (2 * 4, 2 * 1) and not stats.fallbacks  # 1 prompt x 4 per step
    assert runs[False][1].fast_generation_stats.rows == 0
    # Where float32 projections are packed (AVX-512), they are freed after each generation (the loss runs without
    # them) and packed anew for the next: the second step's completions above came from re-packed weights.
    packed = [module for module in runs[True][1]._merged_generation_model.model.modules()
              if isinstance(module, PackedLinear)]
    assert bool(packed) == packs_linears(torch.device("cpu"), torch.float32)
    assert all(module.packed_weight is None for module in packed)


def test_unsupported_generation_falls_back_counted_and_logged_once(tmp_path, tiny_model_dir, tiny_tokenizer, caplog):
    trainer = make_trainer(tmp_path, tiny_model_dir, tiny_tokenizer, fast_generation=True, lora_dropout=0.1)
    with caplog.at_level(logging.WARNING, logger="trl_federated.local.shared_prefix"):
        trainer.train()
    assert trainer.fast_generation_stats.fallbacks == {"active dropout (the merged copy generates without it)": 2}
    assert trainer.fast_generation_stats.rows == 0
    assert [record.message.count("active dropout") for record in caplog.records] == [1]


def test_unsupported_models_are_named(tiny_model_dir):
    model = adapted(tiny_model_dir)
    assert unsupported_reason(model) is None
    assert unsupported_reason(adapted(tiny_model_dir, use_dora=True)).startswith("a LoRA variant")
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert unsupported_reason(model) == "model without a full-attention key/value cache"


def test_an_override_of_generation_is_refused(tmp_path, tiny_model_dir, tiny_tokenizer):
    class CustomGeneration(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            return super()._generate_single_turn(*args, **kwargs)

    class Fast(FastGRPOMixin, CustomGeneration):
        pass

    with pytest.raises(ValueError, match="fast_generation=False"):
        make_trainer(tmp_path, tiny_model_dir, tiny_tokenizer, trainer_class=Fast, fast_generation=True)


def test_fast_evaluation_scores_as_the_standard_one(tiny_model_dir, tiny_tokenizer):
    model = adapted(tiny_model_dir)
    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(6)],
        "answer": [str(2 * i) for i in range(6)], "difficulty": ["simple", "hard"] * 3,
    })  # fmt: skip
    results = [
        evaluate_accuracy(
            model, tiny_tokenizer, dataset, batch_size=4, max_new_tokens=8, reward_funcs=length_reward,
            fast_generation=fast, generation_dtype="float32",
        )  # fmt: skip
        for fast in (False, True)
    ]
    assert results[0]["accuracy"] == results[1]["accuracy"] and results[0]["accuracy"]["Total"] > 0


def test_the_kv_cache_is_passed_under_the_installed_transformers_keyword(tiny_model_dir, tiny_tokenizer):
    """`cache` where transformers has it (5.24 on: `past_key_values` is deprecated there and removed in 5.40), so the
    shared prefill warns of nothing; `past_key_values` on a model class whose forward takes only that."""
    import inspect
    import warnings

    from trl_federated.local.shared_prefix import cache_keyword

    model = adapted(tiny_model_dir)
    keyword = "cache" if "cache" in inspect.signature(type(model.get_base_model()).forward).parameters else (
        "past_key_values")
    assert cache_keyword(model) == keyword

    class Legacy(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None):
            return input_ids

    assert cache_keyword(Legacy()) == "past_key_values"
    ids, mask = grouped_prompts(tiny_tokenizer)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("error", message=".*past_key_values.*deprecated", category=FutureWarning)
        shared_prefill_generate(MergedGenerationModel(model, torch.float32).refresh(), ids, mask,
                                generation_config(tiny_tokenizer), FastGenerationStats())


AVX2_ONLY = """
import sys, torch
from transformers import AutoModelForCausalLM
from peft import LoraConfig, get_peft_model
from trl_federated.runtime.devices import has_native_bf16
from trl_federated.local.fast_generation import MergedGenerationModel, PackedLinear, resolve_generation_dtype
model = get_peft_model(AutoModelForCausalLM.from_pretrained(sys.argv[1]), LoraConfig(r=4, target_modules="all-linear"))
ids = torch.randint(0, model.config.vocab_size, (2, 7))
logits = {}
for dtype in (torch.float32, torch.bfloat16):
    copy = MergedGenerationModel(model.eval(), dtype).refresh()
    packed = any(isinstance(module, PackedLinear) for module in copy.modules())
    assert not packed, (dtype, packed)
    with torch.no_grad():
        logits[dtype] = copy(input_ids=ids).logits.float()
difference = (logits[torch.bfloat16].log_softmax(-1) - logits[torch.float32].log_softmax(-1)).abs()
print(torch.ops.mkldnn._is_mkldnn_bf16_supported(), has_native_bf16(torch.device("cpu")),
      resolve_generation_dtype("auto", torch.device("cpu")), float(difference.max()))
"""


def test_bfloat16_generation_falls_back_to_dense_projections_on_an_avx2_only_cpu(tiny_model_dir):
    """On a CPU without AVX-512 oneDNN has no bf16 path (`mkldnn_reorder_linear_weight: bf16 path needs ...`): imitated
    here by limiting oneDNN and ATen to AVX2, the bf16 copy keeps dense projections and computes, so does the float32
    one (packing is slower there), and `generation_dtype: auto` picks float32 (no native bf16)."""
    environment = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    result = subprocess.run([sys.executable, "-c", AVX2_ONLY, str(tiny_model_dir)], env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    supported, native, auto, difference = result.stdout.split()
    assert (supported, native, auto) == ("False", "False", "torch.float32")
    assert float(difference) <= 0.05
