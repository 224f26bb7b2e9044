"""The server step is sized to the clients (issue 25): server Adam's default learning rate follows the local budget,
and every round records how far the server moved the adapter against the clients' mean change Δ, each client's
update against Δ, and the GRPO groups that carried no learning signal."""

import json
import logging
import math
from pathlib import Path

import pytest
import yaml
from datasets import Dataset
from transformers import AutoModelForCausalLM

from conftest import FAST_GRPO
from trl_federated import FederatedRunner, FedGRPOConfig, RoundCallback
from trl_federated.aggregation import FedAvgAggregator, ServerSGD, pseudo_gradient
from trl_federated.aggregation.base import state_distance, state_norm
from trl_federated.callbacks import IntegrationLog
from trl_federated.checkpoint import MANIFEST_FILE, STATE_FILE, _file_digest

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"


class KeepUpdates(RoundCallback):
    def __init__(self):
        self.updates = []

    def on_client_end(self, args, round_idx, update, **kwargs):
        self.updates.append(update)


def prompt_reward(completions, prompts, **kwargs):
    """A constant reward for the prompts of a "Flat" client (every group's K rewards equal: no GRPO signal), the
    completion's length for the others."""
    return [0.5 if "Flat" in str(prompt) else len(str(text)) / 64 for prompt, text in zip(prompts, completions)]


def clients(*names, rows=8):
    return {name: Dataset.from_dict({"prompt": [f"{name} asks: what is {i} times 3?" for i in range(rows)]})
            for name in names}


@pytest.mark.parametrize("recipe", ["quickstart.yaml", "paper/fgrpo.yaml"])
def test_first_server_step_is_a_small_multiple_of_fedavgs(recipe, tmp_path, tiny_model_dir, tiny_tokenizer):
    """Round 0 of FGRPO (h = 0: uniform weights) with the recipe's local budget and server settings moves the adapter
    by a small multiple of what FedAvg moves it on the same client updates (equal data, so the same weights)."""
    settings = yaml.safe_load((CONFIGS / recipe).read_text())
    assert settings["aggregation"] == "rpg"
    budget = {name: settings.get(name) for name in ("local_steps", "learning_rate", "server_learning_rate")}
    args = FedGRPOConfig(**{**FAST_GRPO, **budget}, output_dir=str(tmp_path), num_rounds=1, reward_window=1, seed=0)
    keep = KeepUpdates()
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), prompt_reward, args, clients("site-0", "site-1"),
        processing_class=tiny_tokenizer, callbacks=[keep],
    )
    initial = {key: value.clone() for key, value in runner.global_state.items()}
    runner.run()
    fedavg = FedAvgAggregator(ServerSGD(1.0)).aggregate(initial, keep.updates, 0)
    ratio = state_distance(runner.global_state, initial) / state_distance(fedavg, initial)
    # Adam's first step is α per coordinate; α = 0.5 E lr is half the most E local steps move one (1.1x and 2.2x
    # here; a fixed α = 1e-3 gave 5.6x at the quickstart's 2 x 2e-4 and 43x at the paper's 10 x 1e-5)
    assert 0.3 < ratio < 3, ratio
    assert runner.history[0].server_step_ratio == pytest.approx(ratio, rel=1e-4)


