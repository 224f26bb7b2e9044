"""Server-side aggregation strategies, one small class per idea."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .base import AggregationError, Aggregator, ClientUpdate, pseudo_gradient
from .fedavg import FedAvgAggregator
from .robust import CoordinateMedian, TrimmedMean, combiner_from_config
from .rpg import RPGAggregator
from .scaffold import ScaffoldAggregator
from .server_optim import ServerAdam, ServerOptimizer, ServerSGD

if TYPE_CHECKING:
    from ..config import FedGRPOConfig

logger = logging.getLogger(__name__)


def server_optimizer_from_config(args: FedGRPOConfig) -> ServerOptimizer:
    if args.server_optimizer == "sgd":
        return ServerSGD(learning_rate=args.server_learning_rate)
    return ServerAdam(
        learning_rate=args.server_learning_rate,
        beta1=args.server_beta1,
        beta2=args.server_beta2,
        epsilon=args.server_epsilon,
        bias_correction=args.server_bias_correction,
    )


def aggregator_from_config(args: FedGRPOConfig, num_clients: int | None = None) -> Aggregator:
    """The aggregator a `FedGRPOConfig` describes (`aggregation` + `server_optimizer` fields); `num_clients`
    (default `args.num_clients`) is the size of the federation, which SCAFFOLD's server step needs."""
    server_optimizer = server_optimizer_from_config(args)
    combiner = combiner_from_config(args)  # robust_aggregation: None for the weighted mean
    # `server_optimizer` may have been resolved from `aggregation` (FedGRPOConfig.__post_init__): say which it is.
    logger.info(
        "Aggregation %r with server optimizer %r (learning rate %g).",
        args.aggregation, args.server_optimizer, args.server_learning_rate,
    )
    if args.aggregation == "scaffold":
        return ScaffoldAggregator(
            num_clients=num_clients or args.num_clients, server_optimizer=server_optimizer, combiner=combiner
        )
    if args.aggregation in ("fedavg", "fedprox"):  # FedProx differs on the clients only
        return FedAvgAggregator(server_optimizer=server_optimizer, combiner=combiner)
    return RPGAggregator(
        lambda_base=args.rpg_lambda_base,
        iota=args.rpg_iota,
        sigma_min=args.rpg_sigma_min,
        sigma_max=args.rpg_sigma_max,
        tau_min=args.rpg_tau_min,
        tau_max=args.rpg_tau_max,
        lambda_anneal=args.rpg_lambda_anneal,
        eps=args.rpg_eps,
        h_max=args.rpg_h_max,
        server_optimizer=server_optimizer,
        combiner=combiner,
    )


__all__ = [
    "AggregationError",
    "Aggregator",
    "ClientUpdate",
    "CoordinateMedian",
    "FedAvgAggregator",
    "RPGAggregator",
    "ScaffoldAggregator",
    "ServerAdam",
    "ServerOptimizer",
    "ServerSGD",
    "TrimmedMean",
    "aggregator_from_config",
    "pseudo_gradient",
    "server_optimizer_from_config",
]
