"""Fast generation on the transformers path: what a local step and the greedy evaluation spend generating, cut
to what the machine has to do.

`model.generate` on a LoRA-adapted model in training dtype pays, at every decode step, for far more than
streaming its weights once: every targeted projection runs as base + two LoRA matrices behind PEFT's Python
wrapper, and on CPU the fused attention kernel (`sdpa`) is slow for a single query row (in bf16 about 8x eager's
time). And TRL's GRPO prefills each prompt K times, once per completion row. This module removes the three:

1. merged weights (`MergedGenerationModel`): generation runs on a plain copy of the model (no PEFT wrappers)
   whose every parameter is refreshed from the trained model before each use, LoRA merged in (W + s·B·A), as
   vLLM generates from merged weights. The copy holds the weights in the generation dtype and, on CPU, uses
   eager attention with grouped query heads (`grouped_eager_attention`). Merging changes float rounding only; in
   bf16 the weights themselves are rounded.
2. a shared prefill (`shared_prefill_generate`): each distinct prompt of a batch runs through the model once,
   its cache is copied to each of its rows, and `generate` continues from the last prompt token, so the
   decoding, the sampling and the stopping are `generate`'s own under the caller's `GenerationConfig`.
3. bf16 weights where the device computes bf16 natively (`generation_dtype="auto"`: a CPU with AVX512-BF16 or
   AMX, a CUDA device with bf16), which halves the bytes streamed per decode step.
4. on CPU, where it pays (`packs_linears`: bf16, or float32 on AVX-512), every linear projection of the copy runs on
   a weight oneDNN has reordered once per refresh (`PackedLinear`): at a decode step's few rows,
   `torch.nn.functional.linear` streams its weights at half the machine's read bandwidth or less, the packed product
   at about twice that rate; bit for bit the same products in bf16, float rounding in float32.

Numerics (see tests/test_fast_generation.py for the stated tolerances): in float32, the merged weights and the
batch shape of the prefill change the logits by float rounding only (~1e-6 relative), so greedy completions are
TRL's except at near-ties, and sampled completions follow the same distribution (the same tokens under the same
seed while no draw falls within rounding of a boundary). In bfloat16 the policy that samples is the bf16-rounded
one: its log-probabilities differ from float32's by ~1e-2 per token, like a vLLM sampler's; the loss still scores
every completion with the trained float32 model.
"""

from __future__ import annotations

import copy
import logging

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache, GenerationConfig, PreTrainedModel
from transformers.initialization import no_init_weights
from transformers.masking_utils import eager_mask

from .. import choices
from ..runtime.devices import has_native_bf16
from ..runtime.generation import register_fast_generation
from .shared_prefix import SharedPrefixStats, cache_keyword, has_full_attention_cache

logger = logging.getLogger(__name__)

GENERATION_DTYPES = {name: getattr(torch, name) for name in choices.GENERATION_DTYPES}
"""The weight dtypes fast generation can run in, by the names `generation_dtype` takes ("auto" picks one)."""


