"""TRL's online RL trainers beyond GRPO: RLOO federates (`federated(RLOOTrainer)` with `federated_config(RLOOConfig)`:
one client trains exactly like `RLOOTrainer`, two clients run federated rounds, from Python and from `trl-federated
run --trainer_class`), and each of TRL 1.16's other online trainers is refused by name, with the reason."""

import importlib
import logging
import pickle

import pytest
from peft import LoraConfig
from transformers import AutoModelForCausalLM
from trl import GRPOTrainer, RLOOConfig, RLOOTrainer

from conftest import FAST_GRPO
from test_cli import labelled_dataset
from trl_federated import FederatedRunner, FedGRPOConfig
from trl_federated.adapters import get_adapter_state
from trl_federated.arguments import config_class
from trl_federated.cli import main
from trl_federated.config import FederatedConfig, federated_config, result_fields
from trl_federated.local.local_trainer import UNFEDERABLE_TRAINERS, local_trainer
from trl_federated.scoring.rewards import completion_text
from trl_federated.trainer import federated

FedRLOOConfig = federated_config(RLOOConfig)
SEED = 3


def length_reward(completions, **kwargs):
    """Varies on the tiny model's random text, so every step has a gradient."""
    return [len(completion_text(completion)) / 64 for completion in completions]


def lora():
    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")


def rloo(tmp_path, trainer_class, config_class, tiny_model_dir, tiny_tokenizer, **overrides):
    values = dict(FAST_GRPO, output_dir=str(tmp_path / config_class.__name__), seed=SEED, max_steps=2,
                  disable_tqdm=True, lr_scheduler_type="linear")  # fmt: skip
    values.update(overrides)
    return trainer_class(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward,
        args=config_class(**values), train_dataset=labelled_dataset(8), processing_class=tiny_tokenizer,
        peft_config=lora(),
    )  # fmt: skip


def step_logs(trainer):
    entries = [entry for entry in trainer.state.log_history if "loss" in entry]
    return [{key: value for key, value in entry.items() if key != "step_time"} for entry in entries]


@pytest.mark.parametrize("options", [{}, {"beta": 0.0, "normalize_advantages": True, "num_iterations": 2}])
def test_one_client_trains_exactly_like_rloo_trainer(tmp_path, tiny_model_dir, tiny_tokenizer, options):
    reference = rloo(tmp_path, RLOOTrainer, RLOOConfig, tiny_model_dir, tiny_tokenizer, **options)
    reference.train()
    drop_in = rloo(tmp_path, federated(RLOOTrainer), FedRLOOConfig, tiny_model_dir, tiny_tokenizer, **options)
    drop_in.train()
    logs = step_logs(reference)
    assert len(logs) == 2 and "reward" in logs[0]
    assert step_logs(drop_in) == logs
    assert drop_in.step_rewards == [entry.get("reward", logs[0]["reward"]) for entry in logs]


@pytest.mark.parametrize("aggregation", ["rpg", "fedprox", "scaffold"])
def test_rloo_runs_federated_rounds(tmp_path, tiny_model_dir, tiny_tokenizer, aggregation):
    trainer = rloo(
        tmp_path, federated(RLOOTrainer), FedRLOOConfig, tiny_model_dir, tiny_tokenizer, num_clients=2,
        dirichlet_alpha=float("inf"), num_rounds=2, local_steps=2, reward_window=2, aggregation=aggregation,
        lr_scheduler_type="constant",
    )  # fmt: skip
    initial = {key: value.clone() for key, value in get_adapter_state(trainer.model).items()}
    output = trainer.train()
    assert output.metrics["num_rounds"] == 2 and output.global_step == 2 * 2 * 2  # rounds x clients x steps
    rounds = [entry for entry in trainer.state.log_history if "client_0/reward_window" in entry]
    assert len(rounds) == 2
    for entry in rounds:  # every client logged RLOO's metrics, its KL to the reference adapter (beta 0.05) included
        assert {"client_0/kl", "client_1/kl", "client_0/completions/mean_length"} <= set(entry)
    final = get_adapter_state(trainer.model)
    assert any(not (initial[key] == final[key]).all() for key in initial)


def test_federated_rloo_config_has_rloos_fields_and_the_federations():
    assert federated_config(RLOOConfig) is FedRLOOConfig and federated_config(FedRLOOConfig) is FedRLOOConfig
    assert issubclass(FedRLOOConfig, RLOOConfig) and issubclass(FedRLOOConfig, FederatedConfig)
    assert not issubclass(FedRLOOConfig, FedGRPOConfig)
    config = FedRLOOConfig(output_dir="unused", use_cpu=True, bf16=False, num_clients=3)
    # RLOO's own defaults (beta, learning rate), Algorithm 1's where RLOOConfig keeps TRL's base default, and no GRPO
    # field RLOOTrainer would ignore
    assert (config.beta, config.learning_rate, config.lr_scheduler_type) == (0.05, 1e-6, "constant")
    assert (config.num_clients, config.reward_window, config.normalize_advantages) == (3, 5, False)
    assert not hasattr(config, "loss_type") and not hasattr(config, "scale_rewards")
    with pytest.raises(ValueError, match="reward_window"):
        FedRLOOConfig(output_dir="unused", use_cpu=True, bf16=False, reward_window=20)
    fields = result_fields(config)
    assert {"normalize_advantages", "reward_clip_range", "beta", "local_steps"} <= set(fields)
    assert "loss_type" not in fields and "normalize_advantages" not in result_fields(FedGRPOConfig)
    restored = pickle.loads(pickle.dumps(config))
    assert type(restored) is FedRLOOConfig and restored.num_clients == 3


