"""What the ServerApp and the ClientApps share: the configuration, the model, LoRA and the rewards."""

from pathlib import Path

from flwr.app import Context
from trl import ModelConfig

from trl_federated import FedGRPOConfig
from trl_federated.arguments import BenchmarkArguments
from trl_federated.flower.run_config import NUM_PARTITIONS, federation_arguments
from trl_federated.scoring.rewards import training_rewards

APP_DIR = Path(__file__).resolve().parents[1]
# This app's own run-config keys; every other key sets the field of its name (see `trl_federated.flower.run_config`).
APP_KEYS = ("resume", "clients-file")


def read_config(context: Context) -> tuple[FedGRPOConfig, ModelConfig, BenchmarkArguments]:
    """The run config's field keys (pyproject.toml's values, overridden by `--run-config "num-server-rounds=5"`),
    parsed as `trl-federated run` parses its flags. Under the Simulation Engine `num_clients` follows the number of
    simulated SuperNodes (`num-partitions`)."""
    return federation_arguments(
        context.run_config, APP_DIR, app_keys=APP_KEYS, federation_size=context.node_config.get(NUM_PARTITIONS)
    )


def rewards(data_args: BenchmarkArguments):
    return training_rewards(data_args)
