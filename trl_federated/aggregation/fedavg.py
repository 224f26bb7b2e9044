"""FedAvg (McMahan et al., AISTATS 2017): weights proportional to the clients' data volume (paper, Appendix C)."""

from __future__ import annotations

from .base import Aggregator
from .update import ClientUpdate, check_number, data_shares


class FedAvgAggregator(Aggregator):
    """ω_i = D_i / Σ_{i' reported} D_{i'}.

    With the default `ServerSGD(learning_rate=1.0)` the new global adapter is the data-weighted average of the
    client adapters (FedAvg); with `ServerAdam` it is the paper's "w/o RPG" ablation (Table 3).
    """

    def client_weights(self, updates: list[ClientUpdate], round_idx: int) -> list[float]:
        for update in updates:
            check_number(update.num_samples, f"FedAvg: client {update.client_id!r}'s num_samples", positive_int=True)
        return data_shares(updates)
