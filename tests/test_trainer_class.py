"""Federating any GRPOTrainer subclass: `federated(...)`, `federated_config(...)` and the `trainer_class` argument of
the runner, the client round, the Flower ClientApp and the command line."""

import pickle
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer
from trl import GRPOConfig, GRPOTrainer, SFTTrainer, TrlParser
from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

from conftest import FAST_GRPO
from test_cli import labelled_dataset
from test_flower import LocalGrid, assert_states_equal, client_data_dirs, loopback_app, prompt_datasets, task_identity  # noqa: F401
from trl_federated import FastGRPOMixin, FederatedRunner, FedGRPOConfig, FedGRPOTrainer, RoundCallback
from trl_federated.adapters import default_lora_config, get_adapter_state
from trl_federated.arguments import config_class
from trl_federated.cli import main
from trl_federated.config import federated_config
from trl_federated.flower import make_client_app
from trl_federated.local.local_trainer import local_trainer
from trl_federated.names import import_class
from trl_federated.scoring.rewards import completion_text
from trl_federated.trainer import FederatedGRPOMixin, federated


def length_reward(completions, **kwargs):
    """Varies on the tiny model's random text (conversational completions here), so every step has a gradient."""
    return [len(completion_text(completion)) / 64 for completion in completions]


class BonusTrainer(GRPOTrainer):
    """A user's own GRPO trainer: a required constructor argument of its own, and a loss that logs it."""

    def __init__(self, *args, bonus, **kwargs):
        super().__init__(*args, **kwargs)
        self.bonus = bonus

    def _compute_loss(self, model, inputs):
        self._metrics["train"]["bonus"].append(self.bonus)
        return super()._compute_loss(model, inputs)


class ClientArgs(RoundCallback):
    """The configuration every client trainer was built with."""

    def __init__(self):
        self.args = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.args.append(args)


def federation_args(tmp_path, config_class=FedGRPOConfig, **overrides):
    values = dict(
        FAST_GRPO, output_dir=str(tmp_path / "run"), num_clients=2, dirichlet_alpha=float("inf"), num_rounds=2,
        local_steps=1, reward_window=1, seed=0,
    )  # fmt: skip
    values.update(overrides)
    return config_class(**values)


def test_gmpo_trainer_runs_two_federated_rounds_with_its_own_loss_and_config(
    tmp_path, tiny_model_dir, tiny_tokenizer, monkeypatch
):
    losses = []
    gmpo_loss = GMPOTrainer._compute_loss

    def counted_loss(self, model, inputs):
        losses.append(type(self))
        return gmpo_loss(self, model, inputs)

    monkeypatch.setattr(GMPOTrainer, "_compute_loss", counted_loss)
    FedGMPOConfig = federated_config(GMPOConfig)
    args = federation_args(tmp_path, FedGMPOConfig)
    clients = ClientArgs()
    trainer = federated(GMPOTrainer)(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward, args=args,
        train_dataset=labelled_dataset(), processing_class=tiny_tokenizer, peft_config=default_lora_config(),
        callbacks=[clients],
    )  # fmt: skip
    initial = {key: value.clone() for key, value in get_adapter_state(trainer.model).items()}
    output = trainer.train()

    assert output.metrics["num_rounds"] == 2 and output.global_step == 2 * 2 * 1  # rounds x clients x steps
    # every client step ran GMPO's loss, in the federated GMPO trainer, configured with GMPO's clipping in log space
    assert losses == [federated(GMPOTrainer)] * 4
    local = [client_args for client_args in clients.args if client_args.federation_round is not None]
    assert [client_args.federation_round for client_args in local] == [0, 0, 1, 1]
    assert all(type(client_args) is FedGMPOConfig and client_args.epsilon == 0.4 for client_args in local)
    final = get_adapter_state(trainer.model)
    assert any(not torch.equal(initial[key], final[key]) for key in initial)


def test_a_users_grpo_subclass_runs_two_federated_rounds(tmp_path, tiny_model_dir, tiny_tokenizer):
    args = federation_args(tmp_path)
    # built positionally, with the subclass's own keyword argument: both reach every client's trainer
    trainer = federated(BonusTrainer)(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args, train_dataset=labelled_dataset(),
        processing_class=tiny_tokenizer, peft_config=default_lora_config(), bonus=0.25,
    )  # fmt: skip
    trainer.train()
    rounds = [entry for entry in trainer.state.log_history if "client_0/reward_window" in entry]
    assert [entry["step"] for entry in rounds] == [1, 2]
    for entry in rounds:
        assert entry["client_0/bonus"] == entry["client_1/bonus"] == 0.25


