"""The loopback test's Flower app: the settings of `FederatedRunner` in tests/test_flower.py, over the network.

Each SuperNode's `--node-config` names its client (`partition-id`) and its own data (`data-dir`, a dataset saved
with `save_to_disk`); the run config names the tiny model, the server's output folder and the aggregation.
"""

from datasets import load_from_disk
from flwr.app import Context
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_federated import FedGRPOConfig
from trl_federated.flower import ClientSite, FederatedStrategy, make_client_app, make_server_app

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
        transfer_dtype=run_config.get("transfer-dtype", "float32"), **SETTINGS,
    )


def load_site(context: Context) -> ClientSite:
    model_dir = context.run_config["model-dir"]
    data_dir = context.node_config["data-dir"]
    return ClientSite(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        reward_funcs=length_reward,
        train_dataset=load_from_disk(data_dir),
        args=federation_args(f"{data_dir}-scratch", context.run_config),
    )


def build_strategy(context: Context) -> FederatedStrategy:
    return FederatedStrategy(
        AutoModelForCausalLM.from_pretrained(context.run_config["model-dir"]),
        federation_args(context.run_config["output-dir"], context.run_config),
        reward_funcs=length_reward,
    )


client_app = make_client_app(load_site)
server_app = make_server_app(build_strategy)
