"""The coordinate-wise median (Yin et al., "Byzantine-Robust Distributed Learning", ICML 2018), as Flower's
`FedMedian`: C = the median of the n values (the mean of the two middle ones for even n), Δ = C − θ. It ignores
fewer than half of the clients, and gives up the method's weighting, since weights a client influences (its R̄, its
sample count) would let it steer a weighted median."""

from __future__ import annotations

import torch

from .base import RobustCombiner


class CoordinateMedian(RobustCombiner):
    """Per coordinate, the median of the clients' values; the weights are not used."""

    name = "median"

    @classmethod
    def from_config(cls, args):
        return cls()

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
