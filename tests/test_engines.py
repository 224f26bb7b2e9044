"""FedProx and SCAFFOLD act the same whichever engine takes the optimizer step: on CPU, an engine that steps inside
`backward` as accelerate's DeepSpeed wrapper does, against the plain Trainer; and a client never trains an adapter
it cannot send exactly."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOTrainer

from conftest import length_reward
from trl_federated import FederatedRunner
from trl_federated.adapters import get_adapter_state, with_federated_adapter
from trl_federated.aggregation import FedAvgAggregator, ScaffoldAggregator
from trl_federated.aggregation.scaffold import CLIENT_CONTROL, CONTROL_DELTA, SERVER_CONTROL
from trl_federated.local.client import local_training_args, train_local_round
from trl_federated.runtime.master_weights import MasterWeightsError

PROMPTS = Dataset.from_dict({"prompt": [f"Question {i}: add {i} and {i + 3}." for i in range(16)]})


class _Inert:
    """An optimizer or scheduler whose `step()` does nothing; everything else is the wrapped object's."""

    def __init__(self, wrapped):
        self.wrapped = wrapped

    def step(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


class StepsInBackward(GRPOTrainer):
    """An engine like accelerate's `DeepSpeedEngineWrapper`, on CPU: `backward` of an optimizer step's last
    micro-batch runs the whole step (clip, optimizer step, scheduler step, zero_grad), so the Trainer's later
    `optimizer.step()` and `lr_scheduler.step()` are no-ops and a gradient edited before them comes too late."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not isinstance(self.optimizer, _Inert):  # the first micro-batch: the optimizer and scheduler exist now
            self.engine = self.optimizer, self.lr_scheduler
            self.optimizer, self.lr_scheduler = _Inert(self.optimizer), _Inert(self.lr_scheduler)
            self.accelerator.backward = self.engine_backward
        return super().training_step(model, inputs, num_items_in_batch)

    def engine_backward(self, loss, **kwargs):
        loss.backward()
        if self.accelerator.sync_gradients:
            optimizer, scheduler = self.engine
            if self.args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def client_round(model_dir, tokenizer, fast_args, trainer_class=GRPOTrainer, extras=None, **overrides):
    """One client round from the seeded initial adapter: the update the client sends and its starting adapter."""
    values = dict(local_steps=3, gradient_accumulation_steps=2, max_grad_norm=1.0, lr_scheduler_type="linear")
    args = fast_args(**{**values, **overrides})
    model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(model_dir), args.seed)
    start = get_adapter_state(model)
    aggregator = ScaffoldAggregator if args.aggregation == "scaffold" else FedAvgAggregator
    update = train_local_round(
        model, start, "client_0", PROMPTS, local_training_args(args, 0, 0, 1, "client_0"), length_reward,
        tokenizer, extras=extras, aggregator_class=aggregator, trainer_class=trainer_class,
    )
    return update, start


def controls(start, scale=0.5):
    generator = torch.Generator().manual_seed(1)
    return {
        name: {key: scale * torch.randn(value.shape, generator=generator) for key, value in start.items()}
        for name in (SERVER_CONTROL, CLIENT_CONTROL)
    }


def max_difference(state, other):
    return max((state[key] - other[key]).abs().max().item() for key in state)


METHODS = {
    "fedprox": dict(aggregation="fedprox", fedprox_mu=1.0),
    "scaffold-decoupled": dict(aggregation="scaffold", scaffold_correction="decoupled"),
    "scaffold-gradient": dict(aggregation="scaffold", scaffold_correction="gradient"),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_an_engine_that_steps_inside_backward_trains_like_the_plain_trainer(
    tiny_model_dir, tiny_tokenizer, fast_args, method
):
    """3 local steps of 2 micro-batches, a linear schedule, clipping: the client's adapter and Δc_i are the plain
    Trainer's, and FedProx's and SCAFFOLD's corrections moved them (FedAvg's differ)."""
    settings = METHODS[method]
    _, start = client_round(tiny_model_dir, tiny_tokenizer, fast_args)
    extras = controls(start) if settings["aggregation"] == "scaffold" else None
    plain, _ = client_round(tiny_model_dir, tiny_tokenizer, fast_args, extras=extras, **settings)
    engine, _ = client_round(tiny_model_dir, tiny_tokenizer, fast_args, StepsInBackward, extras, **settings)
    fedavg, _ = client_round(tiny_model_dir, tiny_tokenizer, fast_args, StepsInBackward)

    assert max_difference(engine.state, plain.state) < 1e-6
    assert max_difference(engine.state, fedavg.state) > 1e-3
    assert max_difference(plain.state, start) > 1e-3
    if extras is not None:
        assert max_difference(engine.extras[CONTROL_DELTA], plain.extras[CONTROL_DELTA]) < 1e-4
        # Δc_i is a mean step direction, about 1 per coordinate: the comparison above is a tight one
        assert max(value.abs().max().item() for value in plain.extras[CONTROL_DELTA].values()) > 0.1


@pytest.mark.parametrize("trainer_class", [GRPOTrainer, StepsInBackward])
def test_a_loss_term_adds_its_gradient_once_per_optimizer_step(tiny_model_dir, tiny_tokenizer, fast_args,
                                                                trainer_class):
    """SGD, one step of 2 micro-batches, no clipping: SCAFFOLD's gradient correction moves θ by exactly −η (c − c_i)
    more than FedAvg's step, in both engines (no factor of the micro-batches or of the engine)."""
    settings = dict(optim="sgd", learning_rate=0.1, local_steps=1, reward_window=1, max_grad_norm=0.0,
                    lr_scheduler_type="constant")
    fedavg, start = client_round(tiny_model_dir, tiny_tokenizer, fast_args, trainer_class, **settings)
    extras = controls(start)
    scaffold, _ = client_round(
        tiny_model_dir, tiny_tokenizer, fast_args, trainer_class, extras, aggregation="scaffold",
        scaffold_correction="gradient", **settings,
    )
    for key, value in fedavg.state.items():
        correction = extras[SERVER_CONTROL][key] - extras[CLIENT_CONTROL][key]
        torch.testing.assert_close(scaffold.state[key] - value, -0.1 * correction, atol=1e-6, rtol=0)


