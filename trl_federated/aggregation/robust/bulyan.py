"""Bulyan (El Mhamdi et al., "The Hidden Vulnerability of Distributed Learning in Byzantium", ICML 2018), as Flower's
`Bulyan`: recursive Krum, then a trimmed mean around the median; it tolerates f = `robust_num_malicious` arbitrary
clients given n ≥ 4f + 3 a round."""

from __future__ import annotations

import torch

from .base import RobustCombiner, check_robust_clients
from .krum import krum_scores, squared_distances


class Bulyan(RobustCombiner):
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

    @classmethod
    def from_config(cls, args):
        return cls(args.robust_num_malicious)

    @classmethod
    def min_clients(cls, num_malicious):
        return 4 * num_malicious + 3  # El Mhamdi et al. 2018

    def prepare(self, global_state: dict[str, torch.Tensor], client_states: list[dict[str, torch.Tensor]]) -> None:
        n, f = len(client_states), self.num_malicious
        check_robust_clients(self.name, n, f, self.min_clients(f))
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
