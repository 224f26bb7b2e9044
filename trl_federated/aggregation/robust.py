"""Coordinate-wise robust combinations of the clients' adapters (Yin et al., "Byzantine-Robust Distributed
Learning", ICML 2018), as Flower's `FedTrimmedAvg` and `FedMedian` offer them, for every aggregation method.

By default the pseudo-gradient is Δ = Σ_i ω_i θ_i − θ (Eq. model_diff, `base.pseudo_gradient`), which one client
can move arbitrarily far within the update-norm bound. A combiner replaces the weighted mean, coordinate by
coordinate, over the n clients that reported:

    TrimmedMean(β)   sort the n values; drop the k = max(1, ⌊β n⌋) smallest and the k largest (at least one:
                     Flower's ⌊β n⌋ alone trims nothing with n < 1/β, 5 clients at β = 0.2, and silently
                     leaves the plain mean; so n ≥ 3 is required);
                     C = Σ_{i kept} ω_i θ_i / Σ_{i kept} ω_i        (ω equal: see below)
    CoordinateMedian C = the median of the n values (the mean of the two middle ones for even n); ω is ignored

and Δ = C − θ. A trimmed mean with k ≥ 1 ignores up to k arbitrary values per coordinate and per side; a median,
fewer than half of the clients. Both keep the method's server step (SGD or Adam) and its per-client state (RPG's
φ, σ), but not its weighting: the aggregator passes every combiner equal weights (`Aggregator.aggregate`), since
weights a client influences (its R̄ under RPG, its sample count) would let it take most of what the combiner keeps
(a client lying about its R̄ within the allowed range took ω = 0.815: 0.85 of a Multi-Krum average of four, 0.90
of a trimmed mean of three).

Krum, Multi-Krum and Bulyan (Flower's strategies of the same names) select whole clients by their distances to the
others before combining (`Krum`, `Bulyan` below): they tolerate f = `robust_num_malicious` arbitrary clients given
n ≥ 2f + 3 (Krum) or n ≥ 4f + 3 (Bulyan) clients a round, which the config checks against `min_clients_per_round`.
"""

from __future__ import annotations

import math

import torch

from ..choices import MIN_TRIMMED_CLIENTS, ROBUST_AGGREGATIONS, check_choice, min_robust_clients


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


