"""Shared-prefix log-probabilities: each distinct prompt of a GRPO batch goes through the model once.

A GRPO batch holds K completions of every prompt, and TRL scores each row as the whole sequence prompt +
completion: a prompt of P tokens is computed K times, forward and backward. Causal attention makes that
repetition unnecessary: the hidden states at prompt positions depend only on the prompt, so they are the same
in all K rows, and a completion token needs the prompt only through its keys and values. Per chunk of rows:

1. prompt pass: the distinct (prompt_ids, prompt_mask) rows, without their last token, fill a `DynamicCache`;
2. the cache is gathered row by row (row i takes its prompt's keys/values); the gather's backward sums the
   gradients of a prompt's rows into its single prompt pass;
3. completion pass: each row's last prompt token and its completion attend to the gathered cache, and TRL's fused
   LM head scores the completion. The last prompt token is recomputed per row because its hidden state predicts
   the first completion token; the fused head then sees the same shifted labels as in TRL's standard forward.

Tokens through the model drop from B(P + T) to U(P - 1) + B(T + 1) for B rows, U distinct prompts and T completion
tokens. On CPU TRL's fused head projects every position onto the vocabulary, prompt positions included (it keeps
only the labelled ones on CUDA/XPU), so there the head's work also drops, from B(P + T - 1) to B·T positions.

The result equals the standard computation up to floating-point summation order: the attention mask is the same
padding mask over the same P + T positions, and the position ids are those the model gives a forward without
them (TRL passes none), arange over the padded length, which the cache continues at P - 1. Rows need not come in
whole groups or in order (TRL shuffles the generation batch before splitting it into micro-batches): any rows
with equal prompts share a pass, and a row whose prompt is unique simply has a pass of its own.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword under which `model`'s forward and `generate` take a KV cache: `cache` from transformers 5.24 on,
    where `past_key_values` is deprecated (removed in 5.40), `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _cache_keyword(type(base))


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


@dataclass
class Fallbacks:
    """The calls a speed-up left to the standard computation, by reason; each reason is logged once, as
    `fallback_message` says, by the logger of the module that defines the speed-up's stats."""

    fallbacks: Counter = field(default_factory=Counter)
    fallback_message = "A speed-up falls back to the standard computation: %s."

    def record_fallback(self, reason: str) -> None:
        if reason not in self.fallbacks:
            logging.getLogger(type(self).__module__).warning(self.fallback_message, reason)
        self.fallbacks[reason] += 1


@dataclass
class SharedPrefixStats(Fallbacks):
    """What the shared-prefix path did: the rows it scored, the prompt rows it ran for them (rows / prompt_rows is
    the reuse factor) and, by reason, the calls it left to the standard computation (`Fallbacks`)."""

    rows: int = 0
    prompt_rows: int = 0
    fallback_message = "Shared-prefix log-probabilities fall back to the standard forward: %s."


def unsupported_reason(model, prompt_length: int, compute_aux_loss: bool, extra_inputs: dict) -> str | None:
    """Why the shared-prefix split cannot score this call exactly, or None when it can.

    `model` is the unwrapped model (a `PreTrainedModel` or a `PeftModel`); `extra_inputs` are the further keyword
    arguments of TRL's `_get_per_token_logps_and_entropies` (images, token type ids), all None for text.
    """
    if any(value is not None for value in extra_inputs.values()):
        return "multimodal inputs"
    if compute_aux_loss:
        return "MoE load-balancing loss (its router statistics span the whole sequence)"
    if prompt_length < 2:
        return "prompts of fewer than 2 tokens"
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and peft_config.is_prompt_learning:
        return "prompt-learning PEFT adapter (it prepends virtual tokens)"
    # One prompt pass means one dropout mask for the prompt, shared by its K rows: the same expected gradient as K
    # independent masks, but not the same computation.
    if model.training and any(isinstance(module, torch.nn.Dropout) and module.p > 0 for module in model.modules()):
        return "active dropout (the K rows of a prompt would share its dropout masks)"
    # Transformers drops `past_key_values` inside checkpointed layers in training mode (the replay would write the
    # cache twice), which would leave the completion pass without its prompt.
    if model.training and any(
        isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing for module in model.modules()
    ):
        return "gradient checkpointing"
    if not has_full_attention_cache(model):
        return "model without a full-attention key/value cache"
    return None


def has_full_attention_cache(model) -> bool:
    """Whether `model` (a `PreTrainedModel` or a `PeftModel`), a decoder-only model, keeps every past key and value
    of every layer in a `DynamicCache`: a sliding-window, linear-attention or recurrent layer keeps something else."""
    config = model.config.get_text_config(decoder=True)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    is_supported_cache = getattr(model, "_supports_default_dynamic_cache", lambda: False)()
    return (
        not config.is_encoder_decoder
        and is_supported_cache
        and layer_types == {"full_attention"}
        and getattr(config, "sliding_window", None) is None
    )


