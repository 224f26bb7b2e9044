"""The ServerApp: FGRPO's server (RPG weights + server Adam, or the configured aggregation), checkpointed."""

from flwr.app import Context

from trl_federated.core.checkpoint import prepare_output_dir
from trl_federated.flower import ClientRegistry, FederatedStrategy, make_server_app
from trl_federated.flower.run_config import run_config_key
from trl_federated.runtime.models import load_model, lora_config

from .task import read_config, rewards


def run_config_setting(name: str, value: str) -> str:
    """How to set a field from the `flwr run` command line (`resume_from_checkpoint` is this app's `resume`)."""
    key = "resume" if name == "resume_from_checkpoint" else run_config_key(name)
    return f"--run-config \"{key}={value}\""


def build_strategy(context: Context) -> FederatedStrategy:
    args, model_args, data_args = read_config(context)
    args.resume_from_checkpoint = True if context.run_config["resume"] else None
    prepare_output_dir(args, setting=run_config_setting)  # a taken output-dir fails here, before the model loads
    model, _ = load_model(model_args, args)
    # The federation's clients by SuperNode public key: without it, nodes declare which client they serve.
    clients_file = context.run_config.get("clients-file", "")
    registry = ClientRegistry.from_file(clients_file) if clients_file else None
    return FederatedStrategy(
        model, args, reward_funcs=rewards(data_args), peft_config=lora_config(model_args), registry=registry
    )


app = make_server_app(build_strategy)
