"""The ServerApp: FGRPO's server (RPG weights + server Adam, or the configured aggregation), checkpointed."""

from flwr.app import Context

from trl_federated.flower import ClientRegistry, FederatedStrategy, make_server_app
from trl_federated.models import load_model_and_tokenizer

from .task import lora_config, read_config, rewards


def build_strategy(context: Context) -> FederatedStrategy:
    args, model_args, data_args = read_config(context)
    args.output_dir = context.run_config["output-dir"]
    args.resume_from_checkpoint = True if context.run_config["resume"] else None
    model, _ = load_model_and_tokenizer(model_args.model_name_or_path)
    # The federation's clients by SuperNode public key: without it, nodes declare which client they serve.
    clients_file = context.run_config.get("clients-file", "")
    registry = ClientRegistry.from_file(clients_file) if clients_file else None
    return FederatedStrategy(
        model, args, reward_funcs=rewards(data_args), peft_config=lora_config(model_args), registry=registry
    )


app = make_server_app(build_strategy)
