"""Krum, Multi-Krum and Bulyan (`aggregation.robust`): against their definitions (Blanchard et al. 2017; El Mhamdi et
al. 2018), against one attacker through the server core, and their client-count requirements at config time."""

import json
from pathlib import Path

import pytest
import torch

from test_untrusted import honest_round, make_server, moved
from trl_federated import ClientUpdate, FedGRPOConfig
from trl_federated.aggregation import Bulyan, FedAvgAggregator, Krum, ServerSGD
from trl_federated.aggregation.robust.krum import krum_scores, squared_distances


def states(vectors):
    """Adapters of two entries from flat vectors (the distances run over every entry)."""
    return [{"a": torch.tensor(v[:2], dtype=torch.float32), "b": torch.tensor(v[2:], dtype=torch.float32)}
            for v in vectors]


def definition_scores(vectors, f):
    """Eq. 3 of Blanchard et al.: the sum of the n − f − 2 smallest squared distances to the other clients."""
    scores = []
    for i, v in enumerate(vectors):
        others = sorted(sum((x - y) ** 2 for x, y in zip(v, w)) for j, w in enumerate(vectors) if j != i)
        scores.append(sum(others[: len(vectors) - f - 2]))
    return scores


VECTORS = [[0.0, 0.1, 0.2, 0.0], [0.1, 0.0, 0.1, 0.1], [0.2, 0.2, 0.0, 0.1], [0.0, 0.0, 0.1, 0.2],
           [9.0, -9.0, 9.0, 9.0], [0.1, 0.1, 0.1, 0.0], [0.3, 0.1, 0.2, 0.2]]


def test_krum_scores_are_eq_3():
    distances = squared_distances(states(VECTORS))
    for f in (0, 1, 2):
        assert krum_scores(distances, f).tolist() == pytest.approx(definition_scores(VECTORS, f))


def test_krum_picks_the_client_of_lowest_score_and_multi_krum_averages_the_m_best_with_the_methods_weights():
    clients = states(VECTORS[:5])
    zero = {"a": torch.zeros(2), "b": torch.zeros(2)}
    scores = definition_scores(VECTORS[:5], 1)
    krum = Krum(num_malicious=1, num_selected=1)
    krum.prepare(zero, clients)
    best = min(range(5), key=scores.__getitem__)
    assert krum.selected == [best]
    delta = krum.pseudo_gradient(zero, clients, [0.2] * 5)
    assert torch.equal(delta["a"], clients[best]["a"]) and torch.equal(delta["b"], clients[best]["b"])

    multi = Krum(num_malicious=1, num_selected=None)  # m = n − f = 4: the attacker (index 4) left out
    multi.prepare(zero, clients)
    assert multi.selected == [0, 1, 2, 3]
    weights = [0.1, 0.2, 0.3, 0.2, 0.2]
    delta = multi.pseudo_gradient(zero, clients, weights)
    expected = sum(w * torch.tensor(v[:2]) for w, v in zip(weights[:4], VECTORS)) / sum(weights[:4])
    assert torch.allclose(delta["a"], expected)


def test_bulyan_is_recursive_krum_then_the_mean_of_the_values_closest_to_the_median():
    clients = states(VECTORS)  # n = 7 = 4f + 3 with f = 1
    zero = {"a": torch.zeros(2), "b": torch.zeros(2)}
    bulyan = Bulyan(num_malicious=1)
    bulyan.prepare(zero, clients)
    # the definition: θ = n − 2f = 5 picks, each Krum over the candidates left
    candidates, picked = list(range(7)), []
    while len(picked) < 5:
        scores = definition_scores([VECTORS[i] for i in candidates], 1)
        picked.append(candidates.pop(min(range(len(candidates)), key=scores.__getitem__)))
    assert bulyan.selected == sorted(picked) and 4 not in picked
    delta = bulyan.pseudo_gradient(zero, clients, [1 / 7] * 7)
    flat = torch.cat([delta["a"], delta["b"]])
    for coordinate in range(4):  # β = θ − 2f = 3 values closest to the median, averaged
        values = sorted(VECTORS[i][coordinate] for i in picked)
        median = values[2]
        closest = sorted(values, key=lambda value: abs(value - median))[:3]
        assert float(flat[coordinate]) == pytest.approx(sum(closest) / 3)


