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
others before combining (`krum`, `bulyan`): they tolerate f = `robust_num_malicious` arbitrary clients given
n ≥ 2f + 3 (Krum) or n ≥ 4f + 3 (Bulyan) clients a round, which the config checks against `min_clients_per_round`.

The values of `FedGRPOConfig.robust_aggregation` are the registry `choices.ROBUST_AGGREGATIONS`: 'none' (the
weighted mean, no combiner) and one registration line below per combiner, each a file owning its checks of the
config and the fewest clients it needs (`RobustCombiner`): 'trimmed_mean', 'krum', 'multi_krum', 'bulyan', 'median'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...choices import ROBUST_AGGREGATIONS, check_choice
from .base import RobustCombiner, check_robust_clients
from .bulyan import Bulyan
from .krum import Krum, MultiKrum
from .median import CoordinateMedian
from .trimmed_mean import MIN_TRIMMED_CLIENTS, TrimmedMean

if TYPE_CHECKING:
    from ...config import FedGRPOConfig


def register_robust_aggregation(name: str, combiner_class: type[RobustCombiner]) -> None:
    """Make `name` a value of `FedGRPOConfig.robust_aggregation` (`choices.ROBUST_AGGREGATIONS`):
    `combiner_class.from_config` builds it, its `config_errors` checks the config (with its `min_clients`). The
    command line offers it from then on."""
    if not (isinstance(combiner_class, type) and issubclass(combiner_class, RobustCombiner)):
        raise TypeError(f"`combiner_class` must be a RobustCombiner subclass, got {combiner_class!r}.")
    ROBUST_AGGREGATIONS[name] = combiner_class


register_robust_aggregation("trimmed_mean", TrimmedMean)
register_robust_aggregation("krum", Krum)
register_robust_aggregation("multi_krum", MultiKrum)
register_robust_aggregation("bulyan", Bulyan)
register_robust_aggregation("median", CoordinateMedian)


def combiner_from_config(args: FedGRPOConfig) -> RobustCombiner | None:
    """The combiner `args.robust_aggregation` names; None for the plain weighted mean ('none')."""
    check_choice("robust_aggregation", args.robust_aggregation, ROBUST_AGGREGATIONS)
    combiner_class = ROBUST_AGGREGATIONS[args.robust_aggregation]
    return None if combiner_class is None else combiner_class.from_config(args)


__all__ = [
    "MIN_TRIMMED_CLIENTS",
    "Bulyan",
    "CoordinateMedian",
    "Krum",
    "MultiKrum",
    "RobustCombiner",
    "TrimmedMean",
    "check_robust_clients",
    "combiner_from_config",
    "register_robust_aggregation",
]
