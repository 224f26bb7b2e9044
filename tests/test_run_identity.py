"""What a resumed run must share with its checkpoint (trl_federated/core/run_identity.py), and the server step it keeps
from it (`keep_server_step`)."""

import copy
import re
from dataclasses import replace

import pytest
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import FAST_GRPO, length_reward
from test_reliability import events, make_runner, prompt_clients
from trl_federated import FederatedRunner, FedGRPOConfig
from trl_federated.choices import AGGREGATIONS
from trl_federated.core.run_identity import CheckpointMismatchError
from trl_federated.testing import save_tiny_model


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """The tiny model's architecture with other weights: only the weights fingerprint tells them apart."""
    return save_tiny_model(tmp_path_factory.mktemp("other-model"), seed=1)


@pytest.mark.parametrize(
    "change, message",
    [
        ("model", "base model's weights differ"),
        ("architecture", "base model's config differs .*hidden_size"),
        ("lora", "LoRA configuration differs in r "),
        ("clients", "clients differ"),
        ("data", "client 'site-1' holds other data"),
        ("aggregation", "aggregator differs"),
        ("wire", "wire format differs in lora_aggregation"),
    ],
)
def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, tiny_model_dir, other_model_dir, change, message):
    make_runner(tiny_model_dir, tmp_path / "run").server.save_checkpoint(0)
    model_dir, clients, overrides, peft_config = tiny_model_dir, None, {}, None
    if change == "model":
        model_dir = other_model_dir
    elif change == "architecture":
        model_dir = save_tiny_model(tmp_path / "wide", hidden_size=64)
    elif change == "lora":
        peft_config = LoraConfig(r=8, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    elif change == "clients":
        clients = prompt_clients("site-0", "site-2")
    elif change == "data":
        clients = prompt_clients("site-0", "site-1", rows=7)
    elif change == "aggregation":
        overrides = {"aggregation": "fedavg"}
    elif change == "wire":
        overrides = {"lora_aggregation": "freeze_a"}
    args = FedGRPOConfig(output_dir=str(tmp_path / "run"),
                         **{**FAST_GRPO, "resume_from_checkpoint": "true", **overrides})
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(model_dir), length_reward, args,
        clients or prompt_clients("site-0", "site-1"), processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        peft_config=peft_config,
    )
    with pytest.raises(CheckpointMismatchError, match=message):
        runner.run()


@pytest.mark.parametrize("change, message", [
    ({"server_optimizer": "fedadam"}, r"server optimizer differs \(checkpoint: ServerSGD, now: ServerFedAdam\)"),
    ({"seed": 1}, r"training settings differ in seed \(checkpoint: 0, now: 1\)"),
    ({"local_steps": 2, "reward_window": 1}, r"local_steps \(checkpoint: 1, now: 2\)"),
    ({"rpg_tau_min": 1.0, "rpg_h_max": None}, r"rpg_tau_min \(checkpoint: 1.5, now: 1.0\), rpg_h_max"),
    ({"learning_rate": 1e-3}, r"learning_rate \(checkpoint: 0.01, now: 0.001\).*resume_allow_changes"),
])
def test_resume_refuses_other_training_settings_by_name(tmp_path, tiny_model_dir, change, message):
    make_runner(tiny_model_dir, tmp_path, num_rounds=1).server.save_checkpoint(0)
    with pytest.raises(CheckpointMismatchError, match=message):
        make_runner(tiny_model_dir, tmp_path, num_rounds=1, resume_from_checkpoint="true", **change).run()


def test_resume_from_sgd_to_adam_is_a_mismatch_not_a_key_error(tmp_path, tiny_model_dir):
    make_runner(tiny_model_dir, tmp_path, num_rounds=1, server_optimizer="sgd").server.save_checkpoint(0)
    with pytest.raises(CheckpointMismatchError, match="server optimizer differs .*ServerSGD, now: ServerAdam"):
        make_runner(tiny_model_dir, tmp_path, num_rounds=1, resume_from_checkpoint="true",
                    server_optimizer="adam").run()