def test_rloo_refuses_grpo_config_and_grpo_speedups(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args):
    with pytest.raises(TypeError, match="RLOOTrainer trains with a `RLOOConfig`, got a `FedGRPOConfig`"):
        FederatedRunner(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, fast_args(), [labelled_dataset(8)],
            processing_class=tiny_tokenizer, trainer_class=RLOOTrainer,
        )  # fmt: skip
    args = FedRLOOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, shared_prefix=True)
    with pytest.raises(ValueError, match="`shared_prefix` speed up `trl.GRPOTrainer`'s private methods.*RLOOTrainer"):
        local_trainer(RLOOTrainer, args)


def trl_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path", list(UNFEDERABLE_TRAINERS))
def test_trls_other_online_trainers_are_refused_by_name_with_the_reason(path):
    trainer_class = trl_class(path)
    assert not issubclass(trainer_class, (GRPOTrainer, RLOOTrainer))  # none is of a federated family
    reason = UNFEDERABLE_TRAINERS[path]
    for refused in (trainer_class, type("MyTrainer", (trainer_class,), {})):  # a subclass is refused alike
        with pytest.raises(TypeError, match=f"`{trainer_class.__name__}` cannot be federated: "):
            federated(refused)
    with pytest.raises(ValueError, match=f"`trainer_class` '{path}'.*cannot be federated: {reason[:30]}"):
        config_class(["--trainer_class", path])


def test_unfederable_trainers_lack_what_the_reason_says():
    """The reasons' facts, read from the classes: no `reward_funcs`, no `peft_config`, a model taken by name only."""

    def parameters(path):
        import inspect

        return inspect.signature(trl_class(path).__init__).parameters

    trainers = "trl.experimental.{0}.{0}_trainer.{1}".format
    assert "reward_funcs" not in parameters(trainers("iw_opd", "IWOPDTrainer"))
    assert "reward_funcs" not in parameters(trainers("tpo", "TPOTrainer"))
    assert "peft_config" not in parameters(trainers("a2po", "A2POTrainer"))
    assert parameters(trainers("async_grpo", "AsyncGRPOTrainer"))["model"].annotation in (str, "str")
    a2po_config = trl_class("trl.experimental.a2po.a2po_config.A2POConfig")
    assert not {"beta", "num_iterations", "steps_per_generation", "use_vllm"} & set(a2po_config.__dataclass_fields__)


def test_cli_runs_rloo_from_its_trainer_class_alone(tmp_path, tiny_model_dir, caplog, monkeypatch):
    assert config_class(["--trainer_class", "trl.RLOOTrainer"]) is FedRLOOConfig
    assert config_class(["--trainer_class", "trl:RLOOTrainer", "--trainer_config_class", "trl:RLOOConfig"]) is (
        FedRLOOConfig
    )
    with pytest.raises(ValueError, match="`trainer_class` .*RLOOConfig.*algorithm"):
        config_class(["--trainer_class", "trl.RLOOTrainer", "--algorithm", "dapo"])
    output_dir = tmp_path / "out"
    argv = [
        "run", "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(output_dir),
        "--trainer_class", "trl.RLOOTrainer", "--normalize_advantages", "true", "--num_clients", "2",
        "--dirichlet_alpha", "inf", "--num_rounds", "1", "--local_steps", "1", "--reward_window", "1",
        "--benchmark_size", "24", "--max_eval_samples", "2", "--per_device_train_batch_size", "4",
        "--num_generations", "4", "--max_completion_length", "8", "--per_device_eval_batch_size", "2",
        "--use_cpu", "true", "--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none",
        "--shared_prefix", "true", "--fast_generation", "true",  # the quickstart's GRPO speed-ups
    ]  # fmt: skip
    # GRPO's speed-ups, which RLOOTrainer cannot take, are turned off with one notice before the model loads
    import trl_federated.federation as federation

    speedups_at_load = []
    load_model = federation.load_model
    monkeypatch.setattr(federation, "load_model", lambda model_args, args: speedups_at_load.append(
        (args.shared_prefix, args.fast_generation)) or load_model(model_args, args))
    with caplog.at_level(logging.INFO, logger="trl_federated"):
        assert main(argv) == 0
    assert speedups_at_load == [(False, False)]
    notices = [record.getMessage() for record in caplog.records if "turned off" in record.getMessage()]
    assert notices == ["`shared_prefix`, `fast_generation` turned off: they speed up `trl.GRPOTrainer`'s private "
                       "methods, which trl.trainer.rloo_trainer.RLOOTrainer does not have; it trains without them."]
    assert "FedRLOOTrainer locally" in (output_dir / "summary.md").read_text()
    assert not [record for record in caplog.records if record.name.endswith("client") and record.levelname == "ERROR"]
