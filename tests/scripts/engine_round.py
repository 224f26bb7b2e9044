"""Client rounds and a small federation on the tiny model, for tests that run them under an engine (DeepSpeed
ZeRO-2 through `accelerate launch`) and without one.

Usage: python engine_round.py MODEL_DIR OUT_FILE methods|federation [key=value ...]
- methods: one client round of FedProx, SCAFFOLD (decoupled, gradient) and, with `fedavg=true`, FedAvg, each from
  the seeded initial adapter; writes each update's adapter and Δc_i.
- federation: 2 rounds x 2 clients of FedAvg under DeepSpeed; writes, for every client round, the update it sent,
  DeepSpeed's own float32 values (`safe_get_full_fp32_param`) as training begins and ends and the module's
  parameters, and the global adapter after each round.
Completions come from `federated_run.deterministic_rollout`: the result depends on the weights only, not on how an
engine consumes random numbers.
"""

import sys

import torch
from datasets import Dataset
from federated_run import NUM_GENERATIONS, deterministic_rollout, length_reward
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_federated import FederatedRunner, FedGRPOConfig
from trl_federated.adapters import get_adapter_state, with_federated_adapter
from trl_federated.aggregation import FedAvgAggregator, ScaffoldAggregator
from trl_federated.aggregation.scaffold import CLIENT_CONTROL, CONTROL_DELTA, SERVER_CONTROL
from trl_federated.core.callbacks import RoundCallback
from trl_federated.local.client import local_training_args, train_local_round
from trl_federated.runtime.distributed import shut_down
from trl_federated.runtime.master_weights import adapter_parameters

PROMPTS = Dataset.from_dict({"prompt": [f"Question {i}: add {i} and {i + 3}." for i in range(16)]})
METHODS = {
    "fedprox": dict(aggregation="fedprox", fedprox_mu=1.0),
    "scaffold-decoupled": dict(aggregation="scaffold", scaffold_correction="decoupled"),
    "scaffold-gradient": dict(aggregation="scaffold", scaffold_correction="gradient"),
    "fedavg": dict(aggregation="fedavg"),
}


def config(output_dir, overrides, **values):
    values = dict(
        output_dir=output_dir, use_cpu=True, gradient_checkpointing=False, report_to="none", disable_tqdm=True,
        per_device_train_batch_size=4, num_generations=NUM_GENERATIONS, max_completion_length=12, learning_rate=1e-2,
        logging_steps=1, seed=0, bf16=False, **values,
    )
    for override in overrides:
        key, value = override.split("=", 1)
        values[key] = value == "true" if value in ("true", "false") else type(values[key])(value)
    return FedGRPOConfig(**values)


def methods(model_dir, output_dir, overrides):
    tokenizer, results = AutoTokenizer.from_pretrained(model_dir), {}
    names = [name for name in METHODS if name != "fedavg" or "fedavg=true" in overrides]
    overrides = [override for override in overrides if not override.startswith("fedavg=")]
    for name in names:
        args = config(output_dir, overrides, num_rounds=1, local_steps=3, reward_window=3,
                      gradient_accumulation_steps=2, lr_scheduler_type="linear", **METHODS[name])
        model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(model_dir), args.seed)
        start = get_adapter_state(model)
        generator = torch.Generator().manual_seed(1)
        extras = {
            control: {key: 0.5 * torch.randn(value.shape, generator=generator) for key, value in start.items()}
            for control in (SERVER_CONTROL, CLIENT_CONTROL)
        } if args.aggregation == "scaffold" else None
        update = train_local_round(
            model, start, "client_0", PROMPTS, local_training_args(args, 0, 0, 1, "client_0"), length_reward,
            tokenizer, extras=extras, trainer_kwargs={"rollout_func": deterministic_rollout},
            aggregator_class=ScaffoldAggregator if extras else FedAvgAggregator,
        )
        results[name] = {"start": start, "state": update.state, "control_delta": update.extras.get(CONTROL_DELTA)}
    return results


class Recorder(RoundCallback):
    """Per client round: DeepSpeed's float32 values of the adapter as training begins and ends, the module's own
    parameters at the end (while the engine lives), and the update the server received; the global adapter after
    every round."""

    def __init__(self):
        self.runner, self.engine, self.updates, self.global_states = None, [], [], []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.engine.append({"start": fp32_values(model)})

    def on_train_end(self, args, state, control, model=None, **kwargs):
        parameters = adapter_parameters(model)
        self.engine[-1]["fp32"] = fp32_values(model)
        self.engine[-1]["module"] = {key: param.detach().clone() for key, param in parameters.items()}

    def on_client_end(self, args, round_idx, update, **kwargs):
        self.updates.append({key: value.clone() for key, value in update.state.items()})

    def on_round_end(self, args, record, **kwargs):
        self.global_states.append({key: value.clone() for key, value in self.runner.global_state.items()})


def fp32_values(model):
    from deepspeed.utils import safe_get_full_fp32_param

    return {key: safe_get_full_fp32_param(param).clone() for key, param in adapter_parameters(model).items()}


def federation(model_dir, output_dir, overrides):
    args = config(output_dir, overrides, num_rounds=2, local_steps=2, reward_window=2, aggregation="fedavg",
                  server_optimizer="sgd", server_learning_rate=1.0)
    clients = [PROMPTS.select(range(0, 8)), PROMPTS.select(range(8, 16))]
    recorder = Recorder()
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(model_dir), length_reward, args, clients,
        processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[recorder],
        trainer_kwargs={"rollout_func": deterministic_rollout},
    )
    recorder.runner = runner
    initial = {key: value.clone() for key, value in runner.global_state.items()}
    history = runner.run()
    return {
        "rounds": len(history), "initial": initial, "global_states": recorder.global_states,
        "updates": recorder.updates, "engine": recorder.engine,
    }


def main(model_dir, out_file, mode, *overrides):
    torch.set_num_threads(1)
    results = (methods if mode == "methods" else federation)(model_dir, out_file + ".run", overrides)
    torch.save(results, out_file)
    shut_down()


if __name__ == "__main__":
    main(*sys.argv[1:])
