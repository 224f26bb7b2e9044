"""Robust aggregation (trl_federated/aggregation/robust/): the trimmed mean and the median by hand, for every
method."""


import pytest
import torch

from test_aggregation import GLOBAL, scaffold_update, update
from trl_federated.aggregation import (
    CoordinateMedian,
    TrimmedMean,
    aggregator_from_config,
)


def test_trimmed_mean_and_median_by_hand():
    theta = {"w": torch.zeros(2)}
    values = [[1.0, -5.0], [2.0, 0.0], [3.0, 1.0], [100.0, 2.0], [4.0, 1e6]]
    updates = [update(f"c{i}", v, num_samples=n) for i, (v, n) in enumerate(zip(values, [1, 1, 2, 1, 1]))]
    weights = [0.1, 0.2, 0.3, 0.2, 0.2]
    # β = 0.2 of 5 clients: one trimmed at each end, per coordinate; the rest weighted by their renormalised ω
    delta = TrimmedMean(0.2).pseudo_gradient(theta, [u.state for u in updates], weights)
    # coordinate 0 keeps 2, 3, 4 (weights .2, .3, .2); coordinate 1 keeps 0, 1, 2 (weights .2, .3, .2)
    torch.testing.assert_close(
        delta["w"], torch.tensor([(0.2 * 2 + 0.3 * 3 + 0.2 * 4) / 0.7, (0.3 * 1 + 0.2 * 2) / 0.7])
    )
    delta = CoordinateMedian().pseudo_gradient(theta, [u.state for u in updates[:4]], weights[:4])
    torch.testing.assert_close(delta["w"], torch.tensor([2.5, 0.5]))  # even n: the mean of the two middle values
    # ⌊β n⌋ = 0 still trims one at each end: 4 clients at β = 0.2 keep the middle two per coordinate
    delta = TrimmedMean(0.2).pseudo_gradient(theta, [u.state for u in updates[:4]], weights[:4])
    torch.testing.assert_close(delta["w"], torch.tensor([(0.2 * 2 + 0.3 * 3) / 0.5, (0.2 * 0 + 0.3 * 1) / 0.5]))
    with pytest.raises(ValueError, match="needs at least 3 clients for it; this aggregation has 2"):
        TrimmedMean(0.2).pseudo_gradient(theta, [u.state for u in updates[:2]], weights[:2])
    with pytest.raises(ValueError, match=r"must lie in \(0, 0.5\)"):
        TrimmedMean(0.0)


@pytest.mark.parametrize("aggregation", ["rpg", "fedavg", "fedprox", "scaffold"])
@pytest.mark.parametrize("robust", ["trimmed_mean", "median"])
def test_robust_aggregation_is_selectable_for_every_method(tmp_path, aggregation, robust):
    from trl_federated import FedGRPOConfig

    args = FedGRPOConfig(output_dir=str(tmp_path), bf16=False, aggregation=aggregation, server_optimizer="sgd",
                         robust_aggregation=robust, robust_trim_fraction=0.25, num_clients=4,
                         min_clients_per_round=3)
    aggregator = aggregator_from_config(args)
    assert isinstance(aggregator.combiner, TrimmedMean if robust == "trimmed_mean" else CoordinateMedian)
    # one client far off in every coordinate: both robust combinations ignore it
    updates = [scaffold_update(f"c{i}", [1.0 + i, 1.0 + i, 1.0 + i], 0.5, 1) for i in range(3)]
    updates.append(scaffold_update("poison", [1e6, -1e6, 1e6], 0.5, 1))
    new = aggregator.aggregate(GLOBAL, updates, 0)
    assert new["w"].abs().max() < 10
