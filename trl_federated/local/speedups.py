"""Speed-ups of any `trl.GRPOTrainer`, federated or not: the shared-prefix log-probabilities (`shared_prefix.py`),
the gated-MLP recomputation (`gated_mlp.py`) and the loss without its zero-advantage rows (`informative_rows.py`),
which leave its results unchanged, and fast generation
(`fast_generation.py`), which changes float rounding (and in bf16 the sampling policy's weights), as one mixin.

    class FastGRPOTrainer(FastGRPOMixin, GRPOTrainer): ...

    args = GRPOConfig(...)
    args.shared_prefix = True  # a field of FedGRPOConfig; on another config, an attribute
    FastGRPOTrainer(model=..., reward_funcs=..., args=args, ...).train()  # GRPOTrainer's logs and adapter, faster

A federated client's trainer class takes `FastGRPOMixin` only when its `FedGRPOConfig` turns a speed-up on
(`local_trainer.local_trainer(trainer_class, args)`, `trainer.FederatedGRPOMixin`): by default it overrides none of
GRPOTrainer's private methods.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.trainer.utils import pad

from ..runtime.memory import release_free_memory
from . import fast_generation, informative_rows
from .fast_generation import FastGenerationStats, MergedGenerationModel, shared_prefill_generate
from .frozen_casts import FrozenCasts, autocast_dtype, cast_once
from .gated_mlp import recomputed_gated_mlp
from .shared_prefix import (
    REGROUPABLE_LOSS_TYPES,
    SharedPrefixStats,
    micro_batches_by_prompt,
    shared_prefix_logps_and_entropies,
    unsupported_reason,
)

# The fields that turn a speed-up on (`FedGRPOConfig`'s "Exact speed-ups" and "Fast generation" blocks).
SPEEDUP_FIELDS = ("shared_prefix", "recompute_gated_mlp", "skip_zero_advantage_rows", "fast_generation")


def wants_speedups(args) -> bool:
    """Whether `args` (any config) turns on one of the speed-ups `FastGRPOMixin` implements."""
    return any(getattr(args, name, False) for name in SPEEDUP_FIELDS)


class TrainerMixin:
    """What the package's trainer mixins (`FastGRPOMixin`, `local_trainer.LocalGRPOMixin`,
    `trainer.FederatedGRPOMixin`) have in common, as opposed to a trainer class they extend: the mark that tells them
    apart in a trainer's MRO (`base_name`)."""


