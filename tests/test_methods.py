"""The table of named methods, read by `trl-federated compare`, the model card and the benchmarks."""

import pytest

from trl_federated.aggregation import AGGREGATIONS
from trl_federated.config import (
    CONFIG_CLASSES,
    SERVER_OPTIMIZERS,
    FedDAPOConfig,
    FedGRPOConfig,
    FedGSPOConfig,
)
from trl_federated.hub import method_name
from trl_federated.methods import ABLATIONS, METHODS


def test_every_method_is_a_valid_configuration():
    assert len({method.display_name for method in METHODS.values()}) == len(METHODS)
    for name, method in METHODS.items():
        assert method.name == name
        assert method.aggregation in AGGREGATIONS and method.server_optimizer in SERVER_OPTIMIZERS, name
        assert method.algorithm in CONFIG_CLASSES, name


def test_the_table_makes_the_harness_cells_and_table_3_pairs():
    # the overrides every `trl-federated compare` cell passed before the table existed
    assert {name: method.overrides() for name, method in METHODS.items()} == {
        "fgrpo": {"aggregation": "rpg", "server_optimizer": "adam"},
        "fgrpo-fedadam": {"aggregation": "rpg", "server_optimizer": "fedadam"},
        "fgrpo-adam-norm": {"aggregation": "rpg", "server_optimizer": "adam-norm"},
        "fgrpo-nesterov": {"aggregation": "rpg", "server_optimizer": "nesterov"},
        "fgrpo-sgd": {"aggregation": "rpg", "server_optimizer": "sgd"},
        "fgrpo-wo-rpg": {"aggregation": "fedavg", "server_optimizer": "adam"},
        "fedavg": {"aggregation": "fedavg", "server_optimizer": "sgd"},
        "fedprox": {"aggregation": "fedprox", "server_optimizer": "sgd"},
        "scaffold": {"aggregation": "scaffold", "server_optimizer": "sgd"},
        "fdapo": {"algorithm": "dapo", "aggregation": "rpg", "server_optimizer": "adam"},
        "fdapo-wo-rpg": {"algorithm": "dapo", "aggregation": "fedavg", "server_optimizer": "adam"},
        "fgspo": {"algorithm": "gspo", "aggregation": "rpg", "server_optimizer": "adam"},
        "fgspo-wo-rpg": {"algorithm": "gspo", "aggregation": "fedavg", "server_optimizer": "adam"},
    }
    assert list(METHODS["fdapo"].overrides()) == ["algorithm", "aggregation", "server_optimizer"]
    assert ABLATIONS == {
        "FGRPO": ("fgrpo", "fgrpo-wo-rpg"), "FDAPO": ("fdapo", "fdapo-wo-rpg"), "FGSPO": ("fgspo", "fgspo-wo-rpg"),
        "FGRPO (server SGD)": ("fgrpo-sgd", "fedavg"),  # RPG's weights against FedAvg's, both averaging
    }  # fmt: skip


@pytest.mark.parametrize(
    ("config_class", "aggregation", "server_optimizer", "name"),
    [
        (FedGRPOConfig, "rpg", "adam", "FGRPO"),
        (FedGRPOConfig, "fedavg", "adam", "FGRPO w/o RPG"),
        (FedGRPOConfig, "fedavg", "sgd", "FedAvg"),
        (FedGRPOConfig, "fedprox", "sgd", "FedProx"),
        (FedGRPOConfig, "scaffold", "sgd", "SCAFFOLD"),
        (FedDAPOConfig, "rpg", "adam", "FDAPO"),
        (FedDAPOConfig, "fedavg", "adam", "FDAPO w/o RPG"),
        (FedDAPOConfig, "fedavg", "sgd", "FedAvg"),  # a model-averaging baseline keeps its name
        (FedGSPOConfig, "rpg", "adam", "FGSPO"),
        (FedGSPOConfig, "scaffold", "sgd", "SCAFFOLD"),
        (FedGRPOConfig, "rpg", "sgd", "FGRPO (server SGD)"),
        (FedGRPOConfig, "scaffold", "adam", "`scaffold` + server `adam`"),  # no named method
        (FedGSPOConfig, "fedprox", "adam", "`fedprox` + server `adam`"),
    ],
)
def test_the_model_card_names_each_method_as_the_paper(tmp_path, config_class, aggregation, server_optimizer, name):
    args = config_class(
        output_dir=str(tmp_path), bf16=False, aggregation=aggregation, server_optimizer=server_optimizer
    )
    assert method_name(args) == name