def resolve_generation_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype of `generation_dtype` `name` on `device`: "auto" is bfloat16 where `has_native_bf16`, else float32."""
    if name == "auto":
        return torch.bfloat16 if has_native_bf16(device) else torch.float32
    choices.check_choice("generation_dtype", name, choices.GENERATION_DTYPE_CHOICES)
    return GENERATION_DTYPES[name]


class FastGenerationStats(SharedPrefixStats):
    """What fast generation did: the rows it generated, the prompt rows it prefilled for them (rows / prompt_rows
    is the reuse factor) and, by reason, the calls it left to the standard generation. Each reason is logged once."""

    fallback_message = "Fast generation falls back to the standard generation: %s."


def unsupported_reason(model: PreTrainedModel | PeftModel) -> str | None:
    """Why `model` cannot generate from a merged copy with a shared prefill, or None when it can."""
    if isinstance(model, PeftModel):
        peft_config = model.active_peft_config
        if peft_config.peft_type != "LORA":
            return f"a {peft_config.peft_type} adapter (only LoRA is merged)"
        if any(
            module.lora_variant.get(adapter) is not None or module.lora_bias.get(adapter, False)
            for module in model.modules() if isinstance(module, LoraLayer) for adapter in module.active_adapters
        ):  # fmt: skip
            return "a LoRA variant (DoRA, aLoRA, ...) or LoRA bias"
    if model.training and any(isinstance(module, torch.nn.Dropout) and module.p > 0 for module in model.modules()):
        return "active dropout (the merged copy generates without it)"
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if not has_full_attention_cache(base):
        return "model without a full-attention key/value cache"
    return None


def grouped_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Transformers' eager attention (`eager_attention_forward`: fp32 softmax over an additive mask), with each
    group of query heads attending its key/value head as one matrix product instead of over a copy of the keys and
    values per query head: at one query row per decode step, those copies of the whole cache were most of the
    attention's time. The same sums in the same order; no dropout (generation is in eval mode)."""
    batch, heads, length, dim = query.shape
    kv_heads = key.size(1)
    scores = torch.matmul(query.reshape(batch, kv_heads, heads // kv_heads * length, dim), key.transpose(2, 3))
    scores = scores * scaling
    if attention_mask is not None:  # (batch, 1, length, keys), the same for every head
        scores = (scores.view(batch, kv_heads, -1, length, key.size(2)) + attention_mask[:, :, None]).flatten(2, 3)
    weights = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(weights, value).view(batch, heads, length, dim)
    return output.transpose(1, 2).contiguous(), None


GROUPED_EAGER = "trl_federated_grouped_eager"
AttentionInterface.register(GROUPED_EAGER, grouped_eager_attention)
AttentionMaskInterface.register(GROUPED_EAGER, eager_mask)
# Decoders whose attention is plain scaled dot-product over their (grouped) heads: no logit soft-capping, sinks or
# extra terms that the function above would drop.
_GROUPED_EAGER_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}


class PackedLinear(torch.nn.Module):
    """A frozen `torch.nn.Linear` whose weight is held in oneDNN's blocked layout (`mkldnn._reorder_linear_weight`)
    and multiplied by oneDNN's linear kernel, the layout PyTorch's own CPU inference passes give frozen weights.
    `load(weight)` repacks a new weight (milliseconds per projection). Any input shape: the rows are flattened, so a
    non-contiguous slice (the last prompt position's hidden state) costs a copy of its rows, not, as
    `torch.nn.functional.linear`'s batched fallback does, a copy of the weight per row."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias  # refreshed in place like every other parameter of the copy
        self.packed_weight = None  # `load` packs one; the merged copy's `refresh` loads every projection

    @torch.no_grad()
    def load(self, weight: torch.Tensor) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features)
        output = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return output.view(*hidden.shape[:-1], self.out_features)


def packs_linears(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the merged copy's projections are packed (`PackedLinear`) on `device` in `dtype`: on CPU with oneDNN,
    in bfloat16 wherever oneDNN has a bf16 path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; `_is_mkldnn_bf16_supported`,
    which honours `ONEDNN_MAX_CPU_ISA`), in float32 where ATen's CPU kernels are AVX-512 ones. On an AVX2-only CPU
    the copy keeps its dense `torch.nn.Linear`s: in float32 there oneDNN's packed product was slower than `linear` at
    most row counts, and without it the prefill ran 1.38x and the greedy evaluation 1.15x faster, where on AVX-512
    packing made a float32 decode step 1.65x and the evaluation 1.20x faster (`benchmarks/packed_projections.py`,
    benchmarks/RESULTS.md)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def pack_linears(model: torch.nn.Module) -> dict[str, PackedLinear]:
    """Replace every plain `torch.nn.Linear` of `model` by a `PackedLinear` (empty until `load`); return them by
    module name. A tied output embedding gets its own packed copy (the embedding keeps the dense weight)."""
    packed = {}
    for name, module in list(model.named_modules()):
        if type(module) is torch.nn.Linear:
            packed[name] = PackedLinear(module)
            model.set_submodule(name, packed[name])
    return packed


class MergedGenerationModel:
    """A plain copy of a (PEFT-wrapped) causal LM for generation: the same architecture without adapters, in
    `dtype`, its parameters refreshed from the source by `refresh()` with each active LoRA adapter merged in.

    The copy costs one model's weights in `dtype`; `refresh()` reads the source's weights once (well under a second
    for a 135M model, against seconds of generation), so it runs before every generation and never goes stale.
    `release()` frees what the next `refresh()` rebuilds anyway (the packed projections on CPU), so the loss that
    follows a generation does not carry them.
    """

    def __init__(self, model: PreTrainedModel | PeftModel, dtype: torch.dtype):
        base = model.get_base_model() if isinstance(model, PeftModel) else model
        # On CPU, eager attention with grouped query heads (`grouped_eager_attention`): the fused `sdpa` kernel is
        # several times slower for one query row (decode), about 8x in bf16.
        attn_implementation = base.config._attn_implementation
        if base.device.type == "cpu":
            attn_implementation = GROUPED_EAGER if base.config.model_type in _GROUPED_EAGER_MODEL_TYPES else "eager"
        with no_init_weights():
            self.model = type(base)._from_config(
                copy.deepcopy(base.config), dtype=dtype, attn_implementation=attn_implementation
            )
        self.model.to(base.device).eval().requires_grad_(False)
        self.model.generation_config = copy.deepcopy(base.generation_config)
        lora_layers = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
        source_buffers = dict(base.named_buffers())
        self._buffers = [(buffer, source_buffers[name]) for name, buffer in self.model.named_buffers()]
        packed = pack_linears(self.model) if packs_linears(base.device, dtype) else {}
        # (target: a parameter, or a PackedLinear for its weight; source parameter; LoRA layer whose delta is added
        # or None), by the copy's names
        self._parameters = []
        targets = [(f"{name}.weight", linear) for name, linear in packed.items()] + list(self.model.named_parameters())
        for name, target in targets:
            owner, _, leaf = name.rpartition(".")
            if owner in lora_layers:
                layer = lora_layers[owner]
                source = getattr(layer.get_base_layer(), leaf)
                self._parameters.append((target, source, layer if leaf == "weight" else None))
            else:
                self._parameters.append((target, base.get_parameter(name), None))

    @torch.no_grad()
    def refresh(self) -> PreTrainedModel:
        """Copy the source's current weights into the copy, LoRA merged, and return the copy."""
        for target, source, layer in self._parameters:
            value = source
            if layer is not None and not layer.merged:
                value = source.detach().clone()
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
                        value += layer.get_delta_weight(adapter).to(value.dtype)
            if isinstance(target, PackedLinear):
                target.load(value.to(self.model.dtype))
            else:
                target.copy_(value)
        for target, source in self._buffers:
            target.copy_(source)
        return self.model

    def release(self) -> None:
        """Free the packed projections (`PackedLinear.load` packs new ones at every `refresh()`): on CPU every weight of
        the copy but the embedding and the norms, so the loss does not hold them (measured in benchmarks/RESULTS.md)."""
        for target, _, _ in self._parameters:
            if isinstance(target, PackedLinear):
                target.packed_weight = None


@torch.no_grad()
def shared_prefill_generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generation_config: GenerationConfig,
    stats: FastGenerationStats | None = None,
    **generate_kwargs,
) -> torch.Tensor:
    """`model.generate(input_ids, attention_mask, generation_config=...)`'s prompt + completion ids, with each
    distinct left-padded prompt row prefilled once.

    The distinct (ids, mask) rows without their last token fill a `DynamicCache` with the position ids `generate`
    gives them (the mask's cumulative sum); the cache is gathered row by row, and `generate` continues from it:
    its first forward computes every row's last prompt token, then decodes, samples and stops as it would without
    the cache. Needs prompts of at least 2 tokens (padded) and a model that `has_full_attention_cache`.
    """
    distinct, row_to_prompt = torch.unique(torch.cat([input_ids, attention_mask], 1), dim=0, return_inverse=True)
    length = input_ids.size(1)
    distinct_ids, distinct_mask = distinct[:, :length], distinct[:, length:]
    position_ids = (distinct_mask.long().cumsum(-1) - 1).masked_fill(distinct_mask == 0, 0)
    cache = DynamicCache(config=model.config)
    model(
        input_ids=distinct_ids[:, :-1], attention_mask=distinct_mask[:, :-1], position_ids=position_ids[:, :-1],
        **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1,
    )  # fmt: skip
    cache.batch_select_indices(row_to_prompt)
    if stats is not None:
        stats.rows += input_ids.size(0)
        stats.prompt_rows += distinct.size(0)
    return model.generate(
        input_ids=input_ids, attention_mask=attention_mask, **{cache_keyword(model): cache},
        generation_config=generation_config, **generate_kwargs,
    )  # fmt: skip


def completions_up_to_eos(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> list[list[int]]:
    """Each row's completion ids up to and including its first end-of-sequence token, as TRL's transformers path
    cuts `generate`'s output (what follows is padding)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    lengths = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, completion_ids.size(1))
    return [row[:length].tolist() for row, length in zip(completion_ids.cpu(), lengths.tolist(), strict=True)]


class MergedWeightsGeneration:
    """This module's fast generation as the server core's evaluation uses it (`runtime.generation.FastGeneration`)."""

    unsupported_reason = staticmethod(unsupported_reason)
    resolve_generation_dtype = staticmethod(resolve_generation_dtype)

    @staticmethod
    def merged_generator(model: PreTrainedModel | PeftModel, dtype: torch.dtype) -> PreTrainedModel:
        return MergedGenerationModel(model, dtype).refresh()


register_fast_generation(MergedWeightsGeneration())
