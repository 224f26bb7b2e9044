"""trl-federated: federated GRPO-family reinforcement learning for LLMs on top of Hugging Face TRL."""

from .aggregation import Aggregator, ClientUpdate, FedAvgAggregator, RPGAggregator, ServerAdam, ServerSGD
from .callbacks import RoundCallback
from .config import FedDAPOConfig, FedGRPOConfig, FedGSPOConfig, federated_config
from .local_trainer import LocalGRPOMixin, local_trainer
from .round_record import RoundRecord
from .runner import FederatedRunner
from .speedups import FastGRPOMixin
from .trainer import FederatedGRPOMixin, FedGRPOTrainer, federated

__version__ = "0.1.0"

__all__ = [
    "Aggregator",
    "ClientUpdate",
    "FastGRPOMixin",
    "FedAvgAggregator",
    "FedDAPOConfig",
    "FedGRPOConfig",
    "FedGSPOConfig",
    "FedGRPOTrainer",
    "FederatedGRPOMixin",
    "FederatedRunner",
    "LocalGRPOMixin",
    "RPGAggregator",
    "RoundCallback",
    "RoundRecord",
    "ServerAdam",
    "ServerSGD",
    "federated",
    "federated_config",
    "local_trainer",
]
