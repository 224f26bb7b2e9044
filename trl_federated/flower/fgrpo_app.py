"""The ready-to-run Flower app of `trl-federated`: `server_app` (FGRPO's server, or the configured aggregation,
checkpointed) and `client_app` (one data owner's local GRPO round on its own data), both configured by the app's run
config as `trl-federated run` is by its flags (`run_config.federation_arguments`). `examples/flower/pyproject.toml`
names them as its components, and so does the app `trl-federated new-app DIR` writes (`flower.new_app`).

Run config: every flag of `trl-federated run` as the key of its field in kebab-case, and this app's own keys
`resume` (continue from the latest checkpoint in `output-dir`) and `clients-file` (the federation's clients by
SuperNode public key, `identity.ClientRegistry`). A `config` key's YAML base, like `output-dir`, is relative to the
working folder: Flower tells a ClientApp nothing of where it installed the app.

Node config of a SuperNode: `partition-id`, optionally `client-id`, `data-path`, `eval-data-path` and `work-dir`
(`load_site`). A trainer class of one's own takes a ClientApp of one's own:
`make_client_app(trl_federated.flower.fgrpo_app.load_site, trainer_class=...)`.
"""

import tempfile
from pathlib import Path

from datasets import Dataset, load_dataset, load_from_disk
from flwr.app import Context
from trl import ModelConfig

from ..adapters import with_federated_adapter
from ..arguments import BenchmarkArguments
from ..config import FedGRPOConfig
from ..core.checkpoint import prepare_output_dir
from ..data import dirichlet_partition, partition_clients
from ..data.loading import load_benchmark
from ..runtime.models import load_model, lora_config
from ..scoring.rewards import training_rewards
from .apps import ClientSite, load_once, make_client_app, make_server_app
from .identity import ClientRegistry
from .run_config import NUM_PARTITIONS, federation_arguments, run_config_key
from .strategy import FederatedStrategy

# This app's own run-config keys; every other key sets the field of its name (see `run_config`).
APP_KEYS = ("resume", "clients-file")


def read_config(context: Context) -> tuple[FedGRPOConfig, ModelConfig, BenchmarkArguments]:
    """The run config's field keys (pyproject.toml's values, overridden by `--run-config "num-server-rounds=5"`),
    parsed as `trl-federated run` parses its flags. Under the Simulation Engine `num_clients` follows the number of
    simulated SuperNodes (`num-partitions`)."""
    return federation_arguments(
        context.run_config, Path.cwd(), app_keys=APP_KEYS, federation_size=context.node_config.get(NUM_PARTITIONS)
    )


def rewards(data_args: BenchmarkArguments):
    return training_rewards(data_args)


# The ClientApp ---------------------------------------------------------------------------------------------------


def load_rows(path: str) -> Dataset:
    """A `save_to_disk` folder or a JSON Lines file with a `prompt` column and the columns the rewards read (`answer`
    for accuracy)."""
    path = Path(path)
    return load_from_disk(str(path)) if path.is_dir() else load_dataset("json", data_files=str(path), split="train")


def node_share(shares: list[Dataset], node_config) -> Dataset:
    index = int(node_config["partition-id"])
    if not 0 <= index < len(shares):
        raise ValueError(f"partition-id={index} is outside the federation's num_clients={len(shares)} clients.")
    return shares[index]


def site_dataset(node_config, args: FedGRPOConfig, data_args: BenchmarkArguments) -> Dataset:
    """The data owner's training set: the SuperNode's `data-path` (`load_rows`), or, to try the app out without data
    of one's own, this node's Dirichlet share of the benchmark (the split the in-process runner makes for
    `num_clients` clients)."""
    if "data-path" in node_config:
        return load_rows(node_config["data-path"])
    train, _ = load_benchmark(data_args)
    return node_share(partition_clients(train, args), node_config)


def site_eval_dataset(node_config, args: FedGRPOConfig, data_args: BenchmarkArguments) -> Dataset | None:
    """The data owner's held-out rows, which it evaluates the global adapter on when the server asks
    (`fraction_evaluate` > 0): the SuperNode's `eval-data-path` (`load_rows`); without one, a node with its own
    `data-path` has none and declines, and a node trying the app out on the benchmark takes its even share of the
    benchmark's test split (a Dirichlet share of a split that small would leave some clients without rows)."""
    if "eval-data-path" in node_config:
        return load_rows(node_config["eval-data-path"])
    if "data-path" in node_config:
        return None
    _, test = load_benchmark(data_args)
    shares = dirichlet_partition(test, args.num_clients, args.partition_column, float("inf"), seed=args.seed)
    return node_share(shares, node_config)


def site_model(model_args: ModelConfig, args: FedGRPOConfig):
    """(`PeftModel` in the federation's LoRA adapter, tokenizer), loaded once per process (`load_once`): a Simulation
    Engine worker trains message after message, of any client, on one model, as the in-process runner does. The key
    is everything that determines the model: `ModelConfig` (path, revision, dtype, quantization, LoRA), the seed the
    LoRA A matrices are drawn with, `lora_aggregation` (freeze_a freezes A in the model) and the loading arguments
    of `FedGRPOConfig`."""
    key = repr((model_args, args.seed, args.lora_aggregation, args.trust_remote_code, args.model_init_kwargs))

    def load():
        model, tokenizer = load_model(model_args, args)
        return with_federated_adapter(model, args.seed, lora_config(model_args)), tokenizer

    return load_once(key, load)


def load_site(context: Context) -> ClientSite:
    args, model_args, data_args = read_config(context)
    if data_args.trainer_class is not None:
        # The trainer class is fixed when the ClientApp is made, before any config is read.
        raise ValueError(
            f"`trainer_class` ({data_args.trainer_class!r}) is not read by this app: make a ClientApp of your own "
            "with `make_client_app(trl_federated.flower.fgrpo_app.load_site, trainer_class=...)`."
        )
    # A local scratch folder: the server, not the client, saves the federation's adapters and logs.
    args.output_dir = str(context.node_config.get("work-dir", Path(tempfile.gettempdir()) / "fgrpo-client"))
    model, tokenizer = site_model(model_args, args)
    return ClientSite(
        model=model,
        processing_class=tokenizer,
        reward_funcs=rewards(data_args),
        train_dataset=site_dataset(context.node_config, args, data_args),
        args=args,
        eval_dataset=site_eval_dataset(context.node_config, args, data_args) if args.fraction_evaluate > 0 else None,
    )


# The ServerApp ---------------------------------------------------------------------------------------------------


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


client_app = make_client_app(load_site)
server_app = make_server_app(build_strategy)
