"""The one guarded path by which client updates enter the server (`admission.UpdateGate`): identity, bounds on the
update norm and the sample count, and a fuzz test of the in-process runner's path (the Flower path's fuzz test is
in test_flower.py). Whatever a client sends, the server gets a checked `ClientUpdate` or an `InvalidUpdateError`
naming the client, never another exception."""

import math
import random

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from conftest import length_reward
from trl_federated import ClientUpdate, FederatedRunner
from trl_federated.adapters import InvalidUpdateError
from trl_federated.aggregation import ScaffoldAggregator
from trl_federated.core.admission import UpdateGate, read_reply, state_distance, update_norm_unit

GLOBAL = {"a": torch.zeros(2, 3), "b": torch.ones(4)}


def update(client_id="site-0", scale=0.1, **fields):
    state = {key: value + scale for key, value in GLOBAL.items()}
    return ClientUpdate(**{"client_id": client_id, "state": state, "num_samples": 5, "reward": 0.5, **fields})


def gate(**kwargs):
    gate = UpdateGate(**kwargs)
    gate.open_round(GLOBAL)
    return gate


def test_the_update_must_speak_for_the_client_asked_and_only_once():
    admission = gate()
    with pytest.raises(InvalidUpdateError, match=r"client 'site-0' rejected: it speaks for client 'site-1'"):
        admission.check("site-0", update("site-1"))
    admission.check("site-0", update("site-0"))
    with pytest.raises(InvalidUpdateError, match="already had an update accepted this round"):
        admission.check("site-0", update("site-0"))
    admission.open_round(GLOBAL)  # a new round
    admission.check("site-0", update("site-0"))


def test_any_decoding_error_is_the_clients_invalid_update():
    def broken():
        raise MemoryError("cannot allocate 2**62 bytes")

    with pytest.raises(InvalidUpdateError, match=r"client 'site-0' rejected: unreadable reply \(MemoryError: cannot"):
        read_reply("site-0", broken)
    with pytest.raises(InvalidUpdateError, match=r"client 'site-0' rejected: the reply decodes to a dict"):
        gate().check("site-0", {"state": GLOBAL})


def test_update_norm_bound_rejects_or_clips():
    honest, poisoned = update(scale=0.1), update(scale=1e6)  # ‖θ_i − θ‖ = 0.1·√10 and 1e6·√10
    bound = 1.0
    admission = gate(max_update_norm=bound)
    assert admission.check("site-0", honest) is honest
    admission.open_round(GLOBAL)
    with pytest.raises(InvalidUpdateError, match=r"‖θ_i − θ‖ = 3.162e\+06 exceeds update_norm_bound \(1\)"):
        admission.check("site-0", poisoned)

    clipped = gate(max_update_norm=bound, norm_action="clip").check("site-0", update(scale=1e6))
    assert state_distance(clipped.state, GLOBAL) == pytest.approx(bound)
    for key in GLOBAL:  # the direction is kept
        assert torch.allclose(clipped.state[key] - GLOBAL[key], torch.full_like(GLOBAL[key], bound / math.sqrt(10)))
    # values around 1e30 are finite, but their square is not in float32: still bounded, in float64
    with pytest.raises(InvalidUpdateError, match="exceeds update_norm_bound"):
        gate(max_update_norm=bound).check("site-0", update(scale=1e30))


