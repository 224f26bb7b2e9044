"""What crosses the wire: exact LoRA aggregation with `freeze_a`, and bfloat16 updates with a bounded error."""

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from conftest import length_reward
from trl_federated import FedAvgAggregator, FederatedRunner, RoundCallback, ServerSGD
from trl_federated.adapters import WireFormat, is_lora_a, state_nbytes

CLIENTS = {
    f"site-{c}": Dataset.from_dict({"prompt": [f"Client {c} asks: what is {i} times {c}?" for i in range(8)]})
    for c in range(2)
}


class Updates(RoundCallback):
    """The updates as the server received them, per round."""

    def __init__(self):
        self.received = []

    def on_client_end(self, args, round_idx, update, **kwargs):
        self.received.append(update)


def run_one_round(tiny_model_dir, tiny_tokenizer, fast_args, peft_config=None, **overrides):
    updates = Updates()
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward,
        fast_args(num_rounds=1, local_steps=2, **overrides), CLIENTS, processing_class=tiny_tokenizer,
        peft_config=peft_config, callbacks=[updates],
        # FedAvg with server SGD at lr 1: the new global adapter is exactly the weighted average of the clients'.
        aggregator=FedAvgAggregator(server_optimizer=ServerSGD(learning_rate=1.0)),
    )
    initial = {key: value.clone() for key, value in runner.global_state.items()}
    history = runner.run()
    return runner, initial, updates.received, history[0]


def test_wire_format_round_trips():
    reference = {"m.lora_A.weight": torch.randn(4, 8), "m.lora_B.weight": torch.randn(8, 4)}
    state = {key: value + 1e-3 * torch.randn_like(value) for key, value in reference.items()}

    exact = WireFormat()
    assert state_nbytes(exact.encode(state, reference)) == state_nbytes(state)
    decoded = exact.decode(exact.encode(state, reference), reference)
    assert all(torch.equal(decoded[key], state[key]) for key in state)

    frozen = WireFormat(frozen_keys=frozenset({"m.lora_A.weight"}))
    assert set(frozen.encode(state, reference)) == {"m.lora_B.weight"}
    decoded = frozen.decode(frozen.encode(state, reference), reference)
    assert torch.equal(decoded["m.lora_A.weight"], reference["m.lora_A.weight"])
    assert torch.equal(decoded["m.lora_B.weight"], state["m.lora_B.weight"])

    half = WireFormat(dtype=torch.bfloat16)
    payload = half.encode(state, reference)
    assert state_nbytes(payload) * 2 == state_nbytes(state)
    decoded = half.decode(payload, reference)
    for key in state:
        change = state[key] - reference[key]
        # bfloat16 keeps 8 significant bits: the error is relative to the round's change, not to the weight
        assert ((decoded[key] - state[key]).abs() <= 2**-8 * change.abs() + 1e-7).all()
        assert decoded[key].dtype == torch.float32


def test_is_lora_a_names_only_a_factors():
    assert is_lora_a("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    assert is_lora_a("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    assert not is_lora_a("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")


def test_freeze_a_aggregates_exactly_and_halves_the_payload(tiny_model_dir, tiny_tokenizer, fast_args):
    # q and o projections are square (32 x 32), so A (r x 32) and B (32 x r) have the same size.
    square = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], task_type="CAUSAL_LM")
    runner, initial, updates, record = run_one_round(
        tiny_model_dir, tiny_tokenizer, fast_args, peft_config=square, lora_aggregation="freeze_a"
    )
    a_keys = [key for key in initial if is_lora_a(key)]
    b_keys = [key for key in initial if not is_lora_a(key)]
    assert a_keys and b_keys

    # A never moved, on the clients or the server; B did.
    for update in updates:
        assert all(torch.equal(update.state[key], initial[key]) for key in a_keys)
    assert all(torch.equal(runner.global_state[key], initial[key]) for key in a_keys)
    assert any(not torch.equal(runner.global_state[key], initial[key]) for key in b_keys)

    # The merged update B·A of the global adapter is exactly the weighted average of the clients' B_i·A_i.
    weights = [record.weights[update.client_id] for update in updates]
    for b_key in b_keys:
        a_key = b_key.replace("lora_B", "lora_A")
        client_average = sum(w * (u.state[b_key] @ u.state[a_key]) for w, u in zip(weights, updates))
        torch.testing.assert_close(runner.global_state[b_key] @ runner.global_state[a_key], client_average)

    # Only B is sent, in both directions: exactly half the adapter here.
    full = state_nbytes(initial)
    assert all(sent * 2 == full for sent in record.bytes_sent.values())
    assert all(received * 2 == full for received in record.bytes_received.values())


def test_separate_factors_average_is_not_the_average_update(tiny_model_dir, tiny_tokenizer, fast_args):
    """Why `freeze_a` exists: with A trained too, averaging A and B separately misses the average of B_i·A_i."""
    runner, initial, updates, record = run_one_round(tiny_model_dir, tiny_tokenizer, fast_args)
    weights = [record.weights[update.client_id] for update in updates]
    gaps = []
    for b_key in (key for key in initial if not is_lora_a(key)):
        a_key = b_key.replace("lora_B", "lora_A")
        client_average = sum(w * (u.state[b_key] @ u.state[a_key]) for w, u in zip(weights, updates))
        gaps.append((runner.global_state[b_key] @ runner.global_state[a_key] - client_average).abs().max())
    assert max(gaps) > 1e-6
    assert all(sent == state_nbytes(initial) for sent in record.bytes_sent.values())


def test_bfloat16_transfer_halves_bytes_and_bounds_the_aggregate_error(tiny_model_dir, tiny_tokenizer, fast_args):
    exact, initial, exact_updates, exact_record = run_one_round(tiny_model_dir, tiny_tokenizer, fast_args)
    half, _, _, half_record = run_one_round(
        tiny_model_dir, tiny_tokenizer, fast_args, transfer_dtype="bfloat16", overwrite_output_dir=True
    )
    full = state_nbytes(initial)
    assert all(sent == full for sent in exact_record.bytes_sent.values())
    assert all(sent * 2 == full for sent in half_record.bytes_sent.values())
    assert exact_record.weights == half_record.weights

    # Same seeds, same start: the clients trained identically; only the wire differs. Each coordinate of the
    # new global adapter is off by at most 2^-8 of the weighted clients' changes, and the error is not zero.
    weights = [exact_record.weights[update.client_id] for update in exact_updates]
    worst = 0.0
    for key, start in initial.items():
        bound = sum(w * (u.state[key] - start).abs() for w, u in zip(weights, exact_updates)) * 2**-8
        error = (half.global_state[key] - exact.global_state[key]).abs()
        assert (error <= bound + 1e-7).all(), key
        worst = max(worst, error.max().item())
    assert worst > 0