def test_round_diagnostics_in_metrics_and_report_to(tmp_path, tiny_model_dir, tiny_tokenizer, caplog):
    """One client learns, one sees only equal rewards (no GRPO signal, no update): the learner's update is the
    whole aggregate (cosine 1), the other's update is 0, and the recorded norms are those of the adapters."""
    args = FedGRPOConfig(**FAST_GRPO, output_dir=str(tmp_path / "run"), num_rounds=1, local_steps=2, reward_window=1,
                         seed=0, server_learning_rate=0.05)  # far above what the clients move: warned
    keep = KeepUpdates()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    log_to = IntegrationLog(args, model, tiny_tokenizer, is_main_process=True)
    runner = FederatedRunner(model, prompt_reward, args, clients("Learner", "Flat"), processing_class=tiny_tokenizer,
                             callbacks=[keep], log_to=log_to)
    initial = {key: value.clone() for key, value in runner.global_state.items()}
    with caplog.at_level(logging.WARNING, logger="trl_federated.server"):
        (record,) = runner.run()

    updates = {update.client_id: update for update in keep.updates}
    delta = pseudo_gradient(initial, [update.state for update in keep.updates], [record.weights[u.client_id]
                                                                                 for u in keep.updates])
    assert record.update_norms["Learner"] == pytest.approx(state_distance(updates["Learner"].state, initial), rel=1e-5)
    assert record.update_norms["Learner"] > 0 and record.update_norms["Flat"] == 0
    assert record.update_cosines["Learner"] == pytest.approx(1.0, abs=1e-6) and record.update_cosines["Flat"] is None
    assert record.delta_norm == pytest.approx(state_norm(delta), rel=1e-5)
    assert record.server_step_norm == pytest.approx(state_distance(runner.global_state, initial), rel=1e-5)
    assert record.server_step_ratio == pytest.approx(record.server_step_norm / record.delta_norm)
    assert record.server_step_ratio > 5
    assert "server_learning_rate` 0.05 (set)" in caplog.text and "`local_steps` 2" in caplog.text

    # the fraction of each client's GRPO groups whose K rewards were all equal, from TRL's frac_reward_zero_std
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    zero_std = {
        line["client_id"]: line["metrics"]["frac_reward_zero_std"] for line in lines if line["event"] == "client"
    }
    assert zero_std["Flat"] == 1.0 and zero_std["Learner"] < 1.0
    (round_line,) = [line for line in lines if line["event"] == "round"]
    assert round_line["update_cosines"] == {"Learner": pytest.approx(1.0, abs=1e-6), "Flat": None}
    assert round_line["update_norms"] == pytest.approx(record.update_norms)
    assert round_line["server_step_ratio"] == pytest.approx(record.server_step_ratio)

    # report_to's log path: one entry per round, per client and for the round
    (entry,) = log_to.state.log_history
    assert entry["Learner/update_cosine"] == pytest.approx(1.0, abs=1e-6) and "Flat/update_cosine" not in entry
    assert entry["Flat/update_norm"] == 0 and entry["Learner/update_norm"] == record.update_norms["Learner"]
    assert entry["Flat/frac_reward_zero_std"] == 1.0
    assert entry["frac_reward_zero_std"] == pytest.approx((1.0 + zero_std["Learner"]) / 2)
    for name in ("delta_norm", "server_step_norm", "server_step_ratio"):
        assert entry[name] == getattr(record, name) and math.isfinite(entry[name])


def test_a_resumed_run_keeps_its_derived_server_learning_rate(tmp_path, tiny_model_dir, tiny_tokenizer, caplog):
    """The derived α is resolved once: resumed with another local learning rate (allowed), or from a checkpoint
    written when the default was a fixed 1e-3, the run goes on with the α its checkpoint recorded."""
    common = dict(FAST_GRPO, output_dir=str(tmp_path / "run"), local_steps=1, reward_window=1, seed=0)

    def run(**overrides):
        args = FedGRPOConfig(**{**common, **overrides})
        runner = FederatedRunner(AutoModelForCausalLM.from_pretrained(tiny_model_dir), prompt_reward, args,
                                 clients("site-0"), processing_class=tiny_tokenizer)
        runner.run()
        return runner

    first = run(num_rounds=1)
    assert first.aggregator.server_optimizer.learning_rate == 0.5 * 1e-2
    with caplog.at_level(logging.WARNING, logger="trl_federated.server"):
        resumed = run(num_rounds=2, learning_rate=1e-3, resume_from_checkpoint=True,
                      resume_allow_changes="learning_rate")
    assert resumed.aggregator.server_optimizer.learning_rate == resumed.args.server_learning_rate == 0.5 * 1e-2
    assert "checkpoint's server_learning_rate 0.005" in caplog.text
    # an explicit rate is a training setting like any other: a different one is refused
    with pytest.raises(ValueError, match="server_learning_rate"):
        run(num_rounds=3, server_learning_rate=1e-3, learning_rate=1e-3, resume_from_checkpoint=True,
            resume_allow_changes="learning_rate")
    # a checkpoint written when the default was a fixed 1e-3 recorded that: the run resumes with it
    checkpoint = tmp_path / "run" / "checkpoint-1"
    state = json.loads((checkpoint / STATE_FILE).read_text())
    state["identity"]["training"]["server_learning_rate"] = 1e-3
    (checkpoint / STATE_FILE).write_text(json.dumps(state))
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    manifest["files"][STATE_FILE] = _file_digest(checkpoint / STATE_FILE)
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))
    old = run(num_rounds=3, learning_rate=1e-3, resume_from_checkpoint=True, resume_allow_changes="learning_rate")
    assert old.aggregator.server_optimizer.learning_rate == 1e-3 and len(old.history) == 3
