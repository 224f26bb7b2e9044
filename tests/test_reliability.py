"""Reliability: per-round atomic checkpoints and exact resume (after a real SIGKILL), failing and slow clients,
invalid updates, and inputs that must fail early with a clear message."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset, DatasetDict
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import FAST_GRPO, length_reward
from trl_federated import ClientUpdate, FederatedRunner, FedGRPOConfig, FedGRPOTrainer, RoundCallback
from trl_federated.adapters import InvalidUpdateError, default_lora_config, get_adapter_state
from trl_federated.aggregation import ScaffoldAggregator
from trl_federated.cli import main
from trl_federated.core.admission import UpdateGate
from trl_federated.core.checkpoint import (
    Checkpoint,
    list_checkpoints,
    read_checkpoint,
    write_checkpoint,
)
from trl_federated.runner import NotEnoughClientsError
from trl_federated.scoring.rewards import answer_accuracy_reward, combined_reward_range, format_reward

TESTS_DIR = Path(__file__).parent


def prompt_clients(*names, rows=6):
    return {name: Dataset.from_dict({"prompt": [f"{name} asks: what is {i} plus {i}?" for i in range(rows)]})
            for name in names}


def make_runner(model_dir, output_dir, reward_funcs=length_reward, clients=None, callbacks=(), runner_class=None,
                **overrides):
    """A federation of the tiny model on plain prompts: 2 clients, 1 local step, unless overridden."""
    values = {**FAST_GRPO, "num_rounds": 2, "local_steps": 1, "reward_window": 1, "seed": 0, **overrides}
    args = FedGRPOConfig(output_dir=str(output_dir), **values)
    return (runner_class or FederatedRunner)(
        AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs, args,
        clients or prompt_clients("site-0", "site-1"), processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=list(callbacks),
    )


def events(output_dir, name=None):
    lines = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if name is None or line["event"] == name]


def assert_states_equal(a, b):
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


# 1-2. Checkpoints and exact resume -----------------------------------------------------------------------


class StallInRound(RoundCallback):
    """Writes `marker` once the first client of round `round_idx` has reported, then hangs there, mid-round,
    until the test kills the process."""

    def __init__(self, round_idx, marker):
        self.round_idx, self.marker = round_idx, Path(marker)

    def on_client_end(self, args, round_idx, update, **kwargs):
        if round_idx == self.round_idx:
            self.marker.write_text(update.client_id)
            time.sleep(600)


def exact_resume_runner(model_dir, output_dir, callbacks=(), **overrides):
    """3 rounds of RPG + the paper's server Adam (the server step with the most state to restore), 2 clients x 2 local
    steps: the run the SIGKILL test repeats."""
    return make_runner(model_dir, output_dir, callbacks=callbacks, num_rounds=3, local_steps=2, reward_window=2,
                       server_optimizer="adam", **overrides)


KILLED_RUN = f"""
import sys
sys.path.insert(0, {str(TESTS_DIR)!r})
from test_reliability import StallInRound, exact_resume_runner
exact_resume_runner(sys.argv[1], sys.argv[2], callbacks=[StallInRound(2, sys.argv[3])]).run()
"""


def test_resume_after_sigkill_mid_round_is_bit_identical(tmp_path, tiny_model_dir):
    killed_dir, marker, log = tmp_path / "killed", tmp_path / "round-2-started", tmp_path / "killed.log"
    with log.open("w") as stream:
        process = subprocess.Popen(
            [sys.executable, "-c", KILLED_RUN, str(tiny_model_dir), str(killed_dir), str(marker)],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=stream, stderr=subprocess.STDOUT,
        )
    try:
        # the uninterrupted reference run, in this process, while the other one gets to round 2
        reference = exact_resume_runner(tiny_model_dir, tmp_path / "uninterrupted")
        reference.run()
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert process.poll() is None, f"the run to kill ended on its own:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "round 2 never started"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()

    # killed in round 2: rounds 0 and 1 are checkpointed, round 2 is not, and its first client had reported
    assert [path.name for path in list_checkpoints(killed_dir)] == ["checkpoint-0", "checkpoint-1"]
    assert not any(path.name.startswith(".checkpoint") for path in killed_dir.iterdir())
    assert [line["client_id"] for line in events(killed_dir, "client") if line["round_idx"] == 2] == ["site-0"]

    resumed = exact_resume_runner(tiny_model_dir, killed_dir, resume_from_checkpoint="true")
    history = resumed.run()

    # a fresh process (no RNG state saved) lands on exactly the uninterrupted run's adapter
    assert_states_equal(load_file(killed_dir / "adapter_model.safetensors"),
                        load_file(tmp_path / "uninterrupted" / "adapter_model.safetensors"))
    server, reference_server = resumed.aggregator.state_dict(), reference.aggregator.state_dict()
    assert server["baselines"] == reference_server["baselines"]
    assert server["volatilities"] == reference_server["volatilities"]
    assert server["server_optimizer"]["num_steps"] == 3
    assert_states_equal(server["server_optimizer"]["m"], reference_server["server_optimizer"]["m"])
    assert_states_equal(server["server_optimizer"]["v"], reference_server["server_optimizer"]["v"])
    assert [(r.rewards, r.weights) for r in history] == [(r.rewards, r.weights) for r in reference.history]
    # the log reads like the uninterrupted run's: the torn round's lines are gone, one `resumed` line added
    assert [(e["round_idx"], e["client_id"]) for e in events(killed_dir, "client")] == [
        (e["round_idx"], e["client_id"]) for e in events(tmp_path / "uninterrupted", "client")
    ]
    assert events(killed_dir, "resumed") == [{"event": "resumed", "checkpoint_round": 1}]
    assert [line["round_idx"] for line in events(killed_dir, "round")] == [0, 1, 2]


def test_checkpoint_holds_the_whole_state_and_resumes_scaffold_exactly(tmp_path, tiny_model_dir):
    reference = make_runner(tiny_model_dir, tmp_path / "run", aggregation="scaffold", server_optimizer="sgd")
    reference.run()
    assert [path.name for path in list_checkpoints(tmp_path / "run")] == ["checkpoint-0", "checkpoint-1"]
    path = tmp_path / "run" / "checkpoint-1"
    checkpoint = read_checkpoint(path)
    assert checkpoint.round_idx == 1
    assert_states_equal(checkpoint.global_state, reference.global_state)
    assert_states_equal(checkpoint.aggregator["control"], reference.aggregator.control)
    assert checkpoint.aggregator["server_optimizer"] == {}  # SGD keeps no state
    assert set(checkpoint.aggregator["client_controls"]) == {"site-0", "site-1"}
    for client_id, control in reference.aggregator.client_controls.items():
        assert_states_equal(checkpoint.aggregator["client_controls"][client_id], control)
    assert [record.to_dict() for record in checkpoint.history] == [record.to_dict() for record in reference.history]
    clients = checkpoint.identity["clients"]
    assert [(c["id"], c["num_rows"]) for c in clients] == [("site-0", 6), ("site-1", 6)]
    assert clients[0]["fingerprint"] != clients[1]["fingerprint"]
    # JSON and safetensors only, and the adapter is a standard PEFT adapter
    assert sorted(p.name for p in path.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "federation.json", "federation.safetensors", "manifest.json"
    ]
    json.loads((path / "federation.json").read_text())
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), path)
    assert_states_equal(get_adapter_state(loaded), reference.global_state)

    # round 1 again from checkpoint-0 (into another output_dir): SCAFFOLD's server and client controls are restored
    resumed = make_runner(tiny_model_dir, tmp_path / "resumed", aggregation="scaffold", server_optimizer="sgd",
                          resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-0"))
    resumed.run()
    assert_states_equal(resumed.global_state, reference.global_state)
    assert_states_equal(resumed.aggregator.control, reference.aggregator.control)
    for client_id in ("site-0", "site-1"):
        assert_states_equal(resumed.aggregator.client_controls[client_id],
                            reference.aggregator.client_controls[client_id])


def test_checkpoint_with_scaffold_client_controls_beside_the_aggregator_state_is_refused_by_name(tmp_path):
    # Checkpoints written before SCAFFOLD's aggregator kept its c_i held them in a top-level "client_controls" entry,
    # and named no format: such a checkpoint is refused, by name, rather than read in an old layout.
    import trl_federated.core.checkpoint as checkpoint_module
    from trl_federated.core.checkpoint import OutdatedCheckpointError

    controls = {"site-0": {"w": torch.tensor([0.25, -0.5])}, "site-1": {"w": torch.tensor([1.0, 2.0])}}
    aggregator = {"server_optimizer": {}, "control": {"w": torch.tensor([0.5, 0.75])}, "client_controls": controls}
    path = write_checkpoint(Checkpoint(0, {"w": torch.zeros(2)}, aggregator, [], {}, {}), tmp_path,
                            LoraConfig(r=2, target_modules=["q_proj"]))
    assert set(read_checkpoint(path).aggregator["client_controls"]) == {"site-0", "site-1"}  # today's layout
    state = json.loads((path / "federation.json").read_text())
    state["client_controls"] = state["aggregator"].pop("client_controls")
    del state["format"]
    (path / "federation.json").write_text(json.dumps(state))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["federation.json"] = checkpoint_module._file_digest(path / "federation.json")
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(OutdatedCheckpointError, match=re.escape(f"Checkpoint {path} was written by an earlier "
                                                                "version of trl-federated (checkpoint format None")):
        read_checkpoint(path)


def checkpoint_of(round_idx, value, m=1.0):
    state = {"w": torch.full((2,), value)}
    return Checkpoint(round_idx, state, {"m": {"w": torch.tensor([value, m])}, "step": round_idx}, [], {},
                      {"note": "unit test"})


# 6. A checkpoint from another run ------------------------------------------------------------------------


def flip_byte(path, offset=-8):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def rewrite_consistently(checkpoint_dir, name, text):
    """Replace a checkpoint file and its manifest entry to match: damage that checksums alone cannot see."""
    import trl_federated.core.checkpoint as checkpoint_module

    (checkpoint_dir / name).write_text(text)
    manifest = json.loads((checkpoint_dir / "manifest.json").read_text())
    manifest["files"][name] = checkpoint_module._file_digest(checkpoint_dir / name)
    (checkpoint_dir / "manifest.json").write_text(json.dumps(manifest))


def rewrite_state(checkpoint_dir, edit):
    state = json.loads((checkpoint_dir / "federation.json").read_text())
    edit(state)
    rewrite_consistently(checkpoint_dir, "federation.json", json.dumps(state))


# 3. Failing and slow clients -----------------------------------------------------------------------------


class FlakyReward(RoundCallback):
    """A length reward that raises for the prompts of client `bad` in the rounds listed in `failing_rounds`."""

    __name__ = "flaky_reward"

    def __init__(self, failing_rounds):
        self.failing_rounds, self.round_idx = set(failing_rounds), None

    def on_round_begin(self, args, round_idx, **kwargs):
        self.round_idx = round_idx

    def __call__(self, prompts, completions, **kwargs):
        if self.round_idx in self.failing_rounds and any(prompt.startswith("bad") for prompt in prompts):
            raise ConnectionError("reward server unreachable")
        return length_reward(completions)


class Snapshot(RoundCallback):
    def __init__(self, aggregator):
        self.aggregator, self.states = aggregator, []

    def on_round_end(self, args, record, **kwargs):
        self.states.append((dict(self.aggregator.baselines), dict(self.aggregator.volatilities)))


def test_a_failing_client_is_dropped_and_keeps_its_rpg_state(tmp_path, tiny_model_dir):
    reward = FlakyReward(failing_rounds={1})
    runner = make_runner(tiny_model_dir, tmp_path / "run", reward_funcs=reward, clients=prompt_clients("good", "bad"))
    snapshot = Snapshot(runner.aggregator)
    runner.callbacks += [reward, snapshot]
    history = runner.run()

    assert history[0].dropped == {} and set(history[0].weights) == {"good", "bad"}
    assert history[1].dropped == {"bad": "ConnectionError: reward server unreachable"}
    assert history[1].weights == {"good": 1.0} and set(history[1].rewards) == {"good"}
    # the server never saw `bad` in round 1: its baseline and volatility are those of round 0
    (baselines_0, volatilities_0), (baselines_1, volatilities_1) = snapshot.states
    assert baselines_1["bad"] == baselines_0["bad"] and volatilities_1["bad"] == volatilities_0["bad"]
    assert baselines_1["good"] != baselines_0["good"]
    assert events(tmp_path / "run", "client_dropped") == [{
        "event": "client_dropped", "round_idx": 1, "client_id": "bad", "kind": "error",
        "reason": "ConnectionError: reward server unreachable",
    }]
    reports = [(e["round_idx"], e["client_id"]) for e in events(tmp_path / "run", "client")]
    assert reports == [(0, "good"), (0, "bad"), (1, "good")]


def test_too_few_clients_stop_the_run_and_the_last_checkpoint_resumes(tmp_path, tiny_model_dir):
    reward = FlakyReward(failing_rounds={1})
    runner = make_runner(tiny_model_dir, tmp_path / "run", reward_funcs=reward, clients=prompt_clients("good", "bad"),
                         min_clients_per_round=2)
    runner.callbacks.append(reward)
    with pytest.raises(NotEnoughClientsError, match=r"Round 1: only 1 of 2 clients .* min_clients_per_round=2. "
                       r"Dropped: bad: ConnectionError: reward server unreachable. .*checkpoint-0, is intact"):
        runner.run()
    assert [path.name for path in list_checkpoints(tmp_path / "run")] == ["checkpoint-0"]

    # once the reward server is back, the run resumes from round 1
    reward = FlakyReward(failing_rounds=set())
    resumed = make_runner(tiny_model_dir, tmp_path / "run", reward_funcs=reward, clients=prompt_clients("good", "bad"),
                          min_clients_per_round=2, resume_from_checkpoint="true")
    resumed.callbacks.append(reward)
    assert [record.round_idx for record in resumed.run()] == [0, 1]


def slow_reward(completions, **kwargs):
    time.sleep(1.5)  # past client_timeout in the first step, however fast the machine
    return length_reward(completions)


def test_a_client_over_client_timeout_stops_at_a_step_boundary_and_is_dropped(tmp_path, tiny_model_dir):
    # A single, slow client: no assertion here depends on how fast a healthy client is, so load cannot flake it.
    runner = make_runner(tiny_model_dir, tmp_path / "run", reward_funcs=slow_reward, clients=prompt_clients("slow"),
                         num_rounds=1, local_steps=2, reward_window=1, client_timeout=1.0)
    with pytest.raises(NotEnoughClientsError, match="Dropped: slow: client 'slow' took"):
        runner.run()
    dropped = events(tmp_path / "run", "client_dropped")
    assert [(e["client_id"], e["kind"]) for e in dropped] == [("slow", "timeout")]
    assert re.fullmatch(r"client 'slow' took \d+\.\d s, over client_timeout=1.0 s \(stopped after 1 of 2 local steps\)",
                        dropped[0]["reason"])


# 4. Invalid updates --------------------------------------------------------------------------------------

GLOBAL = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}


def corrupt(fault):
    update = ClientUpdate("site-7", {"a": torch.ones(2, 3), "b": torch.ones(4)}, num_samples=5, reward=0.5,
                          extras={"control_delta": {"a": torch.ones(2, 3), "b": torch.ones(4)}})
    if fault == "nan":
        update.state["a"][1, 2] = math.nan
    elif fault == "inf":
        update.state["b"][0] = -math.inf
    elif fault == "missing key":
        del update.state["b"]
    elif fault == "extra key":
        update.state["c"] = torch.ones(1)
    elif fault == "shape":
        update.state["b"] = torch.ones(5)
    elif fault == "dtype":
        update.state["a"] = torch.ones(2, 3, dtype=torch.float16)
    elif fault == "not a tensor":
        update.state["a"] = [[1.0] * 3] * 2
    elif fault == "control nan":
        update.extras["control_delta"]["b"][3] = math.nan
    elif fault == "control shape":
        update.extras["control_delta"]["a"] = torch.ones(3, 2)
    elif fault == "reward nan":
        update.reward = math.nan
    elif fault == "reward inf":
        update.reward = math.inf
    elif fault == "reward not a number":
        update.reward = "0.5"
    elif fault == "reward above range":
        update.reward = 2.5
    elif fault == "reward below range":
        update.reward = -0.01
    elif fault == "no samples":
        update.num_samples = 0
    return update


@pytest.mark.parametrize("fault, message", [
    ("nan", r"adapter\['a'\] holds NaN or Inf"),
    ("inf", r"adapter\['b'\] holds NaN or Inf"),
    ("missing key", r"adapter must have the global adapter's keys .*missing \['b'\]"),
    ("extra key", r"adapter must have the global adapter's keys .*unexpected \['c'\]"),
    ("shape", r"adapter\['b'\] is torch.float32 \(5,\), expected torch.float32 \(4,\)"),
    ("dtype", r"adapter\['a'\] is torch.float16 \(2, 3\), expected torch.float32 \(2, 3\)"),
    ("not a tensor", r"adapter\['a'\] is list, expected torch.float32 \(2, 3\)"),
    ("control nan", r"control_delta\['b'\] holds NaN"),
    ("control shape", r"control_delta\['a'\] is torch.float32 \(3, 2\), expected floating point \(2, 3\)"),
    ("reward nan", "reward R̄ must be a finite number, got nan"),
    ("reward inf", "reward R̄ must be a finite number, got inf"),
    ("reward not a number", "reward R̄ must be a finite number, got '0.5'"),
    ("reward above range", r"reward R̄ = 2.5 lies outside the reward functions' range \[0.0, 2.0\]"),
    ("reward below range", r"reward R̄ = -0.01 lies outside the reward functions' range"),
    ("no samples", "num_samples must be a positive integer"),
])
def test_validate_update_rejects(fault, message):
    with pytest.raises(InvalidUpdateError, match=r"client 'site-7' rejected: " + message):
        admit(corrupt(fault), reward_range=(0.0, 2.0))


def test_validate_update_accepts_a_valid_update():
    admit(corrupt(None), reward_range=(0.0, 2.0))
    admit(corrupt("reward above range"), reward_range=None)  # no declared range: no check
    update = corrupt(None)
    update.reward = 2.0 + 1e-7  # float32 rounding of a mean at the top of the range
    admit(update, reward_range=(0.0, 2.0))


def admit(update, reward_range):
    """`update` through a SCAFFOLD federation's admission gate: `admission.validate_update` checks the adapter, D_i
    and R̄, `ScaffoldAggregator.check_extras` the control_delta."""
    gate = UpdateGate(reward_range=reward_range, aggregator=ScaffoldAggregator())
    gate.open_round(GLOBAL)
    return gate.check(update.client_id, update)


def test_combined_reward_range_follows_trl_reward_weights():
    assert combined_reward_range([answer_accuracy_reward, format_reward]) == (0.0, 2.0)
    assert combined_reward_range(answer_accuracy_reward) == (0.0, 1.0)
    assert combined_reward_range([answer_accuracy_reward, format_reward], [1.0, -0.5]) == (-0.5, 1.0)
    assert combined_reward_range([answer_accuracy_reward, length_reward]) is None  # length_reward declares no range
    with pytest.raises(ValueError, match="2 reward weights for 1 reward functions"):
        combined_reward_range([answer_accuracy_reward], [1.0, 1.0])


def bounded_length_reward(completions, **kwargs):
    return [min(len(completion) / 64, 1.0) for completion in completions]


bounded_length_reward.reward_range = (0.0, 1.0)


class Tampering(FederatedRunner):
    """Client `liar` reports a reward beyond the declared range, client `broken` an adapter with a NaN."""

    def train_client(self, round_idx, client_index, client_id):
        update = super().train_client(round_idx, client_index, client_id)
        if client_id == "liar":
            update.reward = 1e6
        if client_id == "broken":
            next(iter(update.state.values()))[0, 0] = math.nan
        return update


def test_invalid_updates_are_rejected_before_touching_server_state(tmp_path, tiny_model_dir):
    runner = make_runner(tiny_model_dir, tmp_path / "run", reward_funcs=bounded_length_reward, runner_class=Tampering,
                         clients=prompt_clients("honest", "liar", "broken"), num_rounds=1,
                         server_optimizer="adam")  # its moments are the server state a bad update would poison
    assert runner.server.reward_range == (0.0, 1.0)
    record = runner.run()[0]
    assert record.weights == {"honest": 1.0}
    assert set(runner.aggregator.baselines) == {"honest"}
    assert all(torch.isfinite(tensor).all() for tensor in runner.global_state.values())
    assert all(torch.isfinite(tensor).all() for tensor in runner.aggregator.server_optimizer.m.values())
    dropped = {e["client_id"]: e for e in events(tmp_path / "run", "client_dropped")}
    assert dropped["liar"]["kind"] == dropped["broken"]["kind"] == "invalid_update"
    assert "client 'liar' rejected: reward R̄ = 1000000.0 lies outside" in dropped["liar"]["reason"]
    assert "client 'broken' rejected: adapter[" in dropped["broken"]["reason"]
    assert record.dropped == {client: event["reason"] for client, event in dropped.items()}


# 5. Inputs -----------------------------------------------------------------------------------------------


def test_a_reward_function_of_the_wrong_length_fails_clearly(tmp_path, tiny_model_dir):
    def one_reward(completions, **kwargs):
        return [0.0]

    runner = make_runner(tiny_model_dir, tmp_path / "run", reward_funcs=one_reward, clients=prompt_clients("site-0"))
    with pytest.raises(NotEnoughClientsError, match=r"site-0: ValueError: The reward function 'one_reward' returned 1 "
                       r"rewards, but 4 were expected.*no round finished"):
        runner.run()


def test_too_small_client_datasets_fail_early_naming_the_client(tmp_path, tiny_model_dir):
    clients = {**prompt_clients("site-0"), "tiny-site": prompt_clients("tiny-site", rows=1)["tiny-site"]}
    with pytest.raises(ValueError, match=r"one generation batch of 2 prompts .*\{'tiny-site': 1\} rows"):
        make_runner(tiny_model_dir, tmp_path, clients=clients, per_device_train_batch_size=8)
    with pytest.raises(ValueError, match=r"min_clients_per_round` \(3\) exceeds the 2 clients"):
        make_runner(tiny_model_dir, tmp_path, min_clients_per_round=3)


def test_new_config_fields_are_validated(tmp_path):
    for overrides, message in [
        ({"min_clients_per_round": 0}, "`min_clients_per_round` must be a positive integer"),
        ({"num_clients": 3, "min_clients_per_round": 4}, r"`min_clients_per_round` \(4\) must not exceed"),
        ({"client_timeout": 0}, "`client_timeout` must be > 0 seconds or None"),
    ]:
        with pytest.raises(ValueError, match=message):
            FedGRPOConfig(output_dir=str(tmp_path), bf16=False, **overrides)


def test_drop_in_trainer_resumes_the_federation(tmp_path, tiny_model_dir, tiny_tokenizer):
    dataset = Dataset.from_dict({"prompt": [f"Question {i}?" for i in range(8)], "difficulty": ["easy", "hard"] * 4})

    def trainer(num_rounds):
        args = FedGRPOConfig(output_dir=str(tmp_path / "run"), **{
            **FAST_GRPO, "num_clients": 2, "dirichlet_alpha": float("inf"), "num_rounds": num_rounds,
            "local_steps": 1, "reward_window": 1,
        })
        return FedGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward,
                              args=args, train_dataset=dataset, processing_class=tiny_tokenizer,
                              peft_config=default_lora_config())

    trainer(1).train()
    resumed = trainer(2)
    output = resumed.train(resume_from_checkpoint=True)
    assert output.metrics["num_rounds"] == 2
    # The trainer's state reads as the uninterrupted run's: the restored round, then the new one.
    assert [(entry["round"], entry["step"]) for entry in resumed.state.log_history] == [(0, 1), (1, 2)]
    assert resumed.state.global_step == 2
    assert [line["round_idx"] for line in events(tmp_path / "run", "round")] == [0, 1]


def test_cli_output_dir_guard_resume_and_overwrite(tmp_path, tiny_model_dir):
    rows = 16
    data = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(rows)],
        "answer": [str(2 * i) for i in range(rows)],
        "difficulty": ["simple", "hard"] * (rows // 2),
    })
    DatasetDict(train=data, test=data.select(range(4))).save_to_disk(tmp_path / "data")
    output_dir = tmp_path / "cli-run"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        **FAST_GRPO, "output_dir": str(output_dir), "model_name_or_path": str(tiny_model_dir),
        "dataset_name": str(tmp_path / "data"), "num_clients": 2, "dirichlet_alpha": "inf", "num_rounds": 1,
        "local_steps": 1, "reward_window": 1, "per_device_eval_batch_size": 4,
    }))
    assert main(["run", "--config", str(config)]) == 0

    with pytest.raises(FileExistsError, match="already holds another run .*checkpoint-0.*metrics.jsonl.*resume it"):
        main(["run", "--config", str(config)])
    assert main(["run", "--config", str(config), "--num_rounds", "2", "--resume_from_checkpoint", "true"]) == 0
    result = json.loads((output_dir / "result.json").read_text())
    assert [r["round_idx"] for r in result["rounds"]] == [0, 1] and set(result["evaluations"]) == {"-1", "0", "1"}
    assert [e["event"] for e in events(output_dir)].count("resumed") == 1
    summary = (output_dir / "summary.md").read_text()
    assert "| 0 |" in summary and "| 1 |" in summary  # the report kept the first run's round (0-based, as round-<t>/)

    assert main(["run", "--config", str(config), "--overwrite_output_dir", "true"]) == 0
    assert [e["event"] for e in events(output_dir)] == ["evaluation", "client", "client", "evaluation", "round"]
    assert [path.name for path in list_checkpoints(output_dir)] == ["checkpoint-0"]
    assert not (output_dir / "round-1").exists()


