"""What a federated config does when it is built (`BuildsConfig.__post_init__`, a mixin of `FedGRPOConfig`): the
device and precision an unset `use_cpu` and `bf16` follow, the values YAML and the command line hand over as strings,
FedProx's μ and the server step an unset config derives (`server_step.ServerStep`), then every check
(`checks.ConfigChecks`), each raised as one sentence naming the field."""

from __future__ import annotations

import contextlib
import json

import torch
from transformers.utils import is_torch_bf16_gpu_available

from ..runtime.devices import has_native_bf16
from .checks import missing_extra_errors
from .results import notice_changed_trl_defaults
from .server_step import SERVER_STEP_FIELDS

# FedProx's μ when `aggregation="fedprox"` and `fedprox_mu` is unset (see the field's help: measured, not the paper's).
DEFAULT_FEDPROX_MU = 0.1
# W when `reward_window` is unset, at most `local_steps` (see the field's help).
DEFAULT_REWARD_WINDOW = 5


class BuildsConfig:
    """`__post_init__` of `FedGRPOConfig`: derivations, then the checks (see the module docstring)."""

    def __post_init__(self):
        notice_changed_trl_defaults(self)
        if not self.use_cpu and not torch.accelerator.is_available():
            # No GPU (or other accelerator): the CPU, as `Trainer` would fall back to, so that one config (the
            # quickstart's) runs on a GPU where there is one and on the CPU elsewhere, with no flag to change
            self.use_cpu = True
        if self.bf16 is None and not self.fp16:
            if self.use_cpu:  # autocast's bf16 products: fast where native, emulated (slower than float32) elsewhere
                self.bf16 = has_native_bf16(torch.device("cpu"))
            elif not is_torch_bf16_gpu_available():
                self.bf16 = False  # TRL's default (bf16 unless fp16) stops TrainingArguments with no bf16 GPU
        super().__post_init__()
        # YAML hands "inf" and a Python-spelled None over as strings.
        if isinstance(self.partition_column, str) and self.partition_column in ("None", "none", "null"):
            self.partition_column = None
        if isinstance(self.dirichlet_alpha, str):
            with contextlib.suppress(ValueError):  # left a string, it is named by _type_errors
                self.dirichlet_alpha = float(self.dirichlet_alpha)
        for name in ("aggregation_args", "server_optimizer_args"):  # a JSON object, from the command line
            if isinstance(getattr(self, name), str):
                with contextlib.suppress(ValueError):  # left a string, it is named by _federation_errors
                    setattr(self, name, json.loads(getattr(self, name)))
        for message in self._type_errors():
            raise TypeError(message)
        if self.reward_window is None:  # so that a run of fewer than 5 local steps needs no `reward_window` of its own
            self.reward_window = min(DEFAULT_REWARD_WINDOW, self.local_steps)
        if self.fedprox_mu is None:
            self.fedprox_mu = DEFAULT_FEDPROX_MU if self.aggregation == "fedprox" else 0.0
        # The server-step fields left unset, resolved here (`resolve_server_step`): a resumed run takes its
        # checkpoint's values of them instead (`run_identity.keep_server_step`). Copies of the config keep it.
        self.derived_server_fields = frozenset(name for name in SERVER_STEP_FIELDS if getattr(self, name) is None)
        self.resolve_server_step()
        for message in self._federation_errors():
            raise ValueError(message)
        for message in self._robustness_errors():
            raise ValueError(message)
        for message in (*self._privacy_errors(), *self._record_privacy_errors(), *missing_extra_errors(self)):
            raise ValueError(message)
        if self.num_clients > 1:
            self.check_vllm()
