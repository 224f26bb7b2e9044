import pytest
import yaml
from trl import GRPOConfig, TrlParser

from trl_federated import FedGRPOConfig


def make(tmp_path, **kwargs):
    return FedGRPOConfig(output_dir=str(tmp_path), bf16=False, **kwargs)


def test_defaults_are_the_papers(tmp_path):
    args = make(tmp_path)
    assert isinstance(args, GRPOConfig)
    assert (args.rpg_lambda_base, args.rpg_tau_min, args.rpg_tau_max) == (0.8, 1.5, 2.5)
    assert (args.rpg_sigma_min, args.rpg_sigma_max, args.rpg_lambda_anneal) == (0.05, 0.2, 0.1)
    assert (args.server_beta1, args.server_beta2, args.server_epsilon) == (0.9, 0.99, 1e-8)
    assert args.aggregation == "rpg" and args.server_optimizer == "adam"
    assert args.server_learning_rate == 1e-3
    assert make(tmp_path, server_optimizer="sgd").server_learning_rate == 1.0


def test_every_federated_field_has_help():
    federated = set(FedGRPOConfig.__dataclass_fields__) - set(GRPOConfig.__dataclass_fields__)
    assert {"num_rounds", "local_steps", "reward_window", "aggregation", "rpg_iota", "server_optimizer"} <= federated
    for name in federated:
        assert FedGRPOConfig.__dataclass_fields__[name].metadata.get("help"), name


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"reward_window": 6, "local_steps": 5}, "reward_window"),
        ({"rpg_tau_min": 3.0}, "rpg_tau_min"),
        ({"rpg_sigma_min": 0.5}, "rpg_sigma_min"),
        ({"rpg_lambda_base": 0.0}, "rpg_lambda_base"),
        ({"rpg_lambda_base": 1.5}, "rpg_lambda_base"),
        ({"rpg_iota": 0.0}, "rpg_iota"),
        ({"num_rounds": 0}, "num_rounds"),
        ({"local_steps": -1}, "local_steps"),
        ({"num_clients": 0}, "num_clients"),
        ({"aggregation": "median"}, "aggregation"),
        ({"server_optimizer": "yogi"}, "server_optimizer"),
        ({"server_learning_rate": 0.0}, "server_learning_rate"),
        ({"server_beta1": 1.0}, "server_beta1"),
        ({"dirichlet_alpha": 0.0}, "dirichlet_alpha"),
        ({"rpg_h_max": -1.0}, "rpg_h_max"),
        ({"eval_every": -2}, "eval_every"),
        ({"beta": -0.1}, "beta"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ],
)
def test_out_of_range_values_name_the_field(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        make(tmp_path, **overrides)


def test_parses_from_yaml_and_command_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {"output_dir": str(tmp_path), "bf16": False, "num_rounds": 4, "aggregation": "fedavg", "dirichlet_alpha": "inf"}
        )
    )
    (args,) = TrlParser((FedGRPOConfig,)).parse_args_and_config(
        ["--config", str(config), "--local_steps", "6", "--reward_window", "3", "--rpg_h_max", "2.5"]
    )
    assert (args.num_rounds, args.local_steps, args.reward_window) == (4, 6, 3)
    assert args.aggregation == "fedavg" and args.dirichlet_alpha == float("inf") and args.rpg_h_max == 2.5


@pytest.mark.parametrize(
    "field",
    ["rpg_lambda_anneal", "server_learning_rate", "server_epsilon", "rpg_eps", "rpg_tau_max", "rpg_tau_min",
     "rpg_sigma_max", "rpg_h_max", "fedprox_mu", "client_timeout", "server_beta2", "learning_rate", "beta"],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused_by_name(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"`{field}` must be a finite number"):
        make(tmp_path, **{field: value})


def test_only_dirichlet_alpha_may_be_infinite(tmp_path):
    assert make(tmp_path, dirichlet_alpha=float("inf")).dirichlet_alpha == float("inf")
    with pytest.raises(ValueError, match="`dirichlet_alpha`"):
        make(tmp_path, dirichlet_alpha=float("nan"))


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_rounds", "3"), ("local_steps", 2.0), ("num_clients", True), ("rpg_h_max", "big"), ("aggregation", 3),
     ("dirichlet_alpha", "lots"), ("server_bias_correction", "yes"), ("client_timeout", [60])],
)
def test_wrong_types_are_refused_by_name(tmp_path, field, value):
    with pytest.raises(TypeError, match=f"`{field}` must be of type"):
        make(tmp_path, **{field: value})
