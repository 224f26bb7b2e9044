"""`FedGRPOTrainer`: a drop-in `GRPOTrainer` that also runs a whole federation, and `federated(...)` for any
`GRPOTrainer` or `RLOOTrainer` subclass (`config.FEDERATED_FAMILIES`).

The top of the package's layers: federated `train()` drives `FederatedRunner`, whose clients train with
`local_trainer.LocalGRPOMixin`; nothing below imports this module.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import time

from peft import PeftModel
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import TrainOutput
from trl import GRPOTrainer

from .aggregation.privacy import RECORD_EPSILON
from .config import FederatedConfig
from .data import partition_clients
from .local.local_trainer import (
    LocalGRPOMixin,
    mixed_class,
    named_trainer_class,
    require_federable_trainer,
    with_record_privacy,
    with_speedups,
)
from .local.record_privacy import RECORD_LEDGER, RecordPrivacyMixin
from .local.speedups import TrainerMixin
from .runner import FederatedRunner
from .runtime.models import DEFAULT_MODEL, ensure_default_model

logger = logging.getLogger(__name__)


class FederatedGRPOMixin(LocalGRPOMixin):
    """FGRPO for any `trl.GRPOTrainer` or `trl.RLOOTrainer` subclass; put it first among the bases
    (`class FedMyTrainer(FederatedGRPOMixin, MyTrainer)`), or let `federated(MyTrainer)` do so.

    The trainer keeps its constructor and, with its own config or a federated one with `num_clients=1`, trains
    exactly like the class it extends, with what `LocalGRPOMixin` adds for a client: R̄ in `step_rewards` and
    `window_reward()`, FedProx's proximal term, and the speed-ups of `speedups.FastGRPOMixin` when its config turns
    one on (the instance's class is then `Fast<class>`, with the mixin first; otherwise the mixin is not there).

    With a federated config (`FedGRPOConfig`, `config.federated_config(RLOOConfig)`) of `num_clients > 1`, `train()`
    runs the whole federation instead: it partitions `train_dataset` across the clients and hands over to
    `FederatedRunner`, whose clients train this same class; `train(resume_from_checkpoint=True)` then continues the
    federation from its latest round checkpoint. There `eval_dataset` is scored with `reward_funcs`, or with
    `eval_reward_funcs` when given (see `FederatedRunner`); a single-client `train()` evaluates as the class it extends
    does and ignores it. A federation exchanges a LoRA adapter and
    builds a fresh optimizer for every client round, so federated mode refuses a model without a PEFT adapter (pass
    `peft_config`) and `optimizers`, by name, when the trainer is built; a vLLM setting that clients cannot share
    (`FedGRPOConfig.check_vllm`: `vllm_mode="colocate"`) is refused before the model loads.
    """

    def __new__(cls, *args, eval_reward_funcs=None, **kwargs):
        # `speedups.FastGRPOMixin` joins the class only when the config turns a speed-up on: by default the trainer
        # overrides none of GRPOTrainer's private methods (the instance's class is then `Fast<cls>`). Arguments that
        # do not fit the constructor are left for `__init__` to refuse.
        try:
            config = _named_arguments(cls, args, kwargs).get("args")
        except TypeError:
            config = None
        # Record-level DP trains a single trainer privately too; a federation's clients each get it from their own
        # `local_trainer`, not the trainer that drives them.
        trainer_class = with_speedups(cls, config)
        if config is not None and not _federating(config):
            trainer_class = with_record_privacy(trainer_class, config)
        return super().__new__(trainer_class)

    def __init__(self, *args, eval_reward_funcs=None, **kwargs):
        # The arguments given, by name, kept so that federated mode can hand them to every client's trainer.
        # (Named after the constructor of the class the mixins extend: the mixins' `__init__` take anything.)
        self._init_arguments = _named_arguments(type(self), args, kwargs)
        if self._init_arguments.get("model") == DEFAULT_MODEL:
            # The embedded model's name, which TRL would look up on the Hub: its cached folder, as the command line
            # loads it (`models.load_model_and_tokenizer`); TRL then loads weights and tokenizer from there.
            self._init_arguments["model"] = path = str(ensure_default_model())
            args, kwargs = (args, {**kwargs, "model": path}) if "model" in kwargs else ((path, *args[1:]), kwargs)
        self.eval_reward_funcs = eval_reward_funcs
        if _federating(self._init_arguments.get("args")):
            # Before GRPOTrainer's constructor loads a model given by name and starts a colocated vLLM engine.
            self._init_arguments["args"].check_vllm()
        super().__init__(*args, **kwargs)
        if self._federates:
            self._check_federated_arguments()

    @property
    def _federates(self) -> bool:
        return _federating(self.args)

    def _check_federated_arguments(self) -> None:
        """Refuse, by name, the arguments a federation cannot honour."""
        if not isinstance(self.model, PeftModel):
            raise ValueError(
                f"`num_clients={self.args.num_clients}` federates a LoRA adapter, but the model has none: pass "
                "`peft_config` (e.g. `trl_federated.adapters.default_lora_config()`) or a `PeftModel`. "
                "Full fine-tuning is not federated."
            )
        optimizers = self._init_arguments.get("optimizers", (None, None))
        if any(item is not None for item in optimizers):
            raise ValueError(
                f"`optimizers` cannot be federated (`num_clients={self.args.num_clients}`): every client round builds "
                "a fresh optimizer and scheduler for its own trainer. Choose them with `optim`, `optim_args`, "
                "`learning_rate` and `lr_scheduler_type` instead."
            )

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        if self._federates:
            if resume_from_checkpoint is not None:  # a federated checkpoint: the runner restores it
                self.args.resume_from_checkpoint = resume_from_checkpoint
            return self._train_federated()
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        # A single private trainer: its release is its adapter alone. A federation's client (`federation_round` set)
        # accounts its round where its update leaves it (`record_privacy.private_update`), R̄ included.
        if isinstance(self, RecordPrivacyMixin) and getattr(self.args, "federation_round", None) is None:
            epsilon = self.account_round(reward_noise_multiplier=None)
            output.metrics[RECORD_EPSILON] = epsilon
            logger.info("Record-level DP: ε = %.3f at δ = %g over every run in %s (its ledger, %s).", epsilon,
                        self.args.dp_target_delta, self.args.output_dir, RECORD_LEDGER)
        return output

    def _train_federated(self) -> TrainOutput:
        """Federated mode: Dirichlet-partition `train_dataset` over `num_clients` clients and run every round.

        The global adapter ends up in `output_dir` (PEFT layout) and in `self.model`. This trainer's own state and
        callbacks report the federation (`callbacks.TrainerLogCallback`): one `log_history` entry and one `on_log`
        to the `report_to` integrations per round, with `state.global_step` = (t + 1) · `local_steps` after round
        t. The clients' trainers report nothing themselves. The returned `TrainOutput` counts the local
        optimisation steps of all clients: `num_clients` times `state.global_step` when every client took every
        step.
        """
        if self.train_dataset is None:
            raise ValueError("Federated training needs a `train_dataset` to partition across clients.")
        arguments = self._init_arguments
        runner = FederatedRunner(
            model=self.model,
            reward_funcs=arguments.get("reward_funcs"),
            args=self.args,
            client_datasets=partition_clients(self.train_dataset, self.args),
            processing_class=self.processing_class,
            eval_dataset=self.eval_dataset,
            eval_reward_funcs=self.eval_reward_funcs,
            callbacks=arguments.get("callbacks"),
            trainer_kwargs={name: value for name, value in arguments.items() if name not in _RUNNER_ARGUMENTS},
            trainer_class=type(self),
            log_to=self,
        )
        # The runner shows its own progress by round and client; a second, step-counting bar would stay empty.
        self.callback_handler.pop_callback(ProgressCallback)
        start = time.perf_counter()
        history = runner.run()
        self.model = self.model_wrapped = runner.model
        updates = [metrics for record in history for metrics in record.client_metrics.values()]
        # A metric the server did not keep (`admission.bound_metrics`: a non-finite loss) counts as missing.
        total_steps = sum(len(metrics.get("step_rewards", ())) for metrics in updates)
        return TrainOutput(
            global_step=total_steps,
            training_loss=sum(metrics.get("train_loss", math.nan) for metrics in updates) / len(updates),
            metrics={
                "train_runtime": time.perf_counter() - start,
                "num_rounds": len(history),
                "final_mean_client_reward": sum(history[-1].rewards.values()) / len(history[-1].rewards),
            },
        )

class FedGRPOTrainer(FederatedGRPOMixin, GRPOTrainer):
    """`trl.GRPOTrainer` with the client side of FGRPO: a drop-in replacement that trains exactly like it with a
    `GRPOConfig` or a single-client `FedGRPOConfig`, and runs the federation with `num_clients > 1` (see
    `FederatedGRPOMixin`). `federated(MyGRPOTrainer)` gives the same for any `GRPOTrainer` subclass."""


# `GRPOTrainer` arguments that `FederatedRunner` takes itself (the model and its adapter, loaded once; the clients' data
# and configuration); every other argument given to a federated trainer reaches each client's trainer unchanged.
_RUNNER_ARGUMENTS = frozenset(
    {"model", "reward_funcs", "args", "train_dataset", "eval_dataset", "processing_class", "callbacks", "optimizers",
     "quantization_config", "peft_config"}
)  # fmt: skip


def federated(trainer_class: type) -> type[FederatedGRPOMixin]:
    """`trainer_class`, a `trl.GRPOTrainer` or `trl.RLOOTrainer` subclass (TRL's experimental `GMPOTrainer`, or your
    own), with `FederatedGRPOMixin` mixed in: it keeps `trainer_class`'s constructor, loss and options, reports R̄
    like `FedGRPOTrainer`, and federates when its config is a federated one with `num_clients > 1`: a
    `FedGRPOConfig`, or for a trainer with its own config class `config.federated_config(ThatConfig)`
    (`federated_config(RLOOConfig)` for RLOO). TRL's other online trainers are refused by name, with the reason
    (`local_trainer.UNFEDERABLE_TRAINERS`).

    The class is made once per `trainer_class`; `federated(GRPOTrainer)` is `FedGRPOTrainer`, and a class that
    already has the mixin is returned as it is.
    """
    require_federable_trainer(trainer_class)
    if issubclass(trainer_class, FederatedGRPOMixin):
        return trainer_class
    if trainer_class is GRPOTrainer:
        return FedGRPOTrainer
    return mixed_class(FederatedGRPOMixin, trainer_class, "Fed")


def _trainer_init(cls: type):
    """The `__init__` of the trainer class that `cls`'s mixins extend (its first class that is no mixin), unbound."""
    return next(klass for klass in cls.__mro__ if not issubclass(klass, TrainerMixin)).__init__


def _named_arguments(cls: type, args: tuple, kwargs: dict) -> dict:
    """The arguments given to the constructor of `cls` (`_trainer_init`'s), by parameter name. Those a `**kwargs`
    collects are flattened in, and those a `*args` collects are named after the parameters of the first constructor
    of `cls`'s MRO that has no catch-all (`GRPOTrainer.__init__`'s, `RLOOTrainer.__init__`'s), in order: a subclass's
    catch-all parameters forward its base's arguments (TRL's experimental trainers do)."""
    signature = inspect.signature(functools.partial(_trainer_init(cls), None))  # after `self`
    named = {}
    for name, value in signature.bind(*args, **kwargs).arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            named.update(zip(_explicit_parameters(cls), value))
        else:
            named[name] = value
    return named


def _federating(args) -> bool:
    """Whether a trainer with `args` runs a federation."""
    return isinstance(args, FederatedConfig) and args.num_clients > 1


def _explicit_parameters(cls: type) -> list[str]:
    """The parameters, after `self`, of the first `__init__` in `cls`'s MRO without a catch-all (`*args`,
    `**kwargs`)."""
    catch_alls = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for klass in cls.__mro__:
        parameters = inspect.signature(klass.__init__).parameters
        if not any(item.kind in catch_alls for item in parameters.values()):
            return list(parameters)[1:]
    raise TypeError(f"{cls.__qualname__} names no constructor parameters.")


def trainer_class(data_args):
    """The federated trainer class `data_args.trainer_class` names (`trainer.federated`); `FedGRPOTrainer` by
    default. A class that cannot be federated is a ValueError that names it and says why."""
    if data_args.trainer_class is None:
        return federated(GRPOTrainer)
    return federated(named_trainer_class(data_args.trainer_class))
