"""Krum and Multi-Krum (Blanchard et al., "Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent",
NeurIPS 2017), as Flower's strategies of those names: they select whole clients by their distances to the others
before combining, and tolerate f = `robust_num_malicious` arbitrary clients given n ≥ 2f + 3 clients a round, which
the config checks against `min_clients_per_round`."""

from __future__ import annotations

import math

import torch

from .base import RobustCombiner, check_robust_clients


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


class Krum(RobustCombiner):
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

    @classmethod
    def from_config(cls, args):
        return cls(args.robust_num_malicious, 1)

    @classmethod
    def min_clients(cls, num_malicious):
        return 2 * num_malicious + 3  # Blanchard et al. 2017, Prop. 1

    def prepare(self, global_state: dict[str, torch.Tensor], client_states: list[dict[str, torch.Tensor]]) -> None:
        n = len(client_states)
        check_robust_clients(self.name, n, self.num_malicious, self.min_clients(self.num_malicious))
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


class MultiKrum(Krum):
    """Multi-Krum: `Krum` keeping `robust_num_selected` clients (None: n − f)."""

    def __init__(self, num_malicious: int = 1, num_selected: int | None = None):
        super().__init__(num_malicious, num_selected)

    @classmethod
    def from_config(cls, args):
        return cls(args.robust_num_malicious, args.robust_num_selected)
