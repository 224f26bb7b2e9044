"""The server step designs (trl_federated/aggregation/server_optim/), each against its equations by hand, and the
step's diagnostics."""

import math

import pytest
import torch

from test_aggregation import rpg
from trl_federated.aggregation import (
    ClientUpdate,
    FedAvgAggregator,
    ServerAdam,
    ServerFedAdam,
    ServerNesterov,
    ServerNormMatchedAdam,
    ServerSGD,
    aggregator_from_config,
)
from trl_federated.aggregation.blocks import BLOCK_BYTES, blocks
from trl_federated.config import FedGRPOConfig
from trl_federated.core.round_record import RoundRecord


def test_fedadam_derives_tau_from_each_tensors_first_delta_and_steps_by_hand():
    optimizer = ServerFedAdam(learning_rate=1.0, beta1=0.9, beta2=0.99)
    params = {"a": torch.tensor([1.0, 1.0]), "b": torch.zeros(2)}
    first = {"a": torch.tensor([0.3, -0.4]), "b": torch.zeros(2)}  # b: no change yet, so no τ and no step
    out = optimizer.step(params, first)
    tau = math.sqrt((0.3**2 + 0.4**2) / 2)
    assert optimizer.tau == pytest.approx({"a": tau}) and "b" not in optimizer.m
    v = 0.99 * tau**2 + 0.01 * torch.tensor([0.09, 0.16])
    m_hat = first["a"]  # m = 0.1 Δ, corrected by 1 − 0.9
    torch.testing.assert_close(out["a"], params["a"] + m_hat * 2 * tau / (v.sqrt() + tau))
    torch.testing.assert_close(out["b"], params["b"])

    second = {"a": torch.tensor([0.1, 0.0]), "b": torch.tensor([0.02, -0.02])}
    out2 = optimizer.step(out, second)
    m = 0.9 * 0.1 * first["a"] + 0.1 * second["a"]
    v = 0.99 * v + 0.01 * second["a"] ** 2
    torch.testing.assert_close(out2["a"], out["a"] + (m / (1 - 0.9**2)) * 2 * tau / (v.sqrt() + tau))
    # b's first non-zero Δ sets its τ in step 2; its m is corrected by step 2's 1 − β1², as Adam's
    tau_b = 0.02
    v_b = 0.99 * tau_b**2 + 0.01 * second["b"] ** 2
    torch.testing.assert_close(out2["b"], (0.1 * second["b"] / (1 - 0.9**2)) * 2 * tau_b / (v_b.sqrt() + tau_b))


def test_fedadam_first_step_is_near_fedavgs_where_delta_is_typical():
    torch.manual_seed(0)
    delta = {"w": torch.randn(10_000) * 1e-4}
    step = ServerFedAdam().step({"w": torch.zeros(10_000)}, delta)["w"]
    ratio = torch.linalg.vector_norm(step) / torch.linalg.vector_norm(delta["w"])
    assert 0.8 < ratio < 1.05  # the paper's literal Adam: α √d / ‖Δ‖, whatever Δ's scale
    cosine = torch.dot(step, delta["w"]) / (torch.linalg.vector_norm(step) * torch.linalg.vector_norm(delta["w"]))
    assert cosine > 0.97


def test_fedadam_explicit_epsilon_fixes_tau():
    optimizer = ServerFedAdam(learning_rate=0.5, epsilon=0.1)
    out = optimizer.step({"w": torch.zeros(1)}, {"w": torch.tensor([0.2])})
    v = 0.99 * 0.01 + 0.01 * 0.04
    torch.testing.assert_close(out["w"], torch.tensor([0.2 * 2 * 0.5 * 0.1 / (math.sqrt(v) + 0.1)]))


def test_norm_matched_adam_takes_adams_direction_at_each_tensors_delta_norm():
    optimizer = ServerNormMatchedAdam(learning_rate=1.0)
    params = {"a": torch.tensor([1.0, 1.0, 1.0]), "b": torch.tensor([0.0, 0.0])}
    delta = {"a": torch.tensor([0.3, -0.1, 0.0]), "b": torch.tensor([1e-3, 2e-3])}
    out = optimizer.step(params, delta)
    # Bias-corrected Adam's first direction is sign(Δ) (0 where Δ is 0), scaled to ‖Δ_T‖ per tensor
    sign_a = torch.tensor([1.0, -1.0, 0.0])
    torch.testing.assert_close(out["a"], params["a"] + sign_a / math.sqrt(2) * math.hypot(0.3, 0.1), rtol=1e-6,
                               atol=1e-7)
    torch.testing.assert_close(out["b"], torch.ones(2) / math.sqrt(2) * math.hypot(1e-3, 2e-3), rtol=1e-5, atol=1e-9)
    # A zero Δ moves nothing, whatever the momentum
    out2 = optimizer.step(out, {"a": torch.zeros(3), "b": torch.zeros(2)})
    torch.testing.assert_close(out2["a"], out["a"]) and torch.testing.assert_close(out2["b"], out["b"])