def test_the_runner_trains_every_client_with_trainer_class(tmp_path, tiny_model_dir, tiny_tokenizer):
    args = federation_args(tmp_path, federated_config(GMPOConfig), num_clients=1)
    clients = [labelled_dataset(8), labelled_dataset(8)]
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args, clients,
        processing_class=tiny_tokenizer, trainer_class=BonusTrainer, trainer_kwargs={"bonus": 0.5},
    )  # fmt: skip
    history = runner.run()
    assert len(history) == 2
    for record in history:
        assert {metrics["bonus"] for metrics in record.client_metrics.values()} == {0.5}


def test_federated_makes_one_class_per_trainer_and_refuses_others():
    assert federated(GRPOTrainer) is FedGRPOTrainer
    assert federated(FedGRPOTrainer) is FedGRPOTrainer
    gmpo = federated(GMPOTrainer)
    assert gmpo is federated(GMPOTrainer) and federated(gmpo) is gmpo
    assert issubclass(gmpo, GMPOTrainer) and issubclass(gmpo, FederatedGRPOMixin) and gmpo.__name__ == "FedGMPOTrainer"
    for wrong in (Trainer, SFTTrainer, GRPOConfig, "trl.GRPOTrainer", GRPOTrainer.__init__, [GRPOTrainer]):
        with pytest.raises(TypeError, match="GRPOTrainer` or `trl.RLOOTrainer` subclass"):
            federated(wrong)


def test_a_flower_client_app_trains_trainer_class_and_ends_where_the_runner_ends(
    tmp_path, tiny_model_dir, tiny_tokenizer, client_data_dirs, task_identity, monkeypatch  # noqa: F811
):
    losses = []
    gmpo_loss = GMPOTrainer._compute_loss

    def counted_loss(self, model, inputs):
        losses.append(type(self))
        return gmpo_loss(self, model, inputs)

    monkeypatch.setattr(GMPOTrainer, "_compute_loss", counted_loss)
    run_config = {"model-dir": str(tiny_model_dir), "output-dir": str(tmp_path / "flower"), "aggregation": "rpg",
                  "num-rounds": 1}  # fmt: skip
    client_app = make_client_app(loopback_app.load_site, trainer_class=GMPOTrainer)
    grid = LocalGrid(client_app,
                     {11 + i: {"partition-id": i, "data-dir": path} for i, path in enumerate(client_data_dirs)},
                     run_config)  # fmt: skip
    strategy = loopback_app.build_strategy(grid.contexts[11])
    strategy.run(grid)
    assert losses == [local_trainer(GMPOTrainer)] * 2 * 2  # clients x local steps

    args = loopback_app.federation_args(str(tmp_path / "runner"), run_config)
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), loopback_app.length_reward, args,
        dict(zip(["client_0", "client_1"], prompt_datasets())), processing_class=tiny_tokenizer,
        trainer_class=GMPOTrainer,
    )  # fmt: skip
    runner.run()
    assert_states_equal(strategy.global_state, runner.global_state)


def test_runner_and_client_app_refuse_a_trainer_that_is_not_grpo(tiny_model, tiny_tokenizer, fast_args):
    with pytest.raises(TypeError, match="SFTTrainer"):
        FederatedRunner(
            tiny_model, length_reward, fast_args(), [labelled_dataset(8)], processing_class=tiny_tokenizer,
            trainer_class=SFTTrainer,
        )  # fmt: skip
    with pytest.raises(TypeError, match="GRPOTrainer` or `trl.RLOOTrainer` subclass"):
        make_client_app(lambda context: None, trainer_class=Trainer)
    make_client_app(lambda context: None, trainer_class=GMPOTrainer)  # accepted