def test_a_resumed_run_that_leaves_the_server_step_unset_keeps_its_checkpoints(tmp_path, tiny_model_dir, caplog,
                                                                               monkeypatch):
    """FGRPO's default step changed once: a checkpoint of a run that took the old default resumes on that step, with
    its derived learning rate and ε, and says so; one that named its step keeps it as well when the resumed config
    leaves the field unset."""
    # the default before the experiment chose
    monkeypatch.setitem(AGGREGATIONS, "rpg", replace(AGGREGATIONS["rpg"], server_optimizer="adam"))
    first = make_runner(tiny_model_dir, tmp_path / "default", num_rounds=2)
    first.run()  # rounds 0 and 1 under the old default, the paper's Adam
    adam = first.server.aggregator.server_optimizer
    monkeypatch.setitem(AGGREGATIONS, "rpg", replace(AGGREGATIONS["rpg"], server_optimizer="sgd"))  # today's
    resumed = make_runner(tiny_model_dir, tmp_path / "default", num_rounds=3, resume_from_checkpoint="true")
    assert resumed.args.server_optimizer == "sgd"
    resumed.run()
    step = resumed.server.aggregator.server_optimizer
    assert type(step) is type(adam) and resumed.args.server_optimizer == "adam"
    assert (step.learning_rate, step.epsilon, step.num_steps) == (adam.learning_rate, adam.epsilon, 3)
    assert "Resuming with the checkpoint's server_optimizer 'adam'" in caplog.text
    assert [line["round_idx"] for line in events(tmp_path / "default", "round")] == [0, 1, 2]

    make_runner(tiny_model_dir, tmp_path / "named", num_rounds=1, server_optimizer="nesterov").run()
    resumed = make_runner(tiny_model_dir, tmp_path / "named", num_rounds=2, resume_from_checkpoint="true")
    resumed.run()
    assert resumed.args.server_optimizer == "nesterov" and resumed.args.server_learning_rate == 0.7


def test_resume_allow_changes_lets_named_training_settings_change(tmp_path, tiny_model_dir, caplog):
    make_runner(tiny_model_dir, tmp_path, num_rounds=1).server.save_checkpoint(0)
    runner = make_runner(tiny_model_dir, tmp_path, num_rounds=1, resume_from_checkpoint="true", learning_rate=1e-3,
                         rpg_tau_min=1.0, resume_allow_changes="learning_rate, rpg_tau_min")
    runner.run()
    assert re.search(r"changed training settings \(resume_allow_changes\): .*learning_rate \(checkpoint: 0.01, now: "
                     r"0.001\)", caplog.text) and "rpg_tau_min (checkpoint: 1.5, now: 1.0)" in caplog.text
    with pytest.raises(ValueError, match=r"`resume_allow_changes` names \['server_optimizer'\]"):
        make_runner(tiny_model_dir, tmp_path, num_rounds=1, resume_from_checkpoint="true", server_optimizer="sgd",
                    resume_allow_changes="server_optimizer").run()


def test_a_checkpoint_from_before_a_field_existed_resumes_when_it_is_left_at_its_default(tmp_path, tiny_model_dir):
    """A checkpoint made before `fraction_train` existed does not record it; its run sampled every client, which is
    the default: resuming with the default goes on, another value is refused by name."""
    from trl_federated.core.run_identity import check_identity, run_identity

    runner = make_runner(tiny_model_dir, tmp_path, num_rounds=1)
    current = run_identity(runner.model, runner.client_datasets, runner.aggregator, runner.args)
    older = {**current, "training": {k: v for k, v in current["training"].items() if k != "fraction_train"}}
    check_identity(older, current, tmp_path)
    sampled = copy.deepcopy(current)
    sampled["training"]["fraction_train"] = 0.5
    with pytest.raises(CheckpointMismatchError, match=r"fraction_train \(checkpoint: 1.0, now: 0.5\)"):
        check_identity(older, sampled, tmp_path)


def test_without_dp_a_checkpoint_resumes_whatever_the_dp_mechanisms_settings(tmp_path, tiny_model_dir):
    """The DP mechanism's settings (`dp_clip_norm`, adaptive clipping, ...) change nothing without
    `dp_noise_multiplier`: a checkpoint of a run that recorded another `dp_clip_norm` (1.0, the former default)
    resumes; under DP a changed clip norm is refused by name."""
    from trl_federated.core.run_identity import check_identity, run_identity

    runner = make_runner(tiny_model_dir, tmp_path, num_rounds=1)
    current = run_identity(runner.model, runner.client_datasets, runner.aggregator, runner.args)
    assert not [name for name in current["training"] if name.startswith("dp_") and name != "dp_noise_multiplier"]
    older = copy.deepcopy(current)
    older["training"].update(dp_clip_norm=1.0, dp_target_delta=1e-5)
    check_identity(older, current, tmp_path)
    runner.args.dp_noise_multiplier = 1.0  # the identity only: this runner never aggregates
    private = run_identity(runner.model, runner.client_datasets, runner.aggregator, runner.args)
    older["training"]["dp_noise_multiplier"] = 1.0
    with pytest.raises(CheckpointMismatchError, match=r"dp_clip_norm \(checkpoint: 1.0, now: 0.6\)"):
        check_identity(older, private, tmp_path)
