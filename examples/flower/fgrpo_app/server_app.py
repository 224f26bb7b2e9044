"""The ServerApp: FGRPO's server (RPG weights + server Adam, or the configured aggregation), checkpointed."""

from flwr.app import Context

from trl_federated.checkpoint import prepare_output_dir
from trl_federated.cli import load_model, lora_config
from trl_federated.flower import ClientRegistry, FederatedStrategy, make_server_app

from .task import read_config, rewards


def build_strategy(context: Context) -> FederatedStrategy:
    args, model_args, data_args = read_config(context)
    args.resume_from_checkpoint = True if context.run_config["resume"] else None
    try:  # before minutes of model loading
        prepare_output_dir(args)
    except FileExistsError as error:
        raise FileExistsError(
            f"{error} As run config: --run-config \"resume=true\" continues that run, \"overwrite-output-dir=true\" "
            "deletes it, \"output-dir='<another folder>'\" keeps it."
        ) from None
    model, _ = load_model(model_args, args)
    # The federation's clients by SuperNode public key: without it, nodes declare which client they serve.
    clients_file = context.run_config.get("clients-file", "")
    registry = ClientRegistry.from_file(clients_file) if clients_file else None
    return FederatedStrategy(
        model, args, reward_funcs=rewards(data_args), peft_config=lora_config(model_args), registry=registry
    )


app = make_server_app(build_strategy)