def bfloat16_adapter(model_dir, seed=0):
    model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(model_dir), seed)
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(torch.bfloat16)
    return model


def test_an_adapter_without_float32_master_weights_is_refused_before_training(
    tiny_model_dir, tiny_tokenizer, fast_args
):
    """LoRA in bfloat16 with no engine that keeps float32 values for it: its updates could not be exact. The runner
    refuses it when built; a client round refuses it when training begins, before any step."""
    args = fast_args()
    with pytest.raises(MasterWeightsError, match="bfloat16"):
        FederatedRunner(bfloat16_adapter(tiny_model_dir), length_reward, args, [PROMPTS] * 2,
                        processing_class=tiny_tokenizer)

    model = bfloat16_adapter(tiny_model_dir)
    start = get_adapter_state(model)
    with pytest.raises(MasterWeightsError, match="no float32 copy"):
        train_local_round(model, start, "client_0", PROMPTS, local_training_args(args, 0, 0, 1, "client_0"),
                          length_reward, tiny_tokenizer)
    assert max_difference(get_adapter_state(model), start) == 0.0


def test_the_saved_adapter_holds_the_float32_global_state_of_a_model_an_engine_cast(tmp_path, tiny_model_dir):
    """After a bf16 DeepSpeed round the shared model's LoRA is bf16; the adapter folder the run leaves (and pushes)
    must still hold the exact float32 global adapter, not the module's rounded copy."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from trl_federated.adapters import save_adapter

    model = bfloat16_adapter(tiny_model_dir)
    state = {key: torch.randn_like(value, dtype=torch.float32) for key, value in get_adapter_state(model).items()}
    save_adapter(model, state, tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert set(saved) == set(state)
    assert all(saved[key].dtype == torch.float32 and torch.equal(saved[key], state[key]) for key in state)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "adapter")
    assert max_difference(get_adapter_state(loaded), state) == 0.0