def test_scaffold_control_delta_is_required_bounded_and_refused_elsewhere():
    control = {key: torch.full_like(value, 10.0) for key, value in GLOBAL.items()}  # ‖Δc‖ = 10·√10
    scaffold = ScaffoldAggregator()
    bound = 1 / math.sqrt(10)  # update_norm_bound in SCAFFOLD's unit, √d: a bound of 1 on ‖c_i + Δc_i‖ (c_i = 0 here)
    with pytest.raises(InvalidUpdateError, match="SCAFFOLD needs its control_delta"):
        gate(aggregator=scaffold).check("site-0", update())
    with pytest.raises(InvalidUpdateError, match=r"sends \['control_delta'\], but the aggregation takes nothing but"):
        gate().check("site-0", update(extras={"control_delta": control}))
    with pytest.raises(InvalidUpdateError, match=r"‖c_i \+ Δc_i‖ = 31.62 exceeds the control bound"):
        gate(aggregator=scaffold, extras_norm_bound=bound).check(
            "site-0", update(extras={"control_delta": dict(control)}))
    clipped = gate(aggregator=scaffold, extras_norm_bound=bound, norm_action="clip").check(
        "site-0", update(extras={"control_delta": dict(control)}))
    clipped_delta = clipped.extras["control_delta"]
    assert math.sqrt(sum(value.square().sum() for value in clipped_delta.values())) == pytest.approx(1.0)


def test_sample_counts_the_server_knows_replace_the_report_and_others_are_capped():
    admission = gate(num_samples={"site-0": 12}, max_client_samples=1000)
    assert admission.check("site-0", update("site-0", num_samples=2**62)).num_samples == 12
    assert admission.check("site-1", update("site-1", num_samples=2**62)).num_samples == 1000
    assert admission.check("site-2", update("site-2", num_samples=40)).num_samples == 40


def test_update_norm_bound_from_config_is_in_units_of_adam_steps(fast_args):
    args = fast_args(local_steps=4, learning_rate=1e-2)
    unit = update_norm_unit(4, 1e-2, GLOBAL)
    assert unit == pytest.approx(4 * 1e-2 * math.sqrt(10))
    admission = UpdateGate.from_config(args, GLOBAL, aggregator=ScaffoldAggregator())
    assert admission.max_update_norm == pytest.approx(10 * unit)  # the default update_norm_bound, 10 U
    # SCAFFOLD bounds ‖Δc_i‖ by update_norm_bound in its own unit, √d: 10 √10
    assert admission.extras_norm_bound == 10
    for value in (9.99, 10.01):  # ‖Δc_i‖ = value · √10
        admission.open_round(GLOBAL)
        control = {"control_delta": {key: torch.full_like(reference, value) for key, reference in GLOBAL.items()}}
        if value < 10:
            admission.check("site-0", update(extras=control))
        else:
            with pytest.raises(InvalidUpdateError, match=r"exceeds the control bound \(31.62\)"):
                admission.check("site-0", update(extras=control))
    assert admission.norm_action == "reject" and admission.max_client_samples == 1_000_000
    assert UpdateGate.from_config(fast_args(update_norm_bound=None), GLOBAL).max_update_norm is None


# Fuzz: the in-process runner's path (`FederatedRunner._receive` through the runner's gate) ---------------------

JUNK = [None, True, -1, 0, 2**62, 1.5, math.nan, math.inf, -math.inf, 1e308, "0.5", b"\x00", [], [1.0], {}, {"a": 1},
        object(), torch.tensor(0.5), torch.tensor([math.nan]), 3 + 4j]


def junk_tensor(rng, reference):
    choice = rng.randrange(9)
    if choice == 0:
        return torch.full_like(reference, rng.choice([math.nan, math.inf, -math.inf, 1e30, -3e38]))
    if choice == 1:
        return torch.zeros([rng.randrange(0, 5) for _ in range(rng.randrange(0, 4))])
    if choice == 2:
        return reference.to(rng.choice([torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool,
                                        torch.uint8, torch.complex64]))
    if choice == 3:
        return reference.tolist()
    if choice == 4:
        return reference * rng.choice([1e6, -1e9, 1e20])
    if choice == 5:
        return reference.t() if reference.dim() == 2 else reference[:-1]
    if choice == 6:
        return torch.empty(0)
    if choice == 7:
        return reference.reshape(-1)
    return rng.choice(JUNK)


