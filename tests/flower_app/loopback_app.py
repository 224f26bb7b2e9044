"""The loopback test's Flower app: the settings of `FederatedRunner` in tests/test_flower.py, over the network.

Each SuperNode's `--node-config` names its client (`partition-id`) and its own data (`data-dir`, a dataset saved
with `save_to_disk`; on the Simulation Engine, whose node config has no `data-dir`, the run config's
`data-root`/client_<partition-id>), and optionally `eval-rows`, how many of its first rows it also holds out to
evaluate the global adapter on when asked; the run config names the tiny model, the server's output folder, the
aggregation and optionally `fraction-train` and `fraction-evaluate`. Each process loads the model once
(`load_once`), and appends its pid to the run config's `loads-file`, if any, when it does.
"""

import os
from pathlib import Path

from datasets import load_from_disk
from flwr.app import Context
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_federated import FedGRPOConfig
from trl_federated.adapters import with_federated_adapter
from trl_federated.flower import ClientSite, FederatedStrategy, load_once, make_client_app, make_server_app

# tests/conftest.py's FAST_GRPO with 2 local steps: the test's in-process runner uses the same values.
SETTINGS = dict(
    bf16=False, use_cpu=True, gradient_checkpointing=False, report_to="none", per_device_train_batch_size=4,
    num_generations=4, max_completion_length=12, learning_rate=1e-2, logging_steps=1,
    local_steps=2, reward_window=2, seed=0, num_clients=2, node_wait_timeout=120,
)


def length_reward(completions, **kwargs):
    """tests/conftest.py's reward: it varies on the random text of the untrained tiny model."""
    return [len(completion) / 64 for completion in completions]


def federation_args(output_dir: str, run_config) -> FedGRPOConfig:
    return FedGRPOConfig(
        output_dir=output_dir, aggregation=run_config["aggregation"], num_rounds=int(run_config["num-rounds"]),
        lora_aggregation=run_config.get("lora-aggregation", "separate"),
        transfer_dtype=run_config.get("transfer-dtype", "float32"),
        fraction_train=float(run_config.get("fraction-train", 1.0)),
        fraction_evaluate=float(run_config.get("fraction-evaluate", 0.0)),
        rpg_signal=run_config.get("rpg-signal", "reward-window"),
        rpg_signal_items=int(run_config.get("rpg-signal-items", 160)), **SETTINGS,
    )


def site_model(model_dir: str, args: FedGRPOConfig, loads_file: str):
    def load():
        if loads_file:
            with open(loads_file, "a", encoding="utf-8") as loads:
                loads.write(f"{os.getpid()}\n")
        model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(model_dir), args.seed)
        return model, AutoTokenizer.from_pretrained(model_dir)

    return load_once((model_dir, args.seed, args.lora_aggregation), load)


def load_site(context: Context) -> ClientSite:
    model_dir = context.run_config["model-dir"]
    data_dir = context.node_config.get("data-dir") or str(
        Path(context.run_config["data-root"]) / f"client_{context.node_config['partition-id']}"
    )
    args = federation_args(f"{data_dir}-scratch", context.run_config)
    model, tokenizer = site_model(model_dir, args, context.run_config.get("loads-file", ""))
    train_dataset = load_from_disk(data_dir)
    eval_rows = context.node_config.get("eval-rows")
    return ClientSite(
        model=model,
        processing_class=tokenizer,
        reward_funcs=length_reward,
        train_dataset=train_dataset,
        args=args,
        eval_dataset=train_dataset.select(range(eval_rows)) if eval_rows else None,
    )


def build_strategy(context: Context) -> FederatedStrategy:
    return FederatedStrategy(
        AutoModelForCausalLM.from_pretrained(context.run_config["model-dir"]),
        federation_args(context.run_config["output-dir"], context.run_config),
        reward_funcs=length_reward,
    )


client_app = make_client_app(load_site)
server_app = make_server_app(build_strategy)
