import logging

import pytest
import yaml
from transformers import HfArgumentParser
from trl import GRPOConfig, TrlParser

from trl_federated import FedDAPOConfig, FedGRPOConfig, FedGSPOConfig
from trl_federated.choices import NORM_ACTIONS, TRANSFER_DTYPES
from trl_federated.config import TRL_RESULT_FIELDS, ResultHelp, result_fields
from trl_federated.config.declared_fields import declared_annotations


def make(tmp_path, **kwargs):
    return FedGRPOConfig(output_dir=str(tmp_path), bf16=False, **kwargs)


def test_defaults_are_the_papers(tmp_path):
    args = make(tmp_path)
    assert isinstance(args, GRPOConfig)
    assert (args.rpg_lambda_base, args.rpg_tau_min, args.rpg_tau_max) == (0.8, 1.5, 2.5)
    assert (args.rpg_sigma_min, args.rpg_sigma_max, args.rpg_lambda_anneal) == (0.05, 0.2, 0.1)
    assert (args.server_beta1, args.server_beta2) == (0.9, 0.99)
    # FGRPO's step by experiment (docs/methods.md), not the paper's Adam, which stays one switch away
    assert args.aggregation == "rpg" and args.server_optimizer == "sgd" and args.server_learning_rate == 1.0
    assert args.derived_server_fields == {"server_optimizer", "server_learning_rate", "server_epsilon"}
    # the server rates are derived: 0.5 x local_steps x learning_rate for Adam, 1 for SGD; an explicit one is kept
    paper = make(tmp_path, server_optimizer="adam")
    assert paper.server_learning_rate == pytest.approx(0.5 * paper.local_steps * paper.learning_rate)
    assert paper.server_epsilon == 1e-8  # the paper's
    explicit = make(tmp_path, server_learning_rate=1e-3)
    assert explicit.server_learning_rate == 1e-3 and "server_learning_rate" not in explicit.derived_server_fields


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


def test_rpgs_ranges_are_its_own_checked_through_the_registry(tmp_path):
    # `RPGAggregator.config_errors`, which the config calls for the aggregation it names: one rule for the config's
    # `rpg_*` fields and the aggregator's arguments, and a config of another aggregation does not read them.
    from trl_federated.aggregation import RPGAggregator

    with pytest.raises(ValueError, match="`rpg_tau_min` \\(3.0\\) must not exceed `rpg_tau_max`"):
        make(tmp_path, aggregation="rpg", rpg_tau_min=3.0)
    with pytest.raises(ValueError, match="`rpg_tau_min` \\(3.0\\) must not exceed `rpg_tau_max`"):
        RPGAggregator(tau_min=3.0)
    assert make(tmp_path, aggregation="fedavg", rpg_tau_min=3.0).rpg_tau_min == 3.0


def test_parses_from_yaml_and_command_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {"output_dir": str(tmp_path), "bf16": False, "num_rounds": 4, "aggregation": "fedavg",
             "dirichlet_alpha": "inf"}
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


# `checkpoint.RESULT_FIELDS` as it was hand-kept before `result_fields` derived it from the fields.
HAND_KEPT_RESULT_FIELDS = (
    # the federation
    "seed", "local_steps", "reward_window", "fraction_train", "min_train_clients", "fedprox_mu", "scaffold_correction",
    "rpg_lambda_base", "rpg_iota", "rpg_sigma_min", "rpg_sigma_max", "rpg_tau_min", "rpg_tau_max",
    "rpg_lambda_anneal", "rpg_eps", "rpg_h_max", "rpg_gain", "rpg_noise_threshold", "rpg_signal", "rpg_signal_items",
    "aggregation_args",
    "server_optimizer_args",
    "server_learning_rate", "server_beta1", "server_beta2", "server_epsilon", "server_bias_correction",
    "update_norm_bound", "update_norm_action", "robust_aggregation", "robust_trim_fraction", "max_client_samples",
    "robust_num_malicious", "robust_num_selected",
    # differential privacy (its budget, δ and noise seed do not change what a round computes)
    "dp_noise_multiplier", "dp_clip_norm", "dp_reward_noise_multiplier", "dp_adaptive_clipping", "dp_target_quantile",
    "dp_clip_norm_lr", "dp_clipped_count_stddev", "dp_record_noise_multiplier", "dp_record_epsilon",
    "dp_record_clip_norm", "dp_record_reward_noise_multiplier",
    # local training
    "learning_rate", "lr_scheduler_type", "warmup_ratio", "warmup_steps", "optim", "weight_decay", "adam_beta1",
    "adam_beta2", "adam_epsilon", "max_grad_norm", "per_device_train_batch_size", "gradient_accumulation_steps",
    "num_generations", "steps_per_generation", "num_iterations", "max_completion_length", "temperature", "top_p",
    "top_k", "beta", "epsilon", "epsilon_high", "loss_type", "importance_sampling_level", "scale_rewards",
    "reward_weights", "mask_truncated_completions",
)  # fmt: skip