def test_norm_matched_adam_second_step_follows_the_bias_corrected_moments():
    optimizer = ServerNormMatchedAdam(learning_rate=0.5)
    params, d1, d2 = torch.zeros(2), torch.tensor([0.4, -0.2]), torch.tensor([-0.1, 0.3])
    out = optimizer.step({"w": params}, {"w": d1})["w"]
    out2 = optimizer.step({"w": out}, {"w": d2})["w"]
    m_hat = (0.9 * 0.1 * d1 + 0.1 * d2) / (1 - 0.81)
    v_hat = (0.99 * 0.01 * d1**2 + 0.01 * d2**2) / (1 - 0.99**2)
    direction = m_hat / (v_hat.sqrt() + 1e-8)
    expected = out + 0.5 * torch.linalg.vector_norm(d2) * direction / torch.linalg.vector_norm(direction)
    torch.testing.assert_close(out2, expected)


def test_nesterov_matches_the_outer_momentum_by_hand():
    optimizer = ServerNesterov(learning_rate=0.7, momentum=0.9)
    d1, d2 = torch.tensor([0.2, -0.1]), torch.tensor([0.1, 0.1])
    out = optimizer.step({"w": torch.zeros(2)}, {"w": d1})["w"]
    torch.testing.assert_close(out, 0.7 * (d1 + 0.9 * d1))
    out2 = optimizer.step({"w": out}, {"w": d2})["w"]
    m = 0.9 * d1 + d2
    torch.testing.assert_close(out2, out + 0.7 * (d2 + 0.9 * m))
    restored = ServerNesterov()
    restored.load_state_dict(optimizer.state_dict())
    torch.testing.assert_close(restored.m["w"], m)


@pytest.mark.parametrize("optimizer_class", [ServerFedAdam, ServerNormMatchedAdam, ServerNesterov])
def test_state_round_trip_continues_identically(optimizer_class):
    a, b = optimizer_class(), optimizer_class()
    params = a.step({"w": torch.tensor([0.3, -0.1])}, {"w": torch.tensor([0.2, 0.1])})
    b.load_state_dict(a.state_dict())
    delta = {"w": torch.tensor([-0.3, 0.4])}
    assert torch.equal(a.step(params, delta)["w"], b.step(params, delta)["w"])


@pytest.mark.parametrize(("name", "optimizer_class", "rate"), [
    ("adam", ServerAdam, 0.5 * 5 * 2e-4), ("sgd", ServerSGD, 1.0), ("fedadam", ServerFedAdam, 1.0),
    ("adam-norm", ServerNormMatchedAdam, 1.0), ("nesterov", ServerNesterov, 0.7),
])
def test_each_server_optimizer_from_config_with_its_derived_rate(tmp_path, caplog, name, optimizer_class, rate):
    args = FedGRPOConfig(output_dir=str(tmp_path), use_cpu=True, num_clients=2, local_steps=5, learning_rate=2e-4,
                         server_optimizer=name, report_to="none")
    with caplog.at_level("INFO", logger="trl_federated.aggregation"):
        optimizer = aggregator_from_config(args).server_optimizer
    assert type(optimizer) is optimizer_class and optimizer.learning_rate == pytest.approx(rate)
    # every derived value is said when the run starts
    assert f"server optimizer {name!r} (set): learning rate {args.server_learning_rate:g} (derived)" in caplog.text
    if name in ("adam", "adam-norm"):
        assert args.server_epsilon == 1e-8 and optimizer.epsilon == 1e-8  # the paper's ε
        assert "ε 1e-08 (derived)." in caplog.text
    if name == "fedadam":
        assert args.server_epsilon is None and optimizer.epsilon is None  # τ from the first Δ
        assert "ε per tensor from its first Δ." in caplog.text
    if name == "nesterov":
        assert optimizer.momentum == args.server_beta1