def mutate(rng, update, global_state):
    """One random fault in one field of a valid update (or, one time in ten, none)."""
    field = rng.randrange(11)
    key = rng.choice(list(global_state))
    if field == 0:
        update.client_id = rng.choice([*JUNK, "site-1", "", "x" * 10_000])
    elif field == 1:
        update.state = rng.choice([None, [], "adapter", {}, {1: torch.zeros(1)}, global_state.values()])
    elif field == 2:
        update.state[key] = junk_tensor(rng, global_state[key])
    elif field == 3:
        update.state[rng.choice(["extra", key + ".x", ""])] = torch.zeros(2)
    elif field == 4:
        del update.state[key]
    elif field == 5:
        update.num_samples = rng.choice([*JUNK, -(2**63), 2**62])
    elif field == 6:
        update.reward = rng.choice(JUNK)
    elif field == 7:
        update.metrics = rng.choice([None, [], "x", {1: 2}, {"loss": math.nan}, {"deep": [[{}]]}])
    elif field == 8:
        update.extras = rng.choice([{"control_delta": {}}, {"control_delta": {key: torch.zeros(1)}}, "x",
                                    {"control_delta": dict(global_state)}])
    elif field == 9:
        update.wire_bytes = rng.choice(JUNK)  # the server measures it itself
    return update


def sent(runner, update):
    """`update` as `client.train_local_round` returns it: its adapter encoded for the runner's wire format."""
    update.state = runner.server.wire.encode(update.state, runner.global_state)
    return update


def test_fuzz_every_field_of_an_in_process_update(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args):
    clients = {f"site-{c}": Dataset.from_dict({"prompt": [f"q{i}" for i in range(4)]}) for c in range(3)}
    for settings in ({}, {"transfer_dtype": "bfloat16"}, {"transfer_dtype": "nf4"}, {"lora_aggregation": "freeze_a"}):
        runner = FederatedRunner(AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward,
                                 fast_args(**settings), clients, processing_class=tiny_tokenizer)
        reference = {key: value.clone() for key, value in runner.global_state.items()}
        bound = runner.server.gate.max_update_norm
        rng = random.Random(0)
        outcomes = {"accepted": 0, "rejected": 0}
        for case in range(300):
            runner.server.gate.open_round(runner.global_state)
            honest = ClientUpdate("site-0", {key: value + 1e-3 for key, value in reference.items()}, 4, 0.5)
            faulty = mutate(rng, honest, reference)
            try:
                admitted = runner.server.admit("site-0", read_reply("site-0", lambda: sent(runner, faulty)))
            except InvalidUpdateError as error:
                assert "client 'site-0' rejected: " in str(error) and len(str(error)) < 1500, (case, str(error))
                outcomes["rejected"] += 1
                continue
            outcomes["accepted"] += 1  # then it is a sound update
            assert admitted.client_id == "site-0" and set(admitted.state) == set(reference)
            assert all(admitted.state[key].dtype == value.dtype and admitted.state[key].shape == value.shape
                       and torch.isfinite(admitted.state[key]).all() for key, value in reference.items())
            assert isinstance(admitted.num_samples, int) and admitted.num_samples == 4  # the runner's own count
            assert math.isfinite(admitted.reward) and state_distance(admitted.state, reference) <= bound
            assert admitted.extras == {}
        assert outcomes["accepted"] > 10 and outcomes["rejected"] > 200, outcomes
        assert all(torch.equal(runner.global_state[key], reference[key]) for key in reference)  # untouched


# The attacks of issue 16, through the in-process runner -------------------------------------------------------


class Hostile(FederatedRunner):
    """Client `evil` tampers with its update in the rounds listed in `self.attack_rounds`: `self.attack(update)`."""

    attack_rounds = (0,)

    def train_client(self, round_idx, client_index, client_id):
        update = super().train_client(round_idx, client_index, client_id)
        if client_id == "evil" and round_idx in self.attack_rounds:
            self.attack(update, self.global_state)
        return update


def scale_delta(update, global_state, factor=1e6):
    update.state = {
        key: global_state[key] + factor * (value - global_state[key]) for key, value in update.state.items()
    }