def shared_prefix_logps_and_entropies(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None = None,
    compute_entropy: bool = False,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    stats: SharedPrefixStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities (and entropies) of the last `logits_to_keep` tokens of `input_ids`, as TRL's
    `GRPOTrainer._get_per_token_logps_and_entropies` computes them, with each distinct prompt computed once.

    `input_ids` is prompt (left-padded) + completion, as in TRL; `model` carries TRL's fused LM head
    (`add_fused_lm_head`); rows are processed `batch_size` at a time; `autocast` is the trainer's
    `accelerator.autocast`. Check `unsupported_reason` first.
    """
    batch_size = batch_size or input_ids.size(0)
    all_logps, all_entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
        prompt_ids, completion_ids = ids[:, :-logits_to_keep], ids[:, -logits_to_keep:]
        prompt_mask = mask[:, :-logits_to_keep]
        # Equal ids with different masks are different prompts (a pad token can also occur as a real token).
        distinct, row_to_prompt = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True)
        distinct_ids, distinct_mask = distinct[:, : prompt_ids.size(1)], distinct[:, prompt_ids.size(1) :]

        # Labels as in TRL: the completion's padding is not scored. The head's shift drops the first label (the
        # last prompt token's own).
        completion_input = torch.cat([prompt_ids[:, -1:], completion_ids], dim=1)
        completion_labels = completion_ids.masked_fill(mask[:, -logits_to_keep:] == 0, -100)
        labels = torch.nn.functional.pad(completion_labels, (1, 0), value=-100)
        cache = DynamicCache()
        with autocast():
            # The LM head of the prompt pass is not needed; logits_to_keep=1 keeps it to one position.
            model(
                input_ids=distinct_ids[:, :-1], attention_mask=distinct_mask[:, :-1], **{cache_keyword(model): cache},
                use_cache=True, logits_to_keep=1,
            )  # fmt: skip
            cache.batch_select_indices(row_to_prompt)
            # The mask is the standard forward's, over all P + T positions: cache (P - 1) + this pass (T + 1).
            outputs = model(
                input_ids=completion_input, attention_mask=mask,
                **{cache_keyword(model): cache}, labels=labels, fused_lm_head=True,
            )  # fmt: skip
        all_logps.append(outputs.log_probs)
        if compute_entropy:
            all_entropies.append(outputs.entropy)
        if stats is not None:
            stats.rows += ids.size(0)
            stats.prompt_rows += distinct.size(0)
    return torch.cat(all_logps, dim=0), torch.cat(all_entropies, dim=0) if compute_entropy else None


# Loss types whose micro-batch loss is a sum of per-row terms over a normaliser that does not depend on which rows
# the micro-batch holds (its size, the generation batch's token count, or a constant): re-cutting the micro-batches
# of one optimizer step then leaves that step's gradient unchanged. Not 'bnpo' (it divides by the micro-batch's tokens).
REGROUPABLE_LOSS_TYPES = ("grpo", "dapo", "dr_grpo")


def micro_batches_by_prompt(micro_batches: list[dict]) -> list[dict]:
    """The rows of one generation batch's micro-batches, re-cut so that rows with the same prompt are adjacent.

    TRL shuffles a generation batch before cutting it into micro-batches, so a micro-batch of K rows usually holds
    several prompts, each computed once per micro-batch it appears in. Grouped, prompt groups fill the micro-batches
    in order of first appearance (rows keep their shuffled order within a group), so with micro-batches of K rows
    each prompt is computed once per generation batch and a micro-batch holds as few prompts as its size allows:
    fewer tokens, and the same number in every micro-batch, so the memory peak is the typical one. Values that are
    not per-row (None, 0-dim tensors such as `num_items_in_batch`) are the same in every micro-batch and kept.
    """
    per_row = [key for key, value in micro_batches[0].items() if is_per_row(value)]
    merged = {
        key: (torch.cat([batch[key] for batch in micro_batches]) if isinstance(micro_batches[0][key], torch.Tensor)
              else [row for batch in micro_batches for row in batch[key]])
        for key in per_row
    }  # fmt: skip
    prompts = torch.cat([merged["prompt_ids"], merged["prompt_mask"]], dim=1)
    groups = torch.unique(prompts, dim=0, return_inverse=True)[1].tolist()
    first_row = {}
    for row, group in enumerate(groups):
        first_row.setdefault(group, row)
    order = sorted(range(len(groups)), key=lambda row: (first_row[groups[row]], row))
    size = len(order) // len(micro_batches)
    regrouped = []
    for start in range(0, len(order), size):
        rows = order[start : start + size]
        batch = dict(micro_batches[0])
        for key in per_row:
            value = merged[key]
            batch[key] = value[torch.tensor(rows)] if isinstance(value, torch.Tensor) else [value[row] for row in rows]
        regrouped.append(batch)
    return regrouped


def rows_of(value, rows: torch.Tensor):
    """The rows `rows` (a boolean mask) of a per-row value of a generation batch; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.size(0) == rows.numel():
        return value[rows]
    if isinstance(value, list) and len(value) == rows.numel():
        return [item for item, keep in zip(value, rows.tolist()) if keep]
    return value


def is_per_row(value) -> bool:
    """Whether a micro-batch value holds one entry per row: a list, or a tensor with a batch dimension (not None or
    a 0-dim tensor such as `num_items_in_batch`)."""
    return isinstance(value, list) or (isinstance(value, torch.Tensor) and value.ndim > 0)