def squared_distances(client_states: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The n × n matrix of ‖θ_i − θ_j‖² over every entry of the adapters, in float64 sums of float32 tensors."""
    n = len(client_states)
    distances = torch.zeros(n, n, dtype=torch.float64)
    for key in client_states[0]:
        flat = torch.stack([state[key].float().reshape(-1) for state in client_states])
        distances += torch.cdist(flat, flat).double().square()
    return distances


def krum_scores(distances: torch.Tensor, num_malicious: int) -> torch.Tensor:
    """Krum's score of each client (Blanchard et al. 2017, Eq. 3): the sum of its squared distances to its
    n − f − 2 nearest other clients, and to one at least (as Flower's): Bulyan's last picks run Krum over 2f + 1
    candidates, where n − f − 2 is 0 and every score would be 0, the pick then going by client index."""
    n = distances.shape[0]
    nearest = max(1, n - num_malicious - 2)
    others = distances + torch.diag(torch.full((n,), math.inf, dtype=distances.dtype))  # no client is its own
    return others.sort(dim=1).values[:, :nearest].sum(dim=1)


def check_robust_clients(name: str, n: int, num_malicious: int) -> None:
    """`ValueError` unless `n` clients let `name` tolerate `num_malicious` (`choices.min_robust_clients`)."""
    needed = min_robust_clients(name, num_malicious)
    if n < needed:
        raise ValueError(
            f"robust_aggregation={name!r} with robust_num_malicious={num_malicious} needs at least {needed} clients "
            f"a round; this aggregation has {n}."
        )


class Krum:
    """Krum and Multi-Krum (Blanchard et al., "Machine Learning with Adversaries: Byzantine Tolerant Gradient
    Descent", NeurIPS 2017), as Flower's `Krum` and `MultiKrum`: the m clients of lowest score (`krum_scores`,
    distances over the whole adapter) are kept, and C = Σ_{i kept} ω_i θ_i / Σ_{i kept} ω_i, the weights passed
    (equal, from the aggregator) renormalised over them. m = 1 is Krum (C is the chosen client's adapter); Multi-Krum
    keeps m = n − f by default, and never more than n − f. Tolerates f = `num_malicious` arbitrary clients among
    n ≥ 2f + 3.

    The selection needs every entry of every adapter, the aggregation combines one block of entries at a time:
    `prepare` selects once per aggregation, `pseudo_gradient` combines each block of the clients selected."""

    def __init__(self, num_malicious: int = 1, num_selected: int | None = 1):
        if isinstance(num_malicious, bool) or not isinstance(num_malicious, int) or num_malicious < 0:
            raise ValueError(f"`robust_num_malicious` must be an integer >= 0, got {num_malicious!r}.")
        if num_selected is not None and (not isinstance(num_selected, int) or num_selected < 1):
            raise ValueError(f"`robust_num_selected` must be a positive integer or None, got {num_selected!r}.")
        self.num_malicious, self.num_selected = num_malicious, num_selected
        self.name = "krum" if num_selected == 1 else "multi_krum"
        self.selected: list[int] = []

    def prepare(self, global_state: dict[str, torch.Tensor], client_states: list[dict[str, torch.Tensor]]) -> None:
        n = len(client_states)
        check_robust_clients(self.name, n, self.num_malicious)
        # never more than n − f: a round that dropouts left smaller would otherwise average an attacker in
        m = min(self.num_selected or n - self.num_malicious, n - self.num_malicious)
        scores = krum_scores(squared_distances(client_states), self.num_malicious)
        self.selected = sorted(scores.argsort(stable=True)[:m].tolist())

    def applied_weights(self, weights: list[float]) -> list[float]:
        """The weight each client takes in C: the method's `weights` renormalised over the clients selected (equal
        when theirs are all 0), 0 for the others."""
        total = sum(weights[i] for i in self.selected)
        return [
            (weights[i] / total if total > 0 else 1 / len(self.selected)) if i in self.selected else 0.0
            for i in range(len(weights))
        ]

    def pseudo_gradient(
        self, global_state: dict[str, torch.Tensor], client_states: list[dict[str, torch.Tensor]], weights: list[float]
    ) -> dict[str, torch.Tensor]:
        omega = self.applied_weights(weights)
        delta = {}
        for key, reference in global_state.items():
            combined = sum(omega[i] * client_states[i][key].float() for i in self.selected)
            delta[key] = combined - reference.float()
        return delta


class Bulyan:
    """Bulyan (El Mhamdi et al., "The Hidden Vulnerability of Distributed Learning in Byzantium", ICML 2018), as
    Flower's `Bulyan`: θ = n − 2f clients are selected by Krum applied recursively (each round of selection removes the
    client Krum picks from the candidates), then, per coordinate, the β = θ − 2f selected values closest to their
    median are averaged (unweighted, as the paper). Tolerates f = `num_malicious` arbitrary clients among n ≥ 4f + 3.
    The method's weights are not used: a weight a client influences would let it steer the selection's average."""

    name = "bulyan"

    def __init__(self, num_malicious: int = 1):
        if isinstance(num_malicious, bool) or not isinstance(num_malicious, int) or num_malicious < 0:
            raise ValueError(f"`robust_num_malicious` must be an integer >= 0, got {num_malicious!r}.")
        self.num_malicious = num_malicious
        self.selected: list[int] = []

    def prepare(self, global_state: dict[str, torch.Tensor], client_states: list[dict[str, torch.Tensor]]) -> None:
        n, f = len(client_states), self.num_malicious
        check_robust_clients(self.name, n, f)
        distances = squared_distances(client_states)
        candidates, selected = list(range(n)), []
        while len(selected) < n - 2 * f:
            # Krum over the remaining candidates, with the f they may still hold
            scores = krum_scores(distances[candidates][:, candidates], f)
            selected.append(candidates.pop(int(scores.argmin())))
        self.selected = sorted(selected)

    def pseudo_gradient(
        self, global_state: dict[str, torch.Tensor], client_states: list[dict[str, torch.Tensor]], weights: list[float]
    ) -> dict[str, torch.Tensor]:
        beta = len(self.selected) - 2 * self.num_malicious
        delta = {}
        for key, reference in global_state.items():
            values = torch.stack([client_states[i][key].float() for i in self.selected])  # θ × shape
            median = values.median(dim=0).values if len(self.selected) % 2 else values.quantile(0.5, dim=0)
            closest = (values - median).abs().argsort(dim=0, stable=True)[:beta]
            delta[key] = values.gather(0, closest).mean(0) - reference.float()
        return delta


def combiner_from_config(args) -> TrimmedMean | CoordinateMedian | Krum | Bulyan | None:
    """The combiner `args.robust_aggregation` names; None for the plain weighted mean."""
    check_choice("robust_aggregation", args.robust_aggregation, ROBUST_AGGREGATIONS)
    if args.robust_aggregation == "trimmed_mean":
        return TrimmedMean(args.robust_trim_fraction)
    if args.robust_aggregation == "median":
        return CoordinateMedian()
    if args.robust_aggregation == "krum":
        return Krum(args.robust_num_malicious, 1)
    if args.robust_aggregation == "multi_krum":
        return Krum(args.robust_num_malicious, args.robust_num_selected)
    if args.robust_aggregation == "bulyan":
        return Bulyan(args.robust_num_malicious)
    return None