class FastGRPOMixin(TrainerMixin):
    """Exact speed-ups for any `trl.GRPOTrainer` subclass; put it first among the bases. The trainer trains like the
    class it extends, with what its `args` turn on (read at every call; False when `args` lacks them):

    - `shared_prefix`: the loss and the old and reference log-probabilities compute each distinct prompt of a
      micro-batch once (`shared_prefix.py`; `shared_prefix_stats` counts what it did and what it left to the standard
      forward), and where that leaves the optimizer step's gradient unchanged (one optimizer step per generation
      batch, `num_iterations` 1, a loss in `REGROUPABLE_LOSS_TYPES`, GRPOTrainer's own loss and batching), the
      micro-batches of a generation batch are cut by prompt (`shared_prefix.micro_batches_by_prompt`);
    - `recompute_gated_mlp`: SiLU-gated MLPs keep half their activations for the backward (`gated_mlp.py`);
    - `skip_zero_advantage_rows`: the loss leaves out the rows whose advantage is 0, whose loss and gradient are 0
      without a KL term (`informative_rows.py`; `zero_advantage_stats` counts what it did and the calls it left to
      the standard loss);
    - `fast_generation`: TRL's transformers generation (`_generate_single_turn`, not vLLM or continuous batching)
      runs on a merged copy of the weights in `generation_dtype`, each distinct prompt prefilled once
      (`fast_generation.py`); `fast_generation_stats` counts what it did and the calls it left to TRL's path.

    It relies on four of GRPOTrainer's private methods and one attribute, all used as TRL uses them:
    `_get_per_token_logps_and_entropies`, through which TRL computes every log-probability (a class that overrides
    it below this mixin is refused with `shared_prefix`, which would bypass that override); `_prepare_inputs` and the
    list `_buffered_inputs`, where TRL keeps the micro-batches it cut from a generation batch and hands out one per
    call: the one place the micro-batches of a step exist together before the loss sees them;
    `_generate_single_turn`, which turns a list of prompt token ids into completion token ids (and log-probabilities,
    None on the transformers path); `_compute_loss`, the loss of one micro-batch (a class that overrides it below this
    mixin is refused with `skip_zero_advantage_rows`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if getattr(self.args, "shared_prefix", False) and _overrides(type(self), "_get_per_token_logps_and_entropies"):
            raise ValueError(
                f"`shared_prefix` replaces `_get_per_token_logps_and_entropies`, which {base_name(type(self))} "
                "overrides: set `shared_prefix=False` to keep that override."
            )
        if getattr(self.args, "skip_zero_advantage_rows", False) and _overrides(type(self), "_compute_loss"):
            raise ValueError(
                f"`skip_zero_advantage_rows` wraps `_compute_loss`, which {base_name(type(self))} overrides: set "
                "`skip_zero_advantage_rows=False` to keep that override."
            )
        if getattr(self.args, "fast_generation", False) and _overrides(type(self), "_generate_single_turn"):
            raise ValueError(
                f"`fast_generation` replaces `_generate_single_turn`, which {base_name(type(self))} overrides: set "
                "`fast_generation=False` to keep that override."
            )
        self.shared_prefix_stats = SharedPrefixStats()
        self.fast_generation_stats = FastGenerationStats()
        self.zero_advantage_stats = informative_rows.ZeroAdvantageStats()
        self._merged_generation_model: MergedGenerationModel | None = None
        self._frozen_casts = FrozenCasts()
        # Re-cutting micro-batches by prompt changes no gradient when all micro-batches of a generation batch go into
        # one optimizer step, once, and GRPOTrainer's own loss normalises each independently of which rows it holds;
        # a custom loss or batching may not, so it keeps TRL's micro-batches.
        self._groups_micro_batches_by_prompt = (
            getattr(self.args, "shared_prefix", False)
            and self.args.steps_per_generation == self.args.gradient_accumulation_steps > 1
            and self.num_iterations == 1
            and self.loss_type in REGROUPABLE_LOSS_TYPES
            and not any(_customises(type(self), name) for name in ("_compute_loss", "compute_loss", "_prepare_inputs"))
        )

    def _prepare_inputs(self, generation_batch):
        """With `shared_prefix`, the micro-batches TRL cuts from a fresh generation batch are re-cut by prompt
        (`shared_prefix.micro_batches_by_prompt`), where that leaves the optimizer step's gradient unchanged."""
        if not (self._groups_micro_batches_by_prompt and self.model.training):
            return super()._prepare_inputs(generation_batch)
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self._buffered_inputs is not buffered:  # TRL has just cut a fresh generation batch into micro-batches
            position = next(index for index, batch in enumerate(self._buffered_inputs) if batch is inputs)
            self._buffered_inputs = micro_batches_by_prompt(self._buffered_inputs)
            inputs = self._buffered_inputs[position]
        return inputs

    def _compute_loss(self, model, inputs):
        """With `skip_zero_advantage_rows`, in training, the rows whose advantage is 0 stay out of the forward and
        backward, and the loss is rescaled to the micro-batch: the same loss and gradient up to float rounding
        (`informative_rows.py`); where its settings give those rows a gradient, the standard loss, counted."""
        if not (getattr(self.args, "skip_zero_advantage_rows", False) and self.model.training):
            return super()._compute_loss(model, inputs)
        reason = informative_rows.unsupported_reason(self, inputs)
        if reason is not None:
            self.zero_advantage_stats.record_fallback(reason)
            return super()._compute_loss(model, inputs)
        return informative_rows.zero_advantage_loss(
            functools.partial(super()._compute_loss, model), inputs, self.loss_type, self.zero_advantage_stats
        )

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **extra_inputs,
    ):  # fmt: skip
        """With `shared_prefix`, the loss, old and reference log-probabilities compute each prompt once
        (`shared_prefix.py`). With `recompute_gated_mlp`, SiLU-gated MLPs keep half their activations for the
        backward, with autograd's gradients (`gated_mlp.py`). Unless the weights are sharded, the frozen projections
        multiply under autocast by their weights cast once per trainer, not per call: the same products
        (`frozen_casts.py`)."""
        unwrapped = self.accelerator.unwrap_model(model)
        recompute = getattr(self.args, "recompute_gated_mlp", False)
        # TRL's fused head computes in the autocast dtype, except with `cast_lm_head_to_fp32`
        head_dtype = None
        if not self.args.cast_lm_head_to_fp32:
            head_dtype = autocast_dtype(self.accelerator.autocast, self.accelerator.device.type)
        # Sharded weights are gathered per call: a cast kept of each would hold the whole model on every process
        sharded = self._shards_parameters()
        with (
            recomputed_gated_mlp(unwrapped) if recompute else contextlib.nullcontext(),
            contextlib.nullcontext() if sharded else cast_once(unwrapped, self._frozen_casts, head_dtype),
        ):
            if getattr(self.args, "shared_prefix", False):
                prompt_length = input_ids.size(1) - logits_to_keep
                reason = unsupported_reason(unwrapped, prompt_length, compute_aux_loss, extra_inputs)
                if reason is None:
                    logps, entropies = shared_prefix_logps_and_entropies(
                        model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                        autocast=self.accelerator.autocast, stats=self.shared_prefix_stats,
                    )  # fmt: skip
                    return logps, entropies, None
                self.shared_prefix_stats.record_fallback(reason)
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **extra_inputs,
            )  # fmt: skip

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """With `fast_generation`, TRL's transformers generation runs on a merged copy of the weights in
        `generation_dtype`, each distinct prompt prefilled once (`fast_generation.py`), under TRL's own
        `generation_config`; calls it does not cover go to TRL's path, counted in `fast_generation_stats`."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        reason = None
        if getattr(self.args, "fast_generation", False):
            reason = self._fast_generation_unsupported_reason(unwrapped, prompt_ids, images, multimodal_fields)
            if reason is not None:
                self.fast_generation_stats.record_fallback(reason)
        if reason is not None or not getattr(self.args, "fast_generation", False):
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )  # fmt: skip
        device = self.accelerator.device
        # Left-padded as TRL pads them
        prompt_tensors = [torch.tensor(ids) for ids in prompt_ids]
        padding = {"padding_side": "left", "pad_to_multiple_of": self.pad_to_multiple_of}
        input_ids = pad(prompt_tensors, padding_value=self._tokenizer.pad_token_id, **padding).to(device)
        attention_mask = pad([torch.ones_like(ids) for ids in prompt_tensors], padding_value=0, **padding).to(device)
        dtype = fast_generation.resolve_generation_dtype(getattr(self.args, "generation_dtype", "auto"), device)
        if self._merged_generation_model is None or self._merged_generation_model.model.dtype != dtype:
            self._merged_generation_model = MergedGenerationModel(unwrapped, dtype)
        with profiling_context(self, "transformers.generate"), torch.no_grad():
            prompt_completion_ids = shared_prefill_generate(
                self._merged_generation_model.refresh(), input_ids, attention_mask, self.generation_config,
                stats=self.fast_generation_stats,
            )  # fmt: skip
        self._merged_generation_model.release()
        release_free_memory()
        completion_ids = prompt_completion_ids[:, input_ids.size(1) :]
        return fast_generation.completions_up_to_eos(completion_ids, self.eos_token_ids), None

    def _shards_parameters(self) -> bool:
        """Whether each process holds only a shard of the model's weights (FSDP, DeepSpeed ZeRO-3)."""
        deepspeed = self.accelerator.state.deepspeed_plugin
        return self.is_fsdp_enabled or (deepspeed is not None and deepspeed.zero_stage == 3)

    def _fast_generation_unsupported_reason(self, unwrapped, prompt_ids, images, multimodal_fields) -> str | None:
        """Why `fast_generation` leaves this `_generate_single_turn` call to TRL's path, or None."""
        if self.use_vllm:
            return "vLLM generation"
        if self.use_transformers_continuous_batching:
            return "transformers continuous batching"
        if images is not None or multimodal_fields:
            return "multimodal inputs"
        if self._shards_parameters():
            return "sharded parameters (FSDP, DeepSpeed ZeRO-3)"
        if self.generation_config.cache_implementation is not None:
            return f"cache_implementation={self.generation_config.cache_implementation!r}"
        if max(len(ids) for ids in prompt_ids) < 2:
            return "prompts of fewer than 2 tokens"
        return fast_generation.unsupported_reason(unwrapped)


def base_name(trainer_class: type) -> str:
    """The name of the trainer class a class with the mixins extends (its first class without them)."""
    base = next((klass for klass in trainer_class.__mro__ if not issubclass(klass, TrainerMixin)), trainer_class)
    return f"{base.__module__}.{base.__qualname__}"


def _is_mixin(klass: type) -> bool:
    """One of the package's mixins (`TrainerMixin`), as opposed to a trainer class."""
    return issubclass(klass, TrainerMixin) and not issubclass(klass, GRPOTrainer)


def _overrides(trainer_class: type, name: str) -> bool:
    """Whether a class between the mixins and `GRPOTrainer` in `trainer_class`'s MRO defines `name`: an override
    the mixin's own `name` would bypass."""
    mro = trainer_class.__mro__
    below = mro[mro.index(FastGRPOMixin) + 1 : mro.index(GRPOTrainer)]
    return any(name in vars(klass) for klass in below)


def _customises(trainer_class: type, name: str) -> bool:
    """Whether any class of `trainer_class`'s MRO before `GRPOTrainer`, other than the mixins, defines `name`."""
    mro = trainer_class.__mro__
    return any(name in vars(klass) for klass in mro[: mro.index(GRPOTrainer)] if not _is_mixin(klass))
