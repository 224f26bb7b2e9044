"""What a robust combiner is (`RobustCombiner`): a replacement for the weighted mean of the clients' adapters, with
the fewest clients a round it needs and its own checks of the configuration."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ...config import FedGRPOConfig


class RobustCombiner(ABC):
    """Combines the clients' adapters of one block of entries into the pseudo-gradient Δ, in place of the weighted
    mean (`base.pseudo_gradient`). A combiner that selects whole clients over every entry first (Krum) also defines
    `prepare(global_state, client_states)`, which the aggregator calls once per aggregation."""

    name: str  # its value of `FedGRPOConfig.robust_aggregation`

    @classmethod
    @abstractmethod
    def from_config(cls, args: FedGRPOConfig) -> RobustCombiner:
        """The combiner with the config's `robust_*` fields it reads."""

    @classmethod
    def min_clients(cls, num_malicious: int) -> int:
        """The fewest clients a round must aggregate for it to tolerate `num_malicious` arbitrary ones."""
        return 1

    @classmethod
    def config_errors(cls, args: FedGRPOConfig) -> Iterable[str]:
        """One message per setting of `args` it cannot work with (the config raises the first): by default, a
        `min_clients_per_round` below `min_clients` for a valid `robust_num_malicious`."""
        num_malicious = args.robust_num_malicious
        if not isinstance(num_malicious, int) or num_malicious < 0:
            return  # the config's own check names it
        needed = cls.min_clients(num_malicious)
        if args.min_clients_per_round < needed:
            yield (
                f"`robust_aggregation={args.robust_aggregation!r}` tolerates `robust_num_malicious` = "
                f"{num_malicious} arbitrary clients only among at least {needed} a round: set "
                f"`min_clients_per_round` to {needed} or more (it is {args.min_clients_per_round}), or lower "
                "`robust_num_malicious`."
            )

    @abstractmethod
    def pseudo_gradient(
        self, global_state: dict[str, torch.Tensor], client_states: list[dict[str, torch.Tensor]], weights: list[float]
    ) -> dict[str, torch.Tensor]:
        """Δ for the entries of `global_state` (one block of the adapter), from the clients' states and weights."""


def check_robust_clients(name: str, n: int, num_malicious: int, needed: int) -> None:
    """`ValueError` unless `n` clients reach the `needed` that let `name` tolerate `num_malicious`."""
    if n < needed:
        raise ValueError(
            f"robust_aggregation={name!r} with robust_num_malicious={num_malicious} needs at least {needed} clients "
            f"a round; this aggregation has {n}."
        )
