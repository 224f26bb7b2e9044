"""Coordinate-wise robust combinations of the clients' adapters (Yin et al., "Byzantine-Robust Distributed
Learning", ICML 2018), as Flower's `FedTrimmedAvg` and `FedMedian` offer them, for every aggregation method.

By default the pseudo-gradient is Δ = Σ_i ω_i θ_i − θ (Eq. model_diff, `base.pseudo_gradient`), which one client
can move arbitrarily far within the update-norm bound. A combiner replaces the weighted mean, coordinate by
coordinate, over the n clients that reported:

    TrimmedMean(β)   sort the n values; drop the k = max(1, ⌊β n⌋) smallest and the k largest (at least one:
                     Flower's ⌊β n⌋ alone trims nothing with n < 1/β, 5 clients at β = 0.2, and silently
                     leaves the plain mean; so n ≥ 3 is required);
                     C = Σ_{i kept} ω_i θ_i / Σ_{i kept} ω_i        (the method's weights, renormalised)
    CoordinateMedian C = the median of the n values (the mean of the two middle ones for even n); ω is ignored

and Δ = C − θ. A trimmed mean with k ≥ 1 ignores up to k arbitrary values per coordinate and per side; a median,
fewer than half of the clients. Both keep the method's server step (SGD or Adam) and its per-client state (RPG's
φ, σ); only the median gives up the method's weighting, since weights a client influences (its R̄, its sample
count) would let it steer a weighted median.
"""

from __future__ import annotations

import math

import torch

from ..choices import MIN_TRIMMED_CLIENTS, ROBUST_AGGREGATIONS, check_choice


class TrimmedMean:
    """Per coordinate, the weighted mean of the clients left after trimming the k = max(1, ⌊β n⌋) lowest and highest;
    `ValueError` for fewer than `MIN_TRIMMED_CLIENTS` clients, which leave nothing to trim."""

    def __init__(self, trim_fraction: float = 0.2):
        if not 0 < trim_fraction < 0.5:
            raise ValueError(f"`trim_fraction` must lie in (0, 0.5), got {trim_fraction}.")
        self.trim_fraction = trim_fraction

    def pseudo_gradient(
        self, global_state: dict[str, torch.Tensor], client_states: list[dict[str, torch.Tensor]], weights: list[float]
    ) -> dict[str, torch.Tensor]:
        n = len(client_states)
        if n < MIN_TRIMMED_CLIENTS:
            raise ValueError(
                f"robust_aggregation='trimmed_mean' trims at least one client at each end, and needs at least "
                f"{MIN_TRIMMED_CLIENTS} clients for it; this aggregation has {n}."
            )
        k = max(1, math.floor(self.trim_fraction * n))  # ⌊β n⌋ < n / 2, so one client is kept at least
        delta = {}
        for key, reference in global_state.items():
            values = torch.stack([state[key].float() for state in client_states])  # n × shape
            omega = torch.tensor(weights, dtype=torch.float32).reshape(n, *([1] * reference.dim())).expand_as(values)
            order = values.argsort(dim=0, stable=True)[k : n - k]  # the clients kept, per coordinate
            kept, kept_weights = values.gather(0, order), omega.gather(0, order)
            total = kept_weights.sum(0)
            # Weights that underflowed to 0 on every kept client: their plain mean.
            combined = torch.where(total > 0, (kept * kept_weights).sum(0) / total, kept.mean(0))
            delta[key] = combined - reference.float()
        return delta


class CoordinateMedian:
    """Per coordinate, the median of the clients' values; the weights are not used."""

    def pseudo_gradient(
        self, global_state: dict[str, torch.Tensor], client_states: list[dict[str, torch.Tensor]], weights: list[float]
    ) -> dict[str, torch.Tensor]:
        n = len(client_states)
        delta = {}
        for key, reference in global_state.items():
            values = torch.stack([state[key].float() for state in client_states]).sort(dim=0).values
            median = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
            delta[key] = median - reference.float()
        return delta


def combiner_from_config(args) -> TrimmedMean | CoordinateMedian | None:
    """The combiner `args.robust_aggregation` names; None for the plain weighted mean."""
    check_choice("robust_aggregation", args.robust_aggregation, ROBUST_AGGREGATIONS)
    if args.robust_aggregation == "trimmed_mean":
        return TrimmedMean(args.robust_trim_fraction)
    if args.robust_aggregation == "median":
        return CoordinateMedian()
    return None