def huge_values(update, global_state):
    update.state = {key: torch.full_like(value, 1e30) for key, value in update.state.items()}


def hostile_runner(tmp_path, model_dir, tokenizer, fast_args, attack, num_rounds=1, **overrides):
    clients = {name: Dataset.from_dict({"prompt": [f"{name} asks {i}?" for i in range(rows)]})
               for name, rows in (("honest-a", 4), ("honest-b", 12), ("evil", 4))}
    runner = Hostile(AutoModelForCausalLM.from_pretrained(model_dir), length_reward,
                     fast_args(num_rounds=num_rounds, local_steps=1, reward_window=1, **overrides), clients,
                     processing_class=tokenizer)
    runner.attack = attack
    return runner


@pytest.mark.parametrize("aggregation, attack", [
    ("fedavg", scale_delta),  # moves FedAvg's adapter arbitrarily far
    ("rpg", huge_values),  # finite, but Adam's v = Δ² overflows: the adapter never moves again
])
def test_finite_poison_is_rejected_by_the_update_norm_bound(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args,
                                                            aggregation, attack):
    runner = hostile_runner(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args, attack, aggregation=aggregation)
    record = runner.run()[0]
    assert set(record.weights) == {"honest-a", "honest-b"}
    assert "exceeds update_norm_bound" in record.dropped["evil"]
    state = runner.aggregator.state_dict()["server_optimizer"]
    assert all(torch.isfinite(t).all() for t in [*runner.global_state.values(), *state.get("v", {}).values()])


def test_a_non_finite_aggregate_stops_the_run_and_keeps_the_last_good_checkpoint(
    tmp_path, tiny_model_dir, tiny_tokenizer, fast_args
):
    from trl_federated.aggregation import AggregationError
    from trl_federated.core.checkpoint import list_checkpoints, read_checkpoint

    runner = hostile_runner(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args, huge_values, num_rounds=2,
                            update_norm_bound=None, server_optimizer="adam")  # the poison reaches server Adam
    runner.attack_rounds = (1,)
    with pytest.raises(AggregationError, match=r"Round 1: .*non-finite values in server optimizer\['v'\]"):
        runner.run()
    assert [path.name for path in list_checkpoints(tmp_path / "run")] == ["checkpoint-0"]
    checkpoint = read_checkpoint(tmp_path / "run" / "checkpoint-0")
    assert all(torch.isfinite(value).all() for value in checkpoint.aggregator["server_optimizer"]["v"].values())


def test_self_reported_sample_counts_and_rewards_are_bounded(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args):
    def lie(update, global_state):
        update.num_samples = 2**62  # all of FedAvg's weight, if believed
        update.reward = 1e9  # all of RPG's weight without a declared reward range, if h were unbounded
        # R̄ must be the mean of the step rewards sent with it: a consistent liar makes those up too
        update.metrics["step_rewards"] = [1e9] * len(update.metrics["step_rewards"])

    fedavg = hostile_runner(tmp_path / "fedavg", tiny_model_dir, tiny_tokenizer, fast_args, lie, aggregation="fedavg",
                            output_dir=str(tmp_path / "fedavg"))
    assert fedavg.run()[0].weights == {"honest-a": 0.2, "honest-b": 0.6, "evil": 0.2}  # the runner's own D_i

    rpg = hostile_runner(tmp_path / "rpg", tiny_model_dir, tiny_tokenizer, fast_args, lie, num_rounds=2,
                         output_dir=str(tmp_path / "rpg"))
    rpg.attack_rounds = (1,)
    record = rpg.run()[1]
    assert record.gains["evil"] == 10.0  # rpg_h_max, the paper's Assumption 5, on by default
    tau, honest = record.temperature, [record.gains["honest-a"], record.gains["honest-b"]]
    expected = math.exp(10.0 / tau) / (math.exp(10.0 / tau) + sum(math.exp(h / tau) for h in honest))
    assert record.weights["evil"] == pytest.approx(expected)
