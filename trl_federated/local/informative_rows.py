"""The loss on the rows that carry a gradient: a GRPO row whose advantage is 0 has zero loss and zero gradient.

Without a KL term (`beta` 0) the clipped surrogate of a row is −min(r·A, clip(r)·A), zero with its gradient when the
advantage A is 0; and A is 0 for every row of a group whose completions all scored alike (exactly with 0/1 rewards;
a group mean that rounds leaves advantages of ~1e-13, and those rows are kept). In the committed grids 59-75% of the
groups scored alike (benchmarks/RESULTS.md): their forward and backward through the model changed nothing.
`zero_advantage_loss` computes a micro-batch's loss on its other rows only, rescaled so that the loss and the step's
gradient are the full micro-batch's up to float rounding:

- `grpo` averages the micro-batch's rows and `dr_grpo` divides by its row count: × kept / rows;
- `dapo` divides by `num_items_in_batch`, the generation batch's tokens, which the rows kept do not change: × 1.

A micro-batch with no informative row runs one row with its loss × 0: every parameter still gets its (zero)
gradient, as data-parallel engines expect, and the federation's loss terms (FedProx, SCAFFOLD) are added as always.
TRL's logged `entropy` and clip ratios then cover the rows computed, not the whole micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .shared_prefix import Fallbacks, is_per_row, rows_of

ROW_MEAN_LOSS_TYPES = ("grpo", "dr_grpo")  # normalised by the micro-batch's rows
SKIPPABLE_LOSS_TYPES = (*ROW_MEAN_LOSS_TYPES, "dapo")  # ... or by the generation batch's tokens


@dataclass
class ZeroAdvantageStats(Fallbacks):
    """What the skip did: the rows its micro-batches held, the rows it left out (`skipped`) and, by reason, the
    calls it left to the standard loss (`Fallbacks`)."""

    rows: int = 0
    skipped: int = 0
    fallback_message = "The loss keeps its zero-advantage rows: %s."


def unsupported_reason(trainer, inputs: dict) -> str | None:
    """Why the rows of `inputs` with advantage 0 may carry a loss or gradient under `trainer`'s settings (or which
    rows they are cannot be told), or None when leaving them out changes nothing but float rounding."""
    if trainer.loss_type not in SKIPPABLE_LOSS_TYPES:
        return f"loss_type {trainer.loss_type!r} (supported: {', '.join(SKIPPABLE_LOSS_TYPES)})"
    if trainer.beta != 0.0:
        return "a KL term (beta != 0): every row has a gradient"
    if getattr(trainer, "_entropy_bonus_enabled", False):
        return "an entropy bonus: every row has a gradient"
    if trainer.top_entropy_quantile < 1.0:
        return "an entropy mask (top_entropy_quantile < 1): its quantile spans the micro-batch"
    if getattr(trainer, "off_policy_mask_threshold", None) is not None:
        return "an off-policy mask"
    if trainer.aux_loss_enabled:
        return "an MoE load-balancing loss: its router statistics span the micro-batch"
    if any(inputs.get(key) is not None for key in ("pixel_values", "image_grid_thw", "num_images")):
        return "multimodal inputs"
    if inputs["advantages"].dim() != 1:
        return "per-token advantages"
    rows = inputs["advantages"].size(0)
    if any(is_per_row(value) and len(value) != rows for value in inputs.values()):
        return "inputs that are not one entry per row"
    return None


def zero_advantage_loss(compute_loss, inputs: dict, loss_type: str, stats: ZeroAdvantageStats) -> torch.Tensor:
    """`compute_loss(inputs)` (TRL's `_compute_loss` on a micro-batch) with the rows whose advantage is 0 left out
    and the loss rescaled to the micro-batch's rows (the module's docstring); `stats` counts what it did."""
    informative = inputs["advantages"] != 0
    rows, kept = informative.numel(), int(informative.sum())
    stats.rows += rows
    stats.skipped += rows - max(kept, 1)
    if kept == rows:
        return compute_loss(inputs)
    if kept == 0:
        informative[0] = True  # one row through the model, its loss × 0
        scale = 0.0
    else:
        scale = kept / rows if loss_type in ROW_MEAN_LOSS_TYPES else 1.0
    return compute_loss({key: rows_of(value, informative) for key, value in inputs.items()}) * scale
