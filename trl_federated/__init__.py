"""trl-federated: federated GRPO-family reinforcement learning for LLMs on top of Hugging Face TRL."""

import importlib
import importlib.abc
import importlib.util
import sys

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

# Modules that moved into the layers' folders, by the name they had at the top of the package: importing the old name
# gives the module itself (the same object, so `mock.patch("trl_federated.server.X")` and pickles that name the old
# module work), and its logger keeps that name. docs/architecture.md lists the folders.
MOVED_MODULES = {
    "answer_check": "scoring.answer_check", "rewards": "scoring.rewards", "evaluation": "core.evaluation",
    "devices": "runtime.devices", "distributed": "runtime.distributed", "memory": "runtime.memory",
    "vllm_server": "runtime.vllm_server", "models": "runtime.models",
    "master_weights": "runtime.master_weights", "shared_prefix": "local.shared_prefix", "gated_mlp": "local.gated_mlp",
    "fast_generation": "local.fast_generation", "speedups": "local.speedups", "local_trainer": "local.local_trainer",
    "client": "local.client",
    "server": "core.server", "admission": "core.admission", "round_record": "core.round_record",
    "callbacks": "core.callbacks", "checkpoint": "core.checkpoint", "run_identity": "core.run_identity",
    "reporting": "reports.summary", "hub": "reports.hub", "compare": "reports.compare",
}  # fmt: skip


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `trl_federated.<old name>` (`MOVED_MODULES`) as the module at its new place."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package == __name__ and name in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{MOVED_MODULES[spec.name.removeprefix(__name__ + '.')]}")
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        # The import system gave the module the old name's `__spec__`: it keeps its own.
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())