def test_every_server_optimizer_choice_has_its_class():
    from trl_federated.aggregation import ServerOptimizer
    from trl_federated.choices import SERVER_OPTIMIZERS

    assert all(issubclass(cls, ServerOptimizer) for cls in SERVER_OPTIMIZERS.values())  # the names, with their classes
    assert list(SERVER_OPTIMIZERS)[:5] == ["adam", "sgd", "fedadam", "adam-norm", "nesterov"]


def test_step_diagnostics_cosines_and_lora_factor_norms():
    key_a, key_b = "layers.0.q_proj.lora_A.weight", "layers.0.q_proj.lora_B.weight"
    global_state = {key_a: torch.zeros(4), key_b: torch.zeros(4)}
    client = {key_a: torch.tensor([1.0, 0.0, 0.0, 0.0]), key_b: torch.tensor([0.0, 2.0, 0.0, 0.0])}
    aggregator = FedAvgAggregator(ServerNesterov(learning_rate=1.0, momentum=0.5))
    new = aggregator.aggregate(global_state, [ClientUpdate("c", client, 1, 0.0)], 0)
    step = aggregator.last_step
    # s = 1.5 Δ: cos(s, Δ) = 1, no previous step, ‖s_A‖ = 1.5, ‖s_B‖ = 3
    assert step.step_delta_cosine == pytest.approx(1.0) and step.step_previous_cosine is None
    assert (step.step_norm_a, step.step_norm_b) == pytest.approx((1.5, 3.0))
    # Round 2: the clients turn back to θ^0 (Δ = −θ^1); the momentum 0.5 m + Δ partly cancels
    back = {key: torch.zeros(4) for key in global_state}
    aggregator.aggregate(new, [ClientUpdate("c", back, 1, 0.0)], 1)
    delta = -torch.cat([new[key_a], new[key_b]])
    m = 0.5 * torch.cat([client[key_a], client[key_b]]) + delta
    s2, s1 = delta + 0.5 * m, 1.5 * torch.cat([client[key_a], client[key_b]])
    expected = torch.dot(s2, s1) / (s2.norm() * s1.norm())
    assert aggregator.last_step.step_previous_cosine == pytest.approx(expected.item(), rel=1e-5)
    record = RoundRecord.from_aggregation(1, aggregator, [ClientUpdate("c", back, 1, 0.0)], {}, {}, [0])
    assert record.server_step_momentum_cosine == pytest.approx(expected.item(), rel=1e-5)
    assert record.server_step_cosine == pytest.approx(aggregator.last_step.step_delta_cosine)


def test_server_adam_matches_hand_computation_over_two_steps():
    adam = ServerAdam(learning_rate=0.1, beta1=0.9, beta2=0.99, epsilon=1e-8)
    params = {"w": torch.tensor([1.0, 1.0])}
    delta1 = {"w": torch.tensor([0.2, -0.4])}
    out1 = adam.step(params, delta1)
    # m = 0.1 Δ, v = 0.01 Δ², update = m / (sqrt(v) + eps) = sign(Δ) (no bias correction)
    torch.testing.assert_close(adam.m["w"], torch.tensor([0.02, -0.04]))
    torch.testing.assert_close(adam.v["w"], torch.tensor([0.0004, 0.0016]))
    torch.testing.assert_close(out1["w"], torch.tensor([1.1, 0.9]))

    delta2 = {"w": torch.tensor([0.1, 0.0])}
    out2 = adam.step(out1, delta2)
    m = torch.tensor([0.9 * 0.02 + 0.1 * 0.1, 0.9 * -0.04])
    v = torch.tensor([0.99 * 0.0004 + 0.01 * 0.01, 0.99 * 0.0016])
    torch.testing.assert_close(adam.m["w"], m)
    torch.testing.assert_close(adam.v["w"], v)
    torch.testing.assert_close(out2["w"], torch.tensor([1.1, 0.9]) + 0.1 * m / (v.sqrt() + 1e-8))


def test_server_adam_bias_correction_option():
    adam = ServerAdam(learning_rate=0.1, bias_correction=True)
    out = adam.step({"w": torch.tensor([0.0])}, {"w": torch.tensor([0.5])})
    # m̂ = Δ, v̂ = Δ² after one step
    torch.testing.assert_close(out["w"], torch.tensor([0.1 * 0.5 / (0.5 + 1e-8)]))


def test_server_adam_state_round_trip_continues_identically():
    a, b = ServerAdam(learning_rate=0.05), ServerAdam(learning_rate=0.05)
    params = {"w": torch.tensor([0.3, -0.1])}
    params = a.step(params, {"w": torch.tensor([0.2, 0.1])})
    b.load_state_dict(a.state_dict())
    delta = {"w": torch.tensor([-0.3, 0.4])}
    assert torch.equal(a.step(params, delta)["w"], b.step(params, delta)["w"])


