"""The ClientApp: one data owner's local GRPO round on its own data, from the global adapter."""

import tempfile
from pathlib import Path

from datasets import Dataset, load_dataset, load_from_disk
from flwr.app import Context
from trl import ModelConfig

from trl_federated import FedGRPOConfig
from trl_federated.adapters import with_federated_adapter
from trl_federated.cli import BenchmarkArguments, load_benchmark, load_model, lora_config
from trl_federated.data import partition_clients
from trl_federated.flower import ClientSite, load_once, make_client_app

from .task import read_config, rewards


def site_dataset(node_config, args: FedGRPOConfig, data_args: BenchmarkArguments) -> Dataset:
    """The data owner's training set: the SuperNode's `data-path` (a `save_to_disk` folder or a JSON Lines file
    with a `prompt` column and the columns the rewards read, `answer` for accuracy), or, to try the app out
    without data of one's own, this node's Dirichlet share of the benchmark (the split the in-process runner makes
    for `num_clients` clients)."""
    if "data-path" in node_config:
        path = Path(node_config["data-path"])
        return load_from_disk(str(path)) if path.is_dir() else load_dataset("json", data_files=str(path), split="train")
    train, _ = load_benchmark(data_args)
    shares, index = partition_clients(train, args), int(node_config["partition-id"])
    if not 0 <= index < len(shares):
        raise ValueError(f"partition-id={index} is outside the federation's num_clients={len(shares)} clients.")
    return shares[index]


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
            f"`trainer_class` ({data_args.trainer_class!r}) is not read by this app: pass the class to "
            "`make_client_app(load_site, trainer_class=...)` in client_app.py."
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
    )


app = make_client_app(load_site)
