"""Configuration of federated GRPO runs.

`FedGRPOConfig` (`fields`) is a `trl.GRPOConfig`: every GRPO field keeps its meaning, and the federated fields parse
the same way from YAML and the command line (`TrlParser`, `HfArgumentParser`). Beside its fields: those of its
robustness and its differential privacy (`robustness_fields`, `privacy_fields`: field mixins, which `declared_fields`
gathers), the checks (`checks`), the server step's derivation (`server_step`), the fields that change a run's result
(`results`), and the recipes (`recipes`: `FedDAPOConfig`, `FedGSPOConfig`, `CONFIG_CLASSES`, `federated_config`,
and the one table of the trainer families a federation trains, `FEDERATED_FAMILIES`).
"""

from .building import DEFAULT_FEDPROX_MU, BuildsConfig, has_native_bf16
from .checks import ConfigChecks
from .fields import FederatedConfig, FedGRPOConfig
from .recipes import (
    CONFIG_CLASSES,
    FEDERATED_FAMILIES,
    FedDAPOConfig,
    FedGSPOConfig,
    federable_configs,
    federated_config,
)
from .results import (
    _NOTICED,
    TRL_RESULT_FIELDS,
    ResultHelp,
    changed_trl_defaults,
    notice_changed_trl_defaults,
    result_fields,
)
from .server_step import PAPER_SERVER_EPSILON, SERVER_ADAM_SCALE, SERVER_STEP_FIELDS, ServerStep

__all__ = [
    "CONFIG_CLASSES",
    "FEDERATED_FAMILIES",
    "federable_configs",
    "DEFAULT_FEDPROX_MU",
    "PAPER_SERVER_EPSILON",
    "SERVER_ADAM_SCALE",
    "SERVER_STEP_FIELDS",
    "TRL_RESULT_FIELDS",
    "BuildsConfig",
    "_NOTICED",
    "ConfigChecks",
    "FedDAPOConfig",
    "FederatedConfig",
    "FedGRPOConfig",
    "FedGSPOConfig",
    "ResultHelp",
    "ServerStep",
    "changed_trl_defaults",
    "federated_config",
    "has_native_bf16",
    "notice_changed_trl_defaults",
    "result_fields",
]
