"""Speed-ups of any `trl.GRPOTrainer` that leave its results unchanged, federated or not: the shared-prefix
log-probabilities (`shared_prefix.py`) and the gated-MLP recomputation (`gated_mlp.py`), as one mixin.

    class FastGRPOTrainer(FastGRPOMixin, GRPOTrainer): ...

    args = GRPOConfig(...)
    args.shared_prefix = True  # a field of FedGRPOConfig; on another config, an attribute
    FastGRPOTrainer(model=..., reward_funcs=..., args=args, ...).train()  # GRPOTrainer's logs and adapter, faster

The federated client trainer (`local_trainer.LocalGRPOMixin`) builds on `FastGRPOMixin`, so every client trains with
the speed-ups its `FedGRPOConfig` turns on.
"""

from __future__ import annotations

import contextlib

from trl import GRPOTrainer

from .gated_mlp import recomputed_gated_mlp
from .shared_prefix import (
    REGROUPABLE_LOSS_TYPES,
    SharedPrefixStats,
    micro_batches_by_prompt,
    shared_prefix_logps_and_entropies,
    unsupported_reason,
)


class FastGRPOMixin:
    """Exact speed-ups for any `trl.GRPOTrainer` subclass; put it first among the bases. The trainer trains like the
    class it extends, with what its `args` turn on (read at every call; False when `args` lacks them):

    - `shared_prefix`: the loss and the old and reference log-probabilities compute each distinct prompt of a
      micro-batch once (`shared_prefix.py`; `shared_prefix_stats` counts what it did and what it left to the standard
      forward), and where that leaves the optimizer step's gradient unchanged (one optimizer step per generation
      batch, `num_iterations` 1, a loss in `REGROUPABLE_LOSS_TYPES`, GRPOTrainer's own loss and batching), the
      micro-batches of a generation batch are cut by prompt (`shared_prefix.micro_batches_by_prompt`);
    - `recompute_gated_mlp`: SiLU-gated MLPs keep half their activations for the backward (`gated_mlp.py`).

    It relies on two of GRPOTrainer's private methods and one attribute, all used as TRL uses them:
    `_get_per_token_logps_and_entropies`, through which TRL computes every log-probability (a class that overrides
    it below this mixin is refused with `shared_prefix`, which would bypass that override); `_prepare_inputs` and the
    list `_buffered_inputs`, where TRL keeps the micro-batches it cut from a generation batch and hands out one per
    call: the one place the micro-batches of a step exist together before the loss sees them.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if getattr(self.args, "shared_prefix", False) and _overrides(type(self), "_get_per_token_logps_and_entropies"):
            raise ValueError(
                f"`shared_prefix` replaces `_get_per_token_logps_and_entropies`, which {base_name(type(self))} "
                "overrides: set `shared_prefix=False` to keep that override."
            )
        self.shared_prefix_stats = SharedPrefixStats()
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

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **extra_inputs,
    ):  # fmt: skip
        """With `shared_prefix`, the loss, old and reference log-probabilities compute each prompt once
        (`shared_prefix.py`). With `recompute_gated_mlp`, SiLU-gated MLPs keep half their activations for the
        backward, with autograd's gradients (`gated_mlp.py`)."""
        unwrapped = self.accelerator.unwrap_model(model)
        recompute = getattr(self.args, "recompute_gated_mlp", False)
        with recomputed_gated_mlp(unwrapped) if recompute else contextlib.nullcontext():
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


def base_name(trainer_class: type) -> str:
    """The name of the trainer class a class with the mixins extends (its first class without them)."""
    base = next((klass for klass in trainer_class.__mro__ if not issubclass(klass, FastGRPOMixin)), trainer_class)
    return f"{base.__module__}.{base.__qualname__}"


def _is_mixin(klass: type) -> bool:
    """`FastGRPOMixin` or a mixin built on it (`local_trainer.LocalGRPOMixin`, `trainer.FederatedGRPOMixin`), as
    opposed to a trainer class."""
    return issubclass(klass, FastGRPOMixin) and not issubclass(klass, GRPOTrainer)


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
