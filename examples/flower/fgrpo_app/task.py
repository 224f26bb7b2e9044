"""What the ServerApp and the ClientApps share: the configuration file, the model, LoRA and the rewards."""

from pathlib import Path

from flwr.app import Context
from trl import ModelConfig, TrlParser, get_peft_config

from trl_federated import FedGRPOConfig
from trl_federated.cli import BenchmarkArguments, config_class, reward_functions
from trl_federated.runner import default_lora_config

APP_DIR = Path(__file__).resolve().parents[1]


def read_config(context: Context) -> tuple[FedGRPOConfig, ModelConfig, BenchmarkArguments]:
    """The run config's `config` YAML (relative to the app folder, or absolute), parsed as `trl-federated run`
    parses it."""
    argv = ["--config", str(APP_DIR / context.run_config["config"])]
    parser = TrlParser((config_class(argv), ModelConfig, BenchmarkArguments))
    return parser.parse_args_and_config(argv)


def lora_config(model_args: ModelConfig):
    return get_peft_config(model_args) if model_args.use_peft else default_lora_config()


def rewards(data_args: BenchmarkArguments):
    return reward_functions(data_args.reward_funcs)
