"""FedAvg (McMahan et al., AISTATS 2017): weights proportional to the clients' data volume (paper, Appendix C)."""

from __future__ import annotations

from .base import Aggregator, ClientUpdate


class FedAvgAggregator(Aggregator):
    """ω_i = D_i / Σ_{i' reported} D_{i'}.

    With the default `ServerSGD(learning_rate=1.0)` the new global adapter is the data-weighted average of the
    client adapters (FedAvg); with `ServerAdam` it is the paper's "w/o RPG" ablation (Table 3).
    """

    def client_weights(self, updates: list[ClientUpdate], round_idx: int) -> list[float]:
        sizes = [update.num_samples for update in updates]
        if any(size <= 0 for size in sizes):
            raise ValueError(f"FedAvg needs positive num_samples, got {dict(zip((u.client_id for u in updates), sizes))}.")
        total = sum(sizes)
        return [size / total for size in sizes]