def test_shared_prefix_refuses_a_trainer_that_overrides_the_log_probabilities(tmp_path, tiny_model_dir, tiny_tokenizer):
    class OwnLogProbs(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    with pytest.raises(ValueError, match="`shared_prefix` replaces `_get_per_token_logps_and_entropies`.*OwnLogProbs"):
        federated(OwnLogProbs)(
            model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward,
            args=federation_args(tmp_path, shared_prefix=True), train_dataset=labelled_dataset(),
            processing_class=tiny_tokenizer, peft_config=default_lora_config(),
        )  # fmt: skip

    class FastOwnLogProbs(FastGRPOMixin, OwnLogProbs):  # the speed-ups without federation refuse it alike
        pass

    args = GRPOConfig(**FAST_GRPO, output_dir=str(tmp_path / "plain"))
    args.shared_prefix = True
    with pytest.raises(ValueError, match="`shared_prefix` replaces `_get_per_token_logps_and_entropies`.*OwnLogProbs"):
        FastOwnLogProbs(
            model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward, args=args,
            train_dataset=labelled_dataset(), processing_class=tiny_tokenizer, peft_config=default_lora_config(),
        )  # fmt: skip


def test_federated_config_keeps_the_algorithms_defaults_and_adds_the_federation():
    FedGMPOConfig = federated_config(GMPOConfig)
    assert federated_config(GMPOConfig) is FedGMPOConfig
    assert issubclass(FedGMPOConfig, FedGRPOConfig) and issubclass(FedGMPOConfig, GMPOConfig)
    config = FedGMPOConfig(output_dir="unused", bf16=False, num_clients=3)
    # GMPO's own field keeps GMPO's default and help; the rest follows FedGRPOConfig (Algorithm 1's loss_type)
    assert config.epsilon == 0.4
    assert "log space" in FedGMPOConfig.__dataclass_fields__["epsilon"].metadata["help"]
    assert (config.loss_type, config.num_clients, config.reward_window) == ("grpo", 3, 5)
    # both validations run
    with pytest.raises(ValueError, match="reward_window"):
        FedGMPOConfig(output_dir="unused", bf16=False, reward_window=20)
    # it pickles (Trainer saves its arguments with every checkpoint) and parses like any TRL config
    restored = pickle.loads(pickle.dumps(config))
    assert type(restored) is FedGMPOConfig and restored.epsilon == 0.4 and restored.num_clients == 3
    (parsed,) = TrlParser((FedGMPOConfig,)).parse_args_and_config(
        ["--output_dir", "x", "--bf16", "false", "--epsilon", "0.3", "--num_rounds", "4"]
    )
    assert (parsed.epsilon, parsed.num_rounds) == (0.3, 4)
    assert federated_config(FedGRPOConfig) is FedGRPOConfig
    for wrong in (Trainer, GRPOConfig(output_dir="unused", bf16=False), {"epsilon": 0.4}):
        with pytest.raises(TypeError, match="GRPOConfig` or `trl.RLOOConfig` subclass"):
            federated_config(wrong)


def test_cli_names_a_trainer_class_that_cannot_be_used():
    assert import_class("trl.experimental.gmpo:GMPOTrainer", GRPOTrainer, "trainer_class") is GMPOTrainer
    assert import_class("trl.experimental.gmpo.GMPOTrainer", GRPOTrainer, "trainer_class") is GMPOTrainer
    cases = {
        "no_such_package:Trainer": "cannot import module 'no_such_package'",
        "trl.experimental.gmpo:NoTrainer": "has no attribute 'NoTrainer'",
        "trl:SFTTrainer": "not a subclass of `trl.trainer.grpo_trainer.GRPOTrainer`",
        "GMPOTrainer": "must be 'package.module:Class'",
    }
    for path, message in cases.items():
        with pytest.raises(ValueError, match=f"`trainer_class` '{path}'.*{message}|{message}"):
            import_class(path, GRPOTrainer, "trainer_class")
    assert config_class(["--trainer_config_class", "trl.experimental.gmpo:GMPOConfig"]) is federated_config(GMPOConfig)
    with pytest.raises(ValueError, match="`trainer_config_class`.*algorithm"):
        config_class(["--trainer_config_class", "trl.experimental.gmpo:GMPOConfig", "--algorithm", "dapo"])
    with pytest.raises(ValueError, match="`trainer_config_class` 'trl:SFTConfig'"):
        config_class(["--trainer_config_class", "trl:SFTConfig"])


def test_cli_run_federates_a_trainer_class_and_its_config_from_the_working_directory(
    tmp_path, tiny_model_dir, monkeypatch
):
    (tmp_path / "my_trainers.py").write_text(
        "from dataclasses import dataclass, field\n"
        "from trl import GRPOConfig, GRPOTrainer\n\n"
        "@dataclass\n"
        "class CountingConfig(GRPOConfig):\n"
        "    count_from: int = field(default=0, metadata={'help': 'First value of the step counter.'})\n\n"
        "class CountingTrainer(GRPOTrainer):\n"
        "    counts = []\n\n"
        "    def _compute_loss(self, model, inputs):\n"
        "        type(self).counts.append(self.args.count_from + self.state.global_step)\n"
        "        return super()._compute_loss(model, inputs)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    output_dir = tmp_path / "out"
    argv = [
        "run", "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(output_dir),
        "--trainer_class", "my_trainers:CountingTrainer", "--trainer_config_class", "my_trainers.CountingConfig",
        "--count_from", "100", "--num_clients", "2", "--dirichlet_alpha", "inf", "--num_rounds", "1",
        "--local_steps", "1", "--reward_window", "1", "--benchmark_size", "24", "--max_eval_samples", "2",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
        "--per_device_eval_batch_size", "2", "--use_cpu", "true", "--bf16", "false", "--gradient_checkpointing",
        "false", "--report_to", "none",
    ]  # fmt: skip
    assert main(argv) == 0
    # one local step on each of the two clients, in the user's trainer, with the user's config field from the flag
    assert sys.modules["my_trainers"].CountingTrainer.counts == [100, 100]
    assert "FedCountingTrainer locally" in (output_dir / "summary.md").read_text()


def test_micro_batches_are_regrouped_only_under_grpo_trainers_own_loss(tmp_path, tiny_model_dir, tiny_tokenizer):
    """Re-cutting micro-batches by prompt is exact for GRPOTrainer's loss normalisation, not for any custom loss."""

    class OwnLoss(FedGRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs)

    args = federation_args(
        tmp_path, num_clients=1, shared_prefix=True, steps_per_generation=2, gradient_accumulation_steps=2
    )
    regrouped = {}
    for trainer_class in (FedGRPOTrainer, OwnLoss, federated(BonusTrainer)):
        trainer = trainer_class(
            model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward, args=args,
            train_dataset=labelled_dataset(), processing_class=tiny_tokenizer, peft_config=default_lora_config(),
            **({"bonus": 0.0} if issubclass(trainer_class, BonusTrainer) else {}),
        )  # fmt: skip
        regrouped[trainer_class.__name__] = trainer._groups_micro_batches_by_prompt
    assert regrouped == {"FedGRPOTrainer": True, "OwnLoss": False, "FedBonusTrainer": False}


def test_the_speedups_join_the_clients_class_only_when_switched_on(tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    private = ("_prepare_inputs", "_buffered_inputs", "_get_per_token_logps_and_entropies", "_generate_single_turn")
    plain = local_trainer(GRPOTrainer, FedGRPOConfig(**common))
    added = plain.__mro__[: plain.__mro__.index(GRPOTrainer)]
    assert not issubclass(plain, FastGRPOMixin)
    assert not [name for klass in added for name in private if name in vars(klass)]  # as little as TRL's GMPO
    for speedup in ("shared_prefix", "recompute_gated_mlp", "fast_generation"):
        fast = local_trainer(GRPOTrainer, FedGRPOConfig(**common, **{speedup: True}))
        assert fast.__mro__[1] is FastGRPOMixin and issubclass(fast, plain), speedup


def test_the_drop_in_trainer_takes_the_speedups_only_when_switched_on(tmp_path, tiny_model_dir, tiny_tokenizer):
    from datasets import Dataset

    def build(**speedups):
        args = FedGRPOConfig(output_dir=str(tmp_path), **FAST_GRPO, max_steps=1, **speedups)
        return FedGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=lambda completions, **_: [0.0]
            * len(completions), args=args, train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}),
            processing_class=tiny_tokenizer, peft_config=default_lora_config(), eval_reward_funcs=None,
        )

    plain, fast = build(), build(shared_prefix=True)
    assert type(plain) is FedGRPOTrainer and not isinstance(plain, FastGRPOMixin)
    assert type(fast).__mro__[1:3] == (FastGRPOMixin, FedGRPOTrainer) and fast.shared_prefix_stats.rows == 0
