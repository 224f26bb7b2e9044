"""SCAFFOLD (trl_federated/aggregation/scaffold.py): the server step, the client correction and the control update
by hand, and the client controls across rounds."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import length_reward
from test_variants import PROMPTS
from trl_federated import FederatedRunner, FedGRPOConfig, FedGRPOTrainer
from trl_federated.adapters import default_lora_config
from trl_federated.aggregation import aggregator_from_config


def test_scaffold_server_step_by_hand():
    """θ and c take the same data-volume weights: c = Σ_i p_i c_i, so with every client reporting Σ_i ω_i (c − c_i) = 0
    after every round (partial participation: `test_client_sampling.py`)."""
    from trl_federated import ClientUpdate

    args = FedGRPOConfig(output_dir="unused", use_cpu=True, bf16=False, aggregation="scaffold", num_clients=2)
    aggregator = aggregator_from_config(args)
    global_state = {"w": torch.tensor([0.0, 0.0])}

    def round_of(deltas):
        updates = [
            ClientUpdate("a", {"w": torch.tensor([1.0, 0.0])}, 1, 0.0, extras={"control_delta": {"w": deltas[0]}}),
            ClientUpdate("b", {"w": torch.tensor([0.0, 1.0])}, 3, 0.0, extras={"control_delta": {"w": deltas[1]}}),
        ]
        for update in updates:  # as the server admits them: c_i ← c_i + Δc_i
            aggregator.accept(update)
        return aggregator.aggregate(global_state, updates, 0)

    new = round_of([torch.tensor([0.4, 0.0]), torch.tensor([0.0, -0.8])])
    torch.testing.assert_close(new["w"], torch.tensor([0.25, 0.75]))  # ω = (1/4, 3/4)
    # c = 1/4 c_a + 3/4 c_b
    torch.testing.assert_close(aggregator.control["w"], torch.tensor([0.1, -0.6]))
    round_of([torch.tensor([-0.2, 0.6]), torch.tensor([0.2, 0.4])])
    weights, control = aggregator.last_weights, aggregator.control["w"]
    drift = sum(weights[client] * (control - aggregator.client_controls[client]["w"]) for client in weights)
    torch.testing.assert_close(drift, torch.zeros(2))
    # the checkpointed state carries the sizes; one written before them still loads, and learns them
    restored = aggregator_from_config(args)
    restored.load_state_dict({**aggregator.state_dict(), "client_sizes": {}})
    assert restored.client_sizes == {} and aggregator.state_dict()["client_sizes"] == {"a": 1, "b": 3}
    with pytest.raises(ValueError, match="control_delta"):
        aggregator.aggregate(global_state, [ClientUpdate("a", {"w": torch.zeros(2)}, 1, 0.0)], 1)


@pytest.mark.parametrize("mode", ["decoupled", "gradient"])
def test_scaffold_client_correction_and_control_update_by_hand(tiny_model_dir, tiny_tokenizer, fast_args, mode):
    """Constant learning rate η, K steps: c_i⁺ = c_i − c + (θ^t − θ_i)/(Kη)."""
    from peft import get_peft_model_state_dict

    from trl_federated.aggregation.scaffold import ScaffoldCorrection

    lr, steps = 1e-2, 3
    args = fast_args(max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trainer = FedGRPOTrainer(
        model=model, reward_funcs=length_reward, args=args, train_dataset=PROMPTS, processing_class=tiny_tokenizer,
        peft_config=default_lora_config(),
    )
    adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model).items()}
    generator = torch.Generator().manual_seed(0)
    c = {k: 1e-3 * torch.randn(v.shape, generator=generator) for k, v in adapter.items()}
    c_i = {k: 1e-3 * torch.randn(v.shape, generator=generator) for k, v in adapter.items()}
    scaffold = ScaffoldCorrection(c, c_i, mode)
    trainer.add_callback(scaffold)
    trainer.train()
    final = {k: v.detach() for k, v in get_peft_model_state_dict(trainer.model).items()}

    # The correction of each step: `test_engines.test_a_loss_term_adds_its_gradient_once_per_optimizer_step`.
    assert scaffold.learning_rate_sum == pytest.approx(steps * lr)
    for key in adapter:
        expected_delta = -c[key] + (adapter[key] - final[key]) / (steps * lr)  # c_i⁺ − c_i
        torch.testing.assert_close(scaffold.control_delta[key], expected_delta)


def test_scaffold_federated_rounds_keep_client_controls(tmp_path, tiny_model_dir, tiny_tokenizer, fast_args):
    args = fast_args(aggregation="scaffold", server_optimizer="sgd", num_rounds=2, local_steps=2, reward_window=1)
    clients = [PROMPTS.select(range(0, 8)), PROMPTS.select(range(8, 16))]
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args, clients,
        processing_class=tiny_tokenizer,
    )
    runner.run()
    client_controls = runner.aggregator.client_controls
    assert set(client_controls) == {"client_0", "client_1"}
    assert runner.aggregator.client_sizes == {"client_0": 8, "client_1": 8}
    control = runner.aggregator.control
    # c = Σ p_i c_i, p_i ∝ D_i: with equal data, the mean of the clients' c_i
    for key in control:
        mean = (client_controls["client_0"][key] + client_controls["client_1"][key]) / 2
        torch.testing.assert_close(control[key], mean)
    assert any(value.abs().sum() > 0 for value in control.values())