@pytest.mark.parametrize("config_class", [FedGRPOConfig, FedDAPOConfig, FedGSPOConfig])
def test_result_fields_are_the_hand_kept_list(tmp_path, config_class):
    names = result_fields(config_class)
    assert len(names) == len(set(names))
    # `warmup_ratio` is no field of transformers >= 5.23: the run identity always skipped it
    assert "warmup_ratio" not in config_class.__dataclass_fields__
    assert set(names) == set(HAND_KEPT_RESULT_FIELDS) - {"warmup_ratio"}
    assert result_fields(make(tmp_path)) == result_fields(FedGRPOConfig)
    fields = FedGRPOConfig.__dataclass_fields__
    marked = {name for name, f in fields.items() if isinstance(f.metadata.get("help"), ResultHelp)}
    # TRL_RESULT_FIELDS also names RLOOConfig's own (`normalize_advantages`, `reward_clip_range`), which GRPO lacks
    assert marked | (set(TRL_RESULT_FIELDS) & set(fields)) == set(HAND_KEPT_RESULT_FIELDS) - {"warmup_ratio"}
    assert not marked & set(TRL_RESULT_FIELDS)
    assert not marked & set(GRPOConfig.__dataclass_fields__)  # TRL's fields are named in TRL_RESULT_FIELDS


def own_fields(config_class) -> list[str]:
    """The fields `config_class` declares, in its body or in its field mixins (`declared_fields`)."""
    return list(declared_annotations(config_class))


def test_own_fields_are_every_field_a_config_does_not_inherit_unchanged():
    # The list the type checks, the docs' reference and the tests above read misses no field of the federation's
    inherited = {FedGRPOConfig: GRPOConfig, FedDAPOConfig: FedGRPOConfig, FedGSPOConfig: FedGRPOConfig}
    for config_class, parent in inherited.items():
        parent_fields = parent.__dataclass_fields__
        changed = {name for name, f in config_class.__dataclass_fields__.items() if parent_fields.get(name) is not f}
        assert set(own_fields(config_class)) == changed, config_class
    assert {"num_rounds", "update_norm_bound", "dp_noise_multiplier", "resume_allow_changes"} <= set(
        own_fields(FedGRPOConfig)
    )


@pytest.mark.parametrize("config_class", [FedGRPOConfig, FedDAPOConfig, FedGSPOConfig])
def test_help_formats_and_every_own_field_is_documented(config_class):
    for parser in (HfArgumentParser(config_class), TrlParser((config_class,))):
        text = parser.format_help()  # argparse fills the help's %-placeholders: a bare % would raise here
        assert "--num_rounds" in text
    parameters = config_class.__doc__.split("Parameters:", 1)[1]
    for name in own_fields(config_class):
        assert config_class.__dataclass_fields__[name].metadata.get("help"), name
        assert f"\n        {name} (`" in parameters, name