def test_blocked_server_step_matches_the_equations_on_a_multi_block_adapter():
    """RPG + Adam over an adapter of several cache-sized blocks equals Eqs. model_diff, momentum, model_update
    computed tensor by tensor."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(300, 1000), (1000, 300), (64, 2000), (2000, 64), (2, 3), (600, 600)]

    def adapter():
        return {f"t{i}": torch.randn(*shape, generator=generator) for i, shape in enumerate(shapes)}

    theta = adapter()
    assert len(list(blocks(theta))) > 2 and sum(t.numel() * 4 for t in theta.values()) > 2 * BLOCK_BYTES
    aggregator = rpg(server_optimizer=ServerAdam(learning_rate=0.01, beta1=0.9, beta2=0.99, epsilon=1e-8))
    m = {key: torch.zeros_like(value) for key, value in theta.items()}
    v = {key: torch.zeros_like(value) for key, value in theta.items()}
    for round_idx, rewards in enumerate([(0.2, 0.5, 0.4), (0.6, 0.45, 0.5)]):
        # Clients that moved away from θ (Δ bounded away from 0, where m / √v is ill-conditioned).
        moves = [adapter() for _ in rewards]
        updates = [
            ClientUpdate(f"c{i}", {key: theta[key] + 1 + move[key].abs() for key in theta}, 1, reward)
            for i, (move, reward) in enumerate(zip(moves, rewards))
        ]
        new = aggregator.aggregate(theta, updates, round_idx)
        weights = [aggregator.last_weights[update.client_id] for update in updates]
        for key in theta:
            delta = sum(w * (update.state[key] - theta[key]) for w, update in zip(weights, updates))
            m[key] = 0.9 * m[key] + 0.1 * delta
            v[key] = 0.99 * v[key] + 0.01 * delta**2
            torch.testing.assert_close(aggregator.server_optimizer.m[key], m[key])
            torch.testing.assert_close(aggregator.server_optimizer.v[key], v[key])
            torch.testing.assert_close(new[key], theta[key] + 0.01 * m[key] / (v[key].sqrt() + 1e-8))
        assert list(new) == list(theta)
        theta = new
    assert aggregator.server_optimizer.num_steps == 2


def test_server_step_geometry_over_blocks():
    """`last_step`: ‖Δ‖, the step's size and each client's update norm and cosine with Δ, accumulated over blocks;
    FedAvg's step is Δ (ratio 1), server Adam's first step is α per coordinate whatever Δ."""
    count, e = BLOCK_BYTES // 4, 2.0**-10  # a block's worth of float32 values per tensor; a step exact in float32
    global_state = {"a": torch.zeros(count), "b": torch.ones(count)}
    up = {"a": torch.full((count,), e), "b": torch.full((count,), 1.0 + e)}  # moves every coordinate by +e
    back = {"a": torch.full((count,), -e), "b": torch.ones(count)}  # moves only "a", by −e
    updates = [ClientUpdate("up", up, 3, 0.0), ClientUpdate("back", back, 1, 0.0)]
    assert len(list(blocks(global_state))) == 2
    aggregator = FedAvgAggregator(ServerSGD(1.0))
    aggregator.aggregate(global_state, updates, 0)
    step = aggregator.last_step
    # Δ = 3/4 up + 1/4 back: e/2 on "a", 3e/4 on "b"
    delta_norm = math.sqrt(count) * e * math.sqrt(0.5**2 + 0.75**2)
    assert step.delta_norm == pytest.approx(delta_norm, rel=1e-6) and step.ratio == pytest.approx(1.0, rel=1e-6)
    norms = {"up": math.sqrt(2 * count) * e, "back": math.sqrt(count) * e}
    assert step.update_norms == pytest.approx(norms, rel=1e-6)
    assert step.cosines["up"] == pytest.approx(1.25 * count * e * e / (norms["up"] * delta_norm), rel=1e-6)
    assert step.cosines["back"] == pytest.approx(-0.5 * count * e * e / (norms["back"] * delta_norm), rel=1e-6)
    adam = FedAvgAggregator(ServerAdam(learning_rate=1e-2))
    adam.aggregate(global_state, updates, 0)
    assert adam.last_step.step_norm == pytest.approx(1e-2 * math.sqrt(2 * count), rel=1e-4)
