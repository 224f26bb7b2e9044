"""trl-federated: federated GRPO-family reinforcement learning for LLMs on top of Hugging Face TRL."""

from .names import lazy_attributes
from .runtime.notices import silence_upstream_notices

__version__ = "0.1.0"

silence_upstream_notices()  # before TRL, transformers and DeepSpeed import and raise them

# The public names, each with the module it lives in: `from trl_federated import FedGRPOConfig` imports that module
# (and torch, TRL) when first read, not `import trl_federated`, which the command line's `--version`, `--help` and
# argument errors run.
_HOMES = {
    **dict.fromkeys(
        ("Aggregator", "ClientUpdate", "FedAvgAggregator", "RPGAggregator", "ServerAdam", "ServerSGD"), ".aggregation"
    ),
    **dict.fromkeys(("FedDAPOConfig", "FedGRPOConfig", "FedGSPOConfig", "federated_config"), ".config"),
    "RoundCallback": ".core.callbacks",
    "RoundRecord": ".core.round_record",
    "LocalGRPOMixin": ".local.local_trainer",
    "local_trainer": ".local.local_trainer",
    "FastGRPOMixin": ".local.speedups",
    "FederatedRunner": ".runner",
    **dict.fromkeys(("FederatedGRPOMixin", "FedGRPOTrainer", "federated"), ".trainer"),
}
__getattr__ = lazy_attributes(globals(), _HOMES)
__all__ = sorted(_HOMES)