def test_each_choice_list_is_the_fields_choices_and_its_validation(tmp_path, registries_as_recorded):
    for name, f in FedGRPOConfig.__dataclass_fields__.items():
        if "choices" in f.metadata and name in own_fields(FedGRPOConfig):
            assert make(tmp_path, **{name: list(f.metadata["choices"])[-1]})
            with pytest.raises(ValueError, match=f"`{name}` must be"):
                make(tmp_path, **{name: "no-such-choice"})
    assert FedGRPOConfig.__dataclass_fields__["update_norm_action"].metadata["choices"] == list(NORM_ACTIONS)
    assert FedGRPOConfig.__dataclass_fields__["transfer_dtype"].metadata["choices"] is TRANSFER_DTYPES  # its registry
    assert list(TRANSFER_DTYPES)[:5] == ["float32", "bfloat16", "int8", "nf4", "fp4"]
    with pytest.raises(ValueError, match="`scaffold_correction` must be 'decoupled' or 'gradient', got 'x'"):
        make(tmp_path, scaffold_correction="x")
    with pytest.raises(ValueError, match="`robust_aggregation` must be 'none', 'trimmed_mean', 'krum', 'multi_krum', "
                       "'bulyan' or 'median', got 'x'"):
        make(tmp_path, robust_aggregation="x")


def test_an_unset_bf16_does_not_stop_a_machine_without_an_accelerator(tmp_path):
    """TRL turns bf16 on unless fp16 is; TrainingArguments then refuses a machine with no bf16 accelerator unless
    `use_cpu` is set. A federation with nothing said about device or precision must start on such a machine: on the
    CPU (as the quickstart, which names no device, so that it runs on a GPU where there is one), in bf16 where the
    CPU computes it natively."""
    import torch

    from trl_federated.runtime.devices import has_native_bf16

    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    args = FedGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2)
    assert args.use_cpu is True and args.device.type == "cpu"
    assert args.bf16 is has_native_bf16(torch.device("cpu"))


def test_an_unset_bf16_on_cpu_follows_the_cpus_native_bf16(tmp_path, monkeypatch):
    """With `use_cpu`, an unset bf16 is TRL's default (on) where the CPU computes bf16 natively, off where bf16 would
    be emulated; an explicit value is kept either way."""
    from trl_federated.config import building as config_module

    def make(**values):
        return FedGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, use_cpu=True,
                             **values)  # fmt: skip

    for native in (True, False):
        monkeypatch.setattr(config_module, "has_native_bf16", lambda device, native=native: native)
        assert make().bf16 is native
        assert make(bf16=True).bf16 is True and make(bf16=False).bf16 is False


def test_the_trl_defaults_a_federated_config_changes_are_said_once(tmp_path, caplog):
    from trl_federated import config as config_module

    assert config_module.changed_trl_defaults(FedGRPOConfig) == {
        "lr_scheduler_type": ("linear", "constant"), "loss_type": ("dapo", "grpo")}
    config_module._NOTICED.discard(FedGRPOConfig)
    with caplog.at_level(logging.WARNING, logger="trl_federated.config"):
        FedGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
        FedGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    (notice,) = [record.getMessage() for record in caplog.records if "changes TRL's defaults" in record.getMessage()]
    assert "`lr_scheduler_type` 'constant' (TRL: 'linear')" in notice and "`loss_type` 'grpo' (TRL: 'dapo')" in notice
    config_module._NOTICED.discard(FedGRPOConfig)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_federated.config"):  # both set by the user: nothing to say
        FedGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", loss_type="dapo",
                      lr_scheduler_type="linear")
    assert "changes TRL's defaults" not in caplog.text


def test_an_unset_reward_window_is_five_within_the_local_steps(tmp_path):
    # W unset takes min(5, E): a run of one local step needs no `reward_window` of its own (it used to be refused)
    def config(**values):
        return FedGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **values)

    assert [config(local_steps=steps).reward_window for steps in (1, 2, 5, 10)] == [1, 2, 5, 5]
    assert config(local_steps=10, reward_window=3).reward_window == 3
    with pytest.raises(ValueError, match=r"`reward_window` \(W=6\) must not exceed `local_steps` \(E=5\)"):
        config(local_steps=5, reward_window=6)
    args = TrlParser((FedGRPOConfig,)).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false", "--local_steps", "1"]
    )[0]
    assert (args.local_steps, args.reward_window) == (1, 1)
