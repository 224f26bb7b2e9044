"""Server-side aggregation strategies, one small class per idea, and the one table of the aggregations a
`FedGRPOConfig` may name (`AGGREGATIONS`, `register_aggregation`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..choices import AGGREGATIONS, SERVER_OPTIMIZERS, Aggregation, check_choice
from ..config.checks import wants_record_privacy
from .base import AggregationError, Aggregator, pseudo_gradient
from .fedavg import FedAvgAggregator
from .privacy import RecordPrivacyReports
from .robust import (
    Bulyan,
    CoordinateMedian,
    Krum,
    MultiKrum,
    RobustCombiner,
    TrimmedMean,
    combiner_from_config,
    register_robust_aggregation,
)
from .rpg import RPGAggregator
from .scaffold import ScaffoldAggregator
from .server_optim import (
    ServerAdam,
    ServerFedAdam,
    ServerNesterov,
    ServerNormMatchedAdam,
    ServerOptimizer,
    ServerSGD,
    register_server_optimizer,
)
from .update import ClientHook, ClientUpdate, RoundMetric

if TYPE_CHECKING:
    from ..config import FedGRPOConfig

logger = logging.getLogger(__name__)

# The round metrics of every built-in strategy (RPG's include every strategy's diagnostics): the server core reserves
# their names (`core.admission`), so that, whichever strategy the run uses, no client adds a τ to a FedAvg run's log.
STRATEGY_METRICS = tuple(RPGAggregator().round_metrics())


def server_optimizer_from_config(args: FedGRPOConfig) -> ServerOptimizer:
    """The server step `args.server_optimizer` names (`choices.SERVER_OPTIMIZERS`), with its `server_*`."""
    check_choice("server_optimizer", args.server_optimizer, SERVER_OPTIMIZERS)
    return SERVER_OPTIMIZERS[args.server_optimizer].from_config(args)


def register_aggregation(name: str, aggregator_class: type[Aggregator], server_optimizer: str | None = None) -> None:
    """Make `name` a value of `FedGRPOConfig.aggregation`: `aggregator_from_config` builds `aggregator_class` for it
    (`Aggregator.from_config`), with `server_optimizer` (one of `choices.SERVER_OPTIMIZERS`) unless the config names
    another; None keeps the method's declared one (`choices.AGGREGATIONS`; "sgd" for a new name). The
    config validates `aggregation` against the registry (`choices.AGGREGATIONS`, the one of the aggregations' names),
    which this adds the name to; the command line offers it from then on."""
    server_optimizer = server_optimizer or getattr(AGGREGATIONS.get(name), "server_optimizer", "sgd")
    if server_optimizer not in SERVER_OPTIMIZERS:
        raise ValueError(f"`server_optimizer` must be one of {list(SERVER_OPTIMIZERS)}, got {server_optimizer!r}.")
    AGGREGATIONS[name] = Aggregation(aggregator_class, server_optimizer)


# Each method's server step is the one `choices.AGGREGATIONS` declares (FGRPO: Adam; the others: SGD with
# learning rate 1, model averaging).
register_aggregation("rpg", RPGAggregator)
register_aggregation("fedavg", FedAvgAggregator)
register_aggregation("fedprox", FedAvgAggregator)  # FedProx differs on the clients only (`fedprox_mu`)
register_aggregation("scaffold", ScaffoldAggregator)


def aggregator_from_config(args: FedGRPOConfig, num_clients: int | None = None) -> Aggregator:
    """The aggregator a `FedGRPOConfig` describes (`aggregation` + `server_optimizer` fields, see `AGGREGATIONS`);
    `num_clients` (default `args.num_clients`) is the size of the federation, for a strategy that needs it."""
    server_optimizer = server_optimizer_from_config(args)
    combiner = combiner_from_config(args)  # robust_aggregation: None for the weighted mean
    # The server step's fields may have been derived (`FedGRPOConfig.resolve_server_step`): say what they are.
    origin = args.server_field_origin
    epsilon = "" if not SERVER_OPTIMIZERS[args.server_optimizer].takes_epsilon else (
        f", ε {args.server_epsilon:g} ({origin('server_epsilon')})" if args.server_epsilon is not None
        else ", ε per tensor from its first Δ")
    logger.info(
        "Aggregation %r with server optimizer %r (%s): learning rate %g (%s)%s.",
        args.aggregation, args.server_optimizer, origin("server_optimizer"), args.server_learning_rate,
        origin("server_learning_rate"), epsilon,
    )
    check_choice("aggregation", args.aggregation, AGGREGATIONS)
    aggregator_class = AGGREGATIONS[args.aggregation].aggregator_class
    aggregator = aggregator_class.from_config(args, num_clients or args.num_clients, server_optimizer, combiner)
    aggregator.reward_window = args.reward_window
    aggregator.signal_items = args.rpg_signal_items if args.rpg_signal == "held-out" else None
    if wants_record_privacy(args):
        aggregator.record_privacy = RecordPrivacyReports(args.dp_target_delta, args.dp_record_clip_norm)
    return aggregator


__all__ = [
    "AGGREGATIONS",
    "STRATEGY_METRICS",
    "Aggregation",
    "AggregationError",
    "Aggregator",
    "ClientHook",
    "ClientUpdate",
    "CoordinateMedian",
    "FedAvgAggregator",
    "RPGAggregator",
    "RoundMetric",
    "ScaffoldAggregator",
    "ServerAdam",
    "ServerFedAdam",
    "ServerNesterov",
    "ServerNormMatchedAdam",
    "ServerOptimizer",
    "ServerSGD",
    "TrimmedMean",
    "Krum",
    "MultiKrum",
    "RobustCombiner",
    "Bulyan",
    "aggregator_from_config",
    "pseudo_gradient",
    "register_aggregation",
    "register_robust_aggregation",
    "register_server_optimizer",
    "server_optimizer_from_config",
]
