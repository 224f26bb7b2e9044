"""What crosses the wire: exact LoRA aggregation with `freeze_a`, bfloat16 updates with a bounded error, and
blockwise-quantized updates (int8, nf4, fp4) with error feedback, refused by name when malformed."""

import math
import re
from unittest import mock

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from conftest import length_reward
from trl_federated import FedAvgAggregator, FederatedRunner, RoundCallback, ServerSGD
from trl_federated.adapters import (
    InvalidUpdateError,
    is_lora_a,
    state_distance,
    state_nbytes,
    with_federated_adapter,
)
from trl_federated.aggregation import ClientUpdate, aggregator_from_config
from trl_federated.aggregation.privacy import ClientLevelPrivacy
from trl_federated.choices import TRANSFER_DTYPES
from trl_federated.core.server import FederatedServer
from trl_federated.wire import Blockwise, WireFormat
from trl_federated.wire.blockwise import BLOCK_SIZE, SCALES

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

    half = WireFormat("bfloat16")
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


QUANTIZED = [name for name, codec in TRANSFER_DTYPES.items() if isinstance(codec, Blockwise)]


def adapter_pair(seed=0):
    """A reference adapter and one a round moved, with entries whose sizes are no multiple of a block or of 2."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"m.lora_A.weight": (16, 40), "m.lora_B.weight": (40, 16), "odd": (7, 3)}
    reference = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    moved = {key: value + 1e-3 * torch.randn(value.shape, generator=generator) for key, value in reference.items()}
    return reference, moved


@pytest.mark.parametrize("precision", QUANTIZED)
def test_a_quantized_update_costs_its_codes_and_scales_and_errs_within_half_a_level(precision):
    reference, state = adapter_pair()
    wire = WireFormat(precision)
    payload = wire.encode(state, reference)
    assert set(payload) == {name for key in state for name in (key, key + SCALES)}
    levels = TRANSFER_DTYPES[precision].levels
    for key, value in state.items():
        code_bytes = value.numel() if len(levels) > 16 else math.ceil(value.numel() / 2)
        assert payload[key].dtype == torch.uint8 and payload[key].numel() == code_bytes
        assert payload[key + SCALES].dtype == torch.float32
        assert payload[key + SCALES].numel() == math.ceil(value.numel() / BLOCK_SIZE)
    decoded = wire.decode(payload, reference)
    half_gap = (levels[1:] - levels[:-1]).max().item() / 2
    for key, value in state.items():
        change = (value - reference[key]).flatten()
        blocks = torch.nn.functional.pad(change.abs(), (0, -change.numel() % BLOCK_SIZE)).view(-1, BLOCK_SIZE)
        bound = blocks.amax(dim=1).repeat_interleave(BLOCK_SIZE)[: change.numel()] * half_gap
        error = (decoded[key] - value).flatten().abs()
        assert (error <= bound + 1e-6).all() and error.max() > 0, key
        assert decoded[key].dtype == torch.float32 and decoded[key].shape == value.shape
    # An adapter that did not move decodes to the reference bit for bit: the server sees an idle client.
    unmoved = wire.decode(wire.encode(reference, reference), reference)
    assert all(torch.equal(unmoved[key], reference[key]) for key in reference)


@pytest.mark.parametrize("precision", QUANTIZED)
def test_error_feedback_sends_each_rounds_rounding_in_the_next(precision):
    reference, _ = adapter_pair()
    wire, residual = WireFormat(precision), {}
    generator = torch.Generator().manual_seed(1)
    changed, with_feedback, without = ({key: torch.zeros_like(value) for key, value in reference.items()}
                                       for _ in range(3))
    for _ in range(30):
        state = {key: value + 1e-3 * torch.randn(value.shape, generator=generator) for key, value in reference.items()}
        payloads = {"feedback": wire.encode(state, reference, residual), "none": wire.encode(state, reference)}
        for total, sent in ((with_feedback, payloads["feedback"]), (without, payloads["none"])):
            decoded = wire.decode(sent, reference)
            for key in reference:
                total[key] += decoded[key] - reference[key]
        for key in reference:
            changed[key] += state[key] - reference[key]
    # What 30 rounds sent is what they changed, less the one residual the client still holds.
    for key in reference:
        torch.testing.assert_close(with_feedback[key] + residual[key], changed[key], atol=1e-5, rtol=0)  # float32 sums
    gap = math.dist(torch.cat([with_feedback[k].flatten() for k in reference]).tolist(),
                    torch.cat([changed[k].flatten() for k in reference]).tolist())
    drift = math.dist(torch.cat([without[k].flatten() for k in reference]).tolist(),
                      torch.cat([changed[k].flatten() for k in reference]).tolist())
    assert gap < drift / 3, (gap, drift)
    # A client that did not move keeps its residual for a round that moves: it sends zeros, as an idle client.
    kept = {key: value.clone() for key, value in residual.items()}
    idle = wire.decode(wire.encode(reference, reference, residual), reference)
    assert all(torch.equal(idle[key], reference[key]) and torch.equal(residual[key], kept[key]) for key in reference)


def quantized_server(model_dir, fast_args, precision, **overrides) -> FederatedServer:
    args = fast_args(num_clients=2, transfer_dtype=precision, **overrides)
    model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(model_dir), args.seed)
    server = FederatedServer(model, args, aggregator_from_config(args))
    server.begin_round(0)
    return server


def tamper(payload, key, codes=None, scales=None, drop=None):
    forged = dict(payload)
    if codes is not None:
        forged[key] = codes(forged[key])
    if scales is not None:
        forged[key + SCALES] = scales(forged[key + SCALES])
    if drop is not None:
        del forged[drop]
    return forged


@pytest.mark.parametrize("precision, forge, fault", [
    ("int8", dict(codes=lambda c: torch.full_like(c, 255)), "codes reach 255, past the 255 levels"),
    ("int8", dict(codes=lambda c: c.to(torch.int8)), "codes are torch.int8"),
    ("nf4", dict(codes=lambda c: c[:-1]), "expected torch.uint8"),
    ("nf4", dict(scales=lambda s: torch.full_like(s, math.nan)), "scales hold a negative, NaN or Inf value"),
    ("fp4", dict(scales=lambda s: -s), "scales hold a negative, NaN or Inf value"),
    ("fp4", dict(scales=lambda s: s.double()), "scales are torch.float64"),
    ("int8", dict(scales=lambda s: s.view(1, -1)), "expected torch.float32"),
    ("int8", dict(codes=lambda c: "codes"), "codes are str"),
])
def test_malformed_codes_or_scales_are_refused_by_name(tmp_path, tiny_model_dir, fast_args, precision, forge, fault):
    server = quantized_server(tiny_model_dir, fast_args, precision)
    moved = {key: value + 1e-4 for key, value in server.global_state.items()}
    payload = server.wire.encode(moved, server.global_state)
    key = next(iter(server.global_state))
    with pytest.raises(InvalidUpdateError, match="client 'site-0' rejected: unreadable reply") as error:
        server.admit("site-0", ClientUpdate("site-0", tamper(payload, key, **forge), 4, 0.5))
    assert fault in str(error.value) and key in str(error.value)
    with pytest.raises(InvalidUpdateError, match=r"missing \[.*#scales"):
        server.admit("site-0", ClientUpdate("site-0", tamper(payload, key, drop=key + SCALES), 4, 0.5))
    admitted = server.admit("site-0", ClientUpdate("site-0", payload, 4, 0.5))  # the untampered payload
    assert admitted.wire_bytes == state_nbytes(payload) < state_nbytes(server.global_state) / 3


def test_a_bfloat16_change_of_another_shape_is_refused_not_broadcast(tiny_model_dir, fast_args):
    server = quantized_server(tiny_model_dir, fast_args, "bfloat16")
    moved = {key: value + 1e-3 for key, value in server.global_state.items()}
    payload = server.wire.encode(moved, server.global_state)
    key = next(iter(server.global_state))
    forged = {**payload, key: payload[key].flatten()[:1]}  # one value, which addition would spread over the tensor
    with pytest.raises(InvalidUpdateError, match=rf"unreadable reply.*{re.escape(key)}.*shape \(1,\), expected"):
        server.admit("site-0", ClientUpdate("site-0", forged, 4, 0.5))
    server.admit("site-0", ClientUpdate("site-0", payload, 4, 0.5))  # the untampered payload


def test_differential_privacy_clips_the_decoded_update(tmp_path, tiny_model_dir, fast_args):
    server = quantized_server(tiny_model_dir, fast_args, "nf4", dp_noise_multiplier=1.0, update_norm_bound=None,
                              aggregation="fedavg")
    for client_id in ("site-0", "site-1"):
        server.broadcast(client_id)
    decoded = []
    for index, client_id in enumerate(("site-0", "site-1")):
        moved = {key: value + (index + 1) * 0.1 for key, value in server.global_state.items()}
        payload = server.wire.encode(moved, server.global_state)
        decoded.append(server.wire.decode(payload, server.global_state))
        server.accept(server.admit(client_id, ClientUpdate(client_id, payload, 4, 0.5)))
    clipped = ClientLevelPrivacy.clipped
    with mock.patch.object(ClientLevelPrivacy, "clipped", autospec=True, side_effect=clipped) as clip:
        server.end_round()
    (_, global_state, client_states), _ = clip.call_args
    for state, expected in zip(client_states, decoded):  # the server clips what the wire delivered, decoded
        assert all(torch.equal(state[key], expected[key]) for key in expected)
    privacy = server.aggregator.privacy
    for state in clipped(privacy, global_state, client_states):  # onto the clip norm, which both updates exceed
        assert state_distance(state, global_state) <= privacy.clip_norm * (1 + 1e-6)
    assert min(state_distance(state, global_state) for state in decoded) > privacy.clip_norm


@pytest.mark.parametrize("precision", QUANTIZED)
def test_a_quantized_round_cuts_the_bytes_and_keeps_each_clients_residual(tiny_model_dir, tiny_tokenizer, fast_args,
                                                                         precision):
    exact, initial, exact_updates, exact_record = run_one_round(tiny_model_dir, tiny_tokenizer, fast_args)
    quantized, _, _, record = run_one_round(tiny_model_dir, tiny_tokenizer, fast_args, transfer_dtype=precision,
                                            overwrite_output_dir=True)
    full = state_nbytes(initial)
    blocks = sum(math.ceil(value.numel() / BLOCK_SIZE) for value in initial.values())
    code_bytes = sum(value.numel() if precision == "int8" else math.ceil(value.numel() / 2)
                     for value in initial.values())
    assert all(sent == code_bytes + 4 * blocks for sent in record.bytes_sent.values())
    assert all(sent < full / 3 for sent in record.bytes_sent.values())
    assert record.bytes_received == exact_record.bytes_received  # the broadcast stays float32
    # Each client keeps what its rounding left out, never sent: nonzero, and smaller than its round's change.
    assert set(quantized.wire_residuals) == set(CLIENTS)
    for update in exact_updates:
        residual = quantized.wire_residuals[update.client_id]
        change = {key: update.state[key] - initial[key] for key in initial}
        assert 0 < sum(v.norm() ** 2 for v in residual.values()) < sum(v.norm() ** 2 for v in change.values()) / 4
