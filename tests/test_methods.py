"""The table of named methods, read by `trl-federated compare`, the model card and the benchmarks."""

import pytest

from trl_federated.choices import AGGREGATIONS, SERVER_OPTIMIZERS
from trl_federated.config import CONFIG_CLASSES, FedDAPOConfig, FedGRPOConfig, FedGSPOConfig
from trl_federated.methods import ABLATIONS, METHODS
from trl_federated.reports.hub import method_name


def test_every_method_is_a_valid_configuration():
    assert len({method.display_name for method in METHODS.values()}) == len(METHODS)
    for name, method in METHODS.items():
        assert method.name == name
        assert method.aggregation in AGGREGATIONS and method.server_optimizer in SERVER_OPTIMIZERS, name
        assert method.algorithm in CONFIG_CLASSES, name


def test_the_table_makes_the_harness_cells_and_table_3_pairs():
    # the overrides every `trl-federated compare` cell passed before the table existed
    assert {name: method.overrides() for name, method in METHODS.items()} == {
        "fgrpo": {"aggregation": "rpg", "server_optimizer": "sgd"},
        "fgrpo-noise-aware": {"aggregation": "rpg", "server_optimizer": "sgd", "rpg_gain": "noise-aware"},
        "fgrpo-held-out": {"aggregation": "rpg", "server_optimizer": "sgd", "rpg_signal": "held-out"},
        "fgrpo-paper": {"aggregation": "rpg", "server_optimizer": "adam"},
        "fgrpo-paper-wo-rpg": {"aggregation": "fedavg", "server_optimizer": "adam"},
        "fgrpo-fedadam": {"aggregation": "rpg", "server_optimizer": "fedadam"},
        "fgrpo-adam-norm": {"aggregation": "rpg", "server_optimizer": "adam-norm"},
        "fgrpo-nesterov": {"aggregation": "rpg", "server_optimizer": "nesterov"},
        "fgrpo-sgd": {"aggregation": "rpg", "server_optimizer": "sgd"},
        "fedavg": {"aggregation": "fedavg", "server_optimizer": "sgd"},
        "fedprox": {"aggregation": "fedprox", "server_optimizer": "sgd"},
        "scaffold": {"aggregation": "scaffold", "server_optimizer": "sgd"},
        "fdapo": {"algorithm": "dapo", "aggregation": "rpg", "server_optimizer": "sgd"},
        "fdapo-wo-rpg": {"algorithm": "dapo", "aggregation": "fedavg", "server_optimizer": "sgd"},
        "fgspo": {"algorithm": "gspo", "aggregation": "rpg", "server_optimizer": "sgd"},
        "fgspo-wo-rpg": {"algorithm": "gspo", "aggregation": "fedavg", "server_optimizer": "sgd"},
    }
    assert list(METHODS["fdapo"].overrides()) == ["algorithm", "aggregation", "server_optimizer"]
    # with the averaging step, FGRPO w/o RPG (FedAvg's weights, the same step) is FedAvg
    assert ABLATIONS == {
        "FGRPO": ("fgrpo", "fedavg"), "FGRPO (noise-aware RPG)": ("fgrpo-noise-aware", "fedavg"),
        "FGRPO (held-out R̄)": ("fgrpo-held-out", "fedavg"),
        "FDAPO": ("fdapo", "fdapo-wo-rpg"), "FGSPO": ("fgspo", "fgspo-wo-rpg"),
        "FGRPO (paper's Adam step)": ("fgrpo-paper", "fgrpo-paper-wo-rpg"),
        "FGRPO (server SGD)": ("fgrpo-sgd", "fedavg"),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("config_class", "aggregation", "server_optimizer", "name"),
    [
        (FedGRPOConfig, "rpg", "sgd", "FGRPO"),  # not "FGRPO (server SGD)", the same configuration's later name
        (FedGRPOConfig, "rpg", "adam", "FGRPO (paper's Adam step)"),
        (FedGRPOConfig, "fedavg", "adam", "FGRPO (paper's Adam step) w/o RPG"),
        (FedGRPOConfig, "fedavg", "sgd", "FedAvg"),
        (FedGRPOConfig, "fedprox", "sgd", "FedProx"),
        (FedGRPOConfig, "scaffold", "sgd", "SCAFFOLD"),
        (FedDAPOConfig, "rpg", "sgd", "FDAPO"),
        (FedDAPOConfig, "fedavg", "sgd", "FDAPO w/o RPG"),  # FedAvg's weights and step over DAPO clients
        (FedDAPOConfig, "fedprox", "sgd", "FedProx"),  # a baseline keeps its name whatever the local algorithm
        (FedGSPOConfig, "rpg", "sgd", "FGSPO"),
        (FedGSPOConfig, "scaffold", "sgd", "SCAFFOLD"),
        (FedGRPOConfig, "scaffold", "adam", "`scaffold` + server `adam`"),  # no named method
        (FedGSPOConfig, "fedprox", "adam", "`fedprox` + server `adam`"),
    ],
)
def test_the_model_card_names_each_method_as_the_paper(tmp_path, config_class, aggregation, server_optimizer, name):
    args = config_class(
        output_dir=str(tmp_path), bf16=False, aggregation=aggregation, server_optimizer=server_optimizer
    )
    assert method_name(args) == name


def test_a_method_that_sets_another_field_names_only_the_configurations_with_its_value(tmp_path):
    args = FedGRPOConfig(output_dir=str(tmp_path), bf16=False, rpg_gain="noise-aware")
    assert method_name(args) == "FGRPO (noise-aware RPG)"
    args = FedGRPOConfig(output_dir=str(tmp_path), bf16=False, aggregation="fedavg", rpg_gain="noise-aware")
    assert method_name(args) == "FedAvg"  # rpg_gain is RPG's: FedAvg keeps its name
    args = FedGRPOConfig(output_dir=str(tmp_path), bf16=False, rpg_signal="held-out")
    assert method_name(args) == "FGRPO (held-out R̄)"


def test_fgrpo_step_is_read_as_declared_and_is_the_registered_one():
    # `methods` reads FGRPO's step without filling the registry (no torch for `trl-federated compare --help`); the
    # aggregation package's registration keeps the declared row
    from trl_federated.methods import FGRPO_STEP

    assert FGRPO_STEP == AGGREGATIONS["rpg"].server_optimizer == AGGREGATIONS.declared("rpg").server_optimizer