@pytest.mark.parametrize(("robust", "num_clients"), [("krum", 5), ("multi_krum", 5), ("bulyan", 7)])
def test_one_attacker_does_not_move_the_global_adapter_through_the_server_core(tiny_model_dir, fast_args, robust,
                                                                               num_clients):
    """f = 1 attacker sends an update of 2 U the other way, within the norm bound; the honest clients send
    0.2-0.3 U updates in one direction. The plain mean moves with the attacker; Krum, Multi-Krum and Bulyan do not."""
    ids = [f"c{i}" for i in range(num_clients)]
    kwargs = dict(num_clients=num_clients, min_clients_per_round=num_clients, aggregation="fedavg")
    server = make_server(tiny_model_dir, fast_args, robust_aggregation=robust, robust_num_malicious=1, **kwargs)
    plain = make_server(tiny_model_dir, fast_args, **kwargs)
    for target in (server, plain):
        start = {key: value.clone() for key, value in target.global_state.items()}
        replies = {client_id: {"state": moved(target, 1.0, 0.2 + 0.02 * index)}
                   for index, client_id in enumerate(ids[:-1])}
        replies[ids[-1]] = {"state": moved(target, -1.0, 2.0)}
        record = honest_round(target, 0, client_ids=ids, **replies)
        assert ids[-1] in record.weights  # admitted: within the bound, it reaches the combiner
        shift = torch.cat([(target.global_state[key] - start[key]).view(-1) for key in start]).mean()
        if target is server:
            assert shift > 0, robust  # moved with the honest clients
            assert ids[-1] not in [ids[i] for i in server.aggregator.combiner.selected]
        else:
            assert shift < 0  # the plain mean follows the attacker


@pytest.mark.parametrize(("robust", "malicious", "needed"), [("krum", 1, 5), ("multi_krum", 2, 7), ("bulyan", 1, 7)])
def test_the_client_count_each_tolerates_is_checked_at_config_time(tmp_path, robust, malicious, needed):
    with pytest.raises(ValueError, match=f"at least {needed} a round.*min_clients_per_round"):
        FedGRPOConfig(output_dir=str(tmp_path), bf16=False, num_clients=10, robust_aggregation=robust,
                      robust_num_malicious=malicious, min_clients_per_round=needed - 1)
    FedGRPOConfig(output_dir=str(tmp_path), bf16=False, num_clients=10, robust_aggregation=robust,
                  robust_num_malicious=malicious, min_clients_per_round=needed)


def test_too_few_clients_in_a_round_is_refused_by_the_aggregation():
    aggregator = FedAvgAggregator(ServerSGD(1.0), combiner=Krum(num_malicious=1))
    zero = {"a": torch.zeros(2), "b": torch.zeros(2)}
    updates = [ClientUpdate(f"c{i}", state, 1, 0.0) for i, state in enumerate(states(VECTORS[:4]))]
    with pytest.raises(ValueError, match="needs at least 5 clients a round; this aggregation has 4"):
        aggregator.aggregate(zero, updates, 0)


def test_a_krum_run_says_which_clients_it_kept_and_the_weights_it_applied(tiny_model_dir, fast_args):
    """The round record, the round log, summary.md (with a legend of its columns) and result.json name the combiner
    and the clients it kept (`robust_selected`); ω is the weight each client took in the combination (Krum's: the
    kept clients' renormalised, 0 for the one left out), not the method's before Krum chose."""
    from trl_federated.reports.round_log import format_round_log

    ids = [f"c{i}" for i in range(5)]
    server = make_server(tiny_model_dir, fast_args, num_clients=5, min_clients_per_round=5, aggregation="fedavg",
                         robust_aggregation="multi_krum", robust_num_malicious=1)
    replies = {client_id: {"state": moved(server, 1.0, 0.2 + 0.02 * index),
                           "metrics": {"step_rewards": [0.4, 0.6]}}  # R̄ = 0.5, se(R̄) = 0.1
               for index, client_id in enumerate(ids[:-1])}
    replies[ids[-1]] = {"state": moved(server, -1.0, 2.0), "metrics": {"step_rewards": [0.4, 0.6]}}
    record = honest_round(server, 0, client_ids=ids, **replies)
    assert record.robust_selected == {"c0": 1, "c1": 1, "c2": 1, "c3": 1, "c4": 0}
    # FedAvg's 1/5 each, renormalised over the 4 kept
    assert record.weights == pytest.approx({"c0": 0.25, "c1": 0.25, "c2": 0.25, "c3": 0.25, "c4": 0.0})
    log = format_round_log(record, 1, 5)
    assert "c4: R̄ = 0.5000, se(R̄) = 0.1000" in log and "kept by multi_krum = 0, ω = 0.0000" in log
    assert "c0: R̄ = 0.5000, se(R̄) = 0.1000" in log and "kept by multi_krum = 1, ω = 0.2500" in log
    summary = (Path(server.args.output_dir) / "summary.md").read_text(encoding="utf-8")
    assert "| kept by multi_krum |" in summary and "| c4 | 0.500 | 0.1000 | - | 0 | 0 | 0.000 |" in summary
    for legend in ("- R̄: ", "- ω: ", "- se(R̄): the standard error", "- kept by multi_krum: 1: the robust combiner"):
        assert legend in summary, legend
    result = json.loads(server.write_result(Path(server.args.output_dir) / "result.json", 1.0).read_text())
    assert result["robust_aggregation"] == "multi_krum"
    assert result["rounds"][0]["robust_selected"] == record.robust_selected
    assert result["rounds"][0]["weights"]["c4"] == 0.0
