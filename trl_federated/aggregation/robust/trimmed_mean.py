"""The coordinate-wise trimmed mean (Yin et al., "Byzantine-Robust Distributed Learning", ICML 2018), as Flower's
`FedTrimmedAvg`, but trimming at least one client at each end:

    TrimmedMean(β)   sort the n values; drop the k = max(1, ⌊β n⌋) smallest and the k largest (at least one:
                     Flower's ⌊β n⌋ alone trims nothing with n < 1/β, 5 clients at β = 0.2, and silently
                     leaves the plain mean; so n ≥ 3 is required);
                     C = Σ_{i kept} ω_i θ_i / Σ_{i kept} ω_i        (ω equal: the aggregator passes equal weights)

and Δ = C − θ. It ignores up to k arbitrary values per coordinate and per side."""

from __future__ import annotations

import math

import torch

from .base import RobustCombiner

# The fewest clients a trimmed mean combines: one trimmed at each end and one kept.
MIN_TRIMMED_CLIENTS = 3


class TrimmedMean(RobustCombiner):
    """Per coordinate, the weighted mean of the clients left after trimming the k = max(1, ⌊β n⌋) lowest and highest;
    `ValueError` for fewer than `MIN_TRIMMED_CLIENTS` clients, which leave nothing to trim."""

    name = "trimmed_mean"

    def __init__(self, trim_fraction: float = 0.2):
        if not 0 < trim_fraction < 0.5:
            raise ValueError(f"`trim_fraction` must lie in (0, 0.5), got {trim_fraction}.")
        self.trim_fraction = trim_fraction

    @classmethod
    def from_config(cls, args):
        return cls(args.robust_trim_fraction)

    @classmethod
    def min_clients(cls, num_malicious):
        return MIN_TRIMMED_CLIENTS

    @classmethod
    def config_errors(cls, args):
        if args.min_clients_per_round < MIN_TRIMMED_CLIENTS:
            yield (
                f"`robust_aggregation='trimmed_mean'` trims at least one client at each end of every coordinate, so "
                f"every round needs at least {MIN_TRIMMED_CLIENTS} clients: set `min_clients_per_round` to "
                f"{MIN_TRIMMED_CLIENTS} or more (it is {args.min_clients_per_round}), or use 'median' or 'none'."
            )

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
