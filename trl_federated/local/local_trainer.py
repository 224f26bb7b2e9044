"""The client side of FGRPO (Algorithm 1, lines 4-18) on any trainer of a federated family
(`config.FEDERATED_FAMILIES`: `trl.GRPOTrainer` and `trl.RLOOTrainer` subclasses; TRL's other online trainers are
refused by name): what one client's trainer adds to the class it extends for a local round (R̄ from TRL's logs, the
federation-wide learning-rate schedule, the loss terms of its callbacks) and the callbacks a client round attaches
(FedProx, the round deadline; SCAFFOLD's correction is `aggregation.scaffold.ScaffoldCorrection`). The speed-ups a
client trains with (shared prefix, gated-MLP recomputation) are any GRPO trainer's: `speedups.py`.

`client.train_local_round` trains `local_trainer(trainer_class)`; the drop-in `FedGRPOTrainer` (`trainer.py`) builds
on `LocalGRPOMixin` and adds federated `train()`, which drives `FederatedRunner`. The modules import downwards only:
trainer → runner → client → local_trainer → speedups; `FastGRPOMixin` joins a class only when a speed-up is on.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import time
from collections import defaultdict

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import TrainerCallback
from trl import GRPOTrainer

from ..config.checks import wants_record_privacy
from ..config.recipes import FEDERATED_FAMILIES
from ..names import import_object
from ..runtime.distributed import from_main_process
from ..runtime.master_weights import linear_term, read_master
from .record_privacy import RecordPrivacyMixin
from .speedups import SPEEDUP_FIELDS, FastGRPOMixin, TrainerMixin, base_name, wants_speedups

logger = logging.getLogger(__name__)


class LocalGRPOMixin(TrainerMixin):
    """What a client's trainer adds to any `trl.GRPOTrainer` subclass; put it first among the bases, or let
    `local_trainer(MyTrainer)` do so. With its own config the trainer trains exactly like the class it extends.

    On top it records the mean reward R̄^{[t,e]} of every optimisation step (over the B prompts x K completions the
    step trained on, summed over reward functions with their weights, as TRL logs `reward`) in `step_rewards`, and
    `window_reward()` gives the client's report R̄^{[t]}: the mean of the last `reward_window` (W) steps. With a
    `FedGRPOConfig` it also adds FedProx's proximal term (`fedprox_mu`), the `loss_term()` of any callback that
    has one (`compute_loss`) and, for a client of a federation
    (`federation_round` set), the learning-rate schedule of the whole federation. It overrides none of
    GRPOTrainer's private methods: `speedups.FastGRPOMixin` joins a client's class only when its config turns a
    speed-up on (`local_trainer(trainer_class, args)`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        fedprox_mu = getattr(self.args, "fedprox_mu", 0.0)
        if fedprox_mu:
            self.add_callback(ProximalTerm(fedprox_mu))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """As the trainer's, plus the `loss_term()` of every callback that has one (FedProx's proximal term,
        SCAFFOLD's gradient correction) while training. The terms are scaled as TRL scales the GRPO loss (divided
        by the optimizer step's number of micro-batches, `loss_is_scaled_for_ga`), so that every engine adds their
        gradient exactly once per optimizer step: plain, DDP (which averages it over identical processes) and
        DeepSpeed (which steps inside `backward`, where a gradient edited before `optimizer.step()` comes too late).
        """
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        return loss + self.callback_loss_terms() if model.training else loss

    def data_loss(self, model, inputs):
        """The loss of the class this mixin extends on `inputs`, without the callbacks' terms: what record-level DP
        (`record_privacy.RecordPrivacyMixin`) computes per record."""
        return super().compute_loss(model, inputs)

    def callback_loss_terms(self) -> torch.Tensor | float:
        """The sum of the `loss_term()`s of the callbacks that have one, scaled for one micro-batch (0 without)."""
        terms = [callback.loss_term() for callback in self.callback_handler.callbacks if hasattr(callback, "loss_term")]
        if not terms:
            return 0.0
        term = sum(terms)
        return term / self.current_gradient_accumulation_steps if self.loss_is_scaled_for_ga else term

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """As `Trainer`'s, except for a client of a federation (`args.federation_round` set): the schedule spans
        the whole federation, `num_rounds * local_steps` steps with its warmup, and starts at this round's first
        step t·E, so that a fresh trainer per round continues the schedule rather than restarting it."""
        round_idx = getattr(self.args, "federation_round", None)
        if round_idx is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        federation_schedule = super().create_scheduler(self.args.num_rounds * self.args.local_steps, optimizer)
        if not isinstance(federation_schedule, LambdaLR):
            raise ValueError(
                f"`lr_scheduler_type={self.args.lr_scheduler_type!r}` cannot continue across rounds (it is not a "
                "function of the step); use 'constant' or a step-based schedule such as 'linear' or 'cosine'."
            )
        first_step = round_idx * self.args.local_steps
        self.lr_scheduler = LambdaLR(
            federation_schedule.optimizer,
            [functools.partial(_from_step, schedule, first_step) for schedule in federation_schedule.lr_lambdas],
        )
        return self.lr_scheduler

    @property
    def step_rewards(self) -> list[float]:
        """R̄^{[t,e]} for every optimisation step e taken so far, read from TRL's training logs (`log_history`).

        TRL logs `reward`, the mean reward of the generation batches since the last log (over the B prompts x K
        completions, summed over reward functions with their weights, gathered over processes). A step with no
        generation of its own (it reuses a batch: `num_iterations > 1`, or `steps_per_generation` above
        `gradient_accumulation_steps`) is credited with the last batch's reward: it trained on those completions.
        Federated clients log every step; with `logging_steps > 1` each step gets the mean of its logging interval.
        """
        rewards, current, last_step = [], float("nan"), 0
        for entry in self.state.log_history:
            if "loss" not in entry:  # evaluation and end-of-training entries
                continue
            if "reward" in entry:
                current = float("nan") if entry["reward"] is None else entry["reward"]
            rewards.extend([current] * (entry["step"] - last_step))
            last_step = entry["step"]
        return rewards

    def mean_step_metrics(self) -> dict[str, float]:
        """The mean over the logged optimisation steps of every other metric TRL logs per step, under TRL's names
        (`completions/mean_length`, `rewards/<name>/mean`, `kl`, `entropy`, `grad_norm`, ...). `reward` and `loss`
        are left out: R̄ (`window_reward`) and the training loss report them. A step's missing or non-finite value
        (TRL logs None for a reward that scored nothing) is skipped."""
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for entry in self.state.log_history:
            if "loss" not in entry:  # evaluation and end-of-training entries
                continue
            for name, value in entry.items():
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if name in ("loss", "reward", "step", "epoch") or not number or not math.isfinite(value):
                    continue
                sums[name] += value
                counts[name] += 1
        return {name: sums[name] / counts[name] for name in sums}

    def window_rewards(self, window: int | None = None) -> list[float]:
        """The last `window` step rewards (default: `args.reward_window`, else all steps), whose mean is R̄^{[t]}."""
        rewards = self.step_rewards
        if not rewards:
            raise RuntimeError(
                "No logged optimisation step: call train() before window_reward(), with a `logging_strategy` that "
                "logs steps (R̄ is read from TRL's training logs)."
            )
        return rewards[-(window or getattr(self.args, "reward_window", None) or len(rewards)):]

    def window_reward(self, window: int | None = None) -> float:
        """R̄^{[t]} = mean of the last `window` step rewards (`window_rewards`)."""
        return float(torch.tensor(self.window_rewards(window), dtype=torch.float64).mean())



def local_trainer(trainer_class: type, args=None) -> type[LocalGRPOMixin]:
    """`trainer_class`, a trainer of a federated family (`config.FEDERATED_FAMILIES`: a `trl.GRPOTrainer` or
    `trl.RLOOTrainer` subclass), with `LocalGRPOMixin` mixed in (a class that has it already, such as `FedGRPOTrainer`
    or `federated(...)`'s, keeps its own), and `speedups.FastGRPOMixin` first when `args` turns a speed-up on
    (`speedups.wants_speedups`); made once per class."""
    require_federable_trainer(trainer_class)
    if args is not None:
        require_family_config(trainer_class, args)
    local = trainer_class if issubclass(trainer_class, LocalGRPOMixin) else mixed_class(
        LocalGRPOMixin, trainer_class, "Local"
    )
    return with_record_privacy(with_speedups(local, args), args)


def with_record_privacy(trainer_class: type, args) -> type:
    """`trainer_class` with `record_privacy.RecordPrivacyMixin` first among its bases when `args` turns record-level
    DP on (`dp_record_noise_multiplier`, `dp_record_epsilon`), else as it is."""
    if args is None or not wants_record_privacy(args) or issubclass(trainer_class, RecordPrivacyMixin):
        return trainer_class
    return mixed_class(RecordPrivacyMixin, trainer_class, "Private")


def with_speedups(trainer_class: type, args) -> type:
    """`trainer_class` with `speedups.FastGRPOMixin` first among its bases when `args` turns a speed-up on, else as
    it is: a trainer overrides GRPOTrainer's private methods only for a speed-up it uses. The speed-ups are
    GRPOTrainer's: for a trainer of another family they are refused by name."""
    if not wants_speedups(args) or issubclass(trainer_class, FastGRPOMixin):
        return trainer_class
    if not issubclass(trainer_class, GRPOTrainer):
        switched_on = [name for name in SPEEDUP_FIELDS if getattr(args, name, False)]
        raise ValueError(
            f"{', '.join(f'`{name}`' for name in switched_on)} speed up `trl.GRPOTrainer`'s private methods, which "
            f"{base_name(trainer_class)} does not have: turn it off."
        )
    return mixed_class(FastGRPOMixin, trainer_class, "Fast")


def drop_unsupported_speedups(trainer_class: type, args) -> list[str]:
    """Turn off the speed-ups `args` turns on that `trainer_class` cannot take (`with_speedups` refuses them for a
    class outside `trl.GRPOTrainer`'s family), with one logged notice naming them; return their names. A federation
    calls it before the model loads, so that a config written for GRPO (the quickstart's) runs as written with
    `--trainer_class trl.RLOOTrainer` rather than losing every client at its first round."""
    if issubclass(trainer_class, GRPOTrainer):
        return []
    switched_on = [name for name in SPEEDUP_FIELDS if getattr(args, name, False)]
    for name in switched_on:
        setattr(args, name, False)
    if switched_on:
        logger.warning(
            "%s turned off: they speed up `trl.GRPOTrainer`'s private methods, which %s does not have; it trains "
            "without them.", ", ".join(f"`{name}`" for name in switched_on), base_name(trainer_class),
        )
    return switched_on


@functools.cache
def mixed_class(mixin: type, trainer_class: type, prefix: str) -> type:
    """`trainer_class` with `mixin` first among its bases, named `<prefix><TrainerClass>`; one class per arguments."""
    return type(
        f"{prefix}{trainer_class.__name__}",
        (mixin, trainer_class),
        {"__module__": trainer_class.__module__, "__doc__": f"`{base_name(trainer_class)}` with `{mixin.__name__}`."},
    )


def family_roots() -> dict[type, type]:
    """Each federated family's root trainer class with its config class, imported from the one table of the families
    (`config.FEDERATED_FAMILIES`, which names the trainers by import path)."""
    roots = {}
    for path, config in FEDERATED_FAMILIES.items():
        module, _, name = path.rpartition(".")
        roots[getattr(importlib.import_module(module), name)] = config
    return roots


# TRL 1.16's other trainers that generate online, each with why a federation cannot train it (`tests/test_family.py`).
UNFEDERABLE_TRAINERS = {
    "trl.experimental.async_grpo.async_grpo_trainer.AsyncGRPOTrainer": "it takes the model by name only (a loaded "
    "`PeftModel` has no `.split`) and generates in a rollout worker process against a vLLM server "
    "(`vllm_server_base_url`) that it streams its weights to, while a federation builds every client round's trainer "
    "in process on the loaded global adapter",
    "trl.experimental.a2po.a2po_trainer.A2POTrainer": "it takes no `peft_config` and its config no `beta`, "
    "`num_iterations`, `steps_per_generation` or `use_vllm`, and it estimates V*(x) for every training prompt from "
    "its frozen reference before training: a federation trains a LoRA adapter and builds a fresh trainer every client "
    "round, which would re-estimate V* from the round's global model each round",
    "trl.experimental.sdpo.sdpo_trainer.SDPOTrainer": "its self-teacher is state of one trainer across its steps (by "
    "default an EMA teacher adapter, `teacher_model_kind='ema'`), which a federation, building a fresh trainer every "
    "client round and exchanging one adapter, would restart from the round's global adapter every round",
    "trl.experimental.online_dpo.online_dpo_trainer.OnlineDPOTrainer": "it logs no mean `reward` per step (it scores "
    "a pair of completions per prompt, `objective/scores`), from which a client's R̄ is read",
    "trl.experimental.iw_opd.iw_opd_trainer.IWOPDTrainer": "it distils a `teacher_model` and takes no `reward_funcs`: "
    "a client has no reward R̄ to report",
    "trl.experimental.tpo.tpo_trainer.TPOTrainer": "it trains offline on preference triples and takes no "
    "`reward_funcs`: a client has no reward R̄ to report",
}


def require_federable_trainer(trainer_class) -> None:
    """Raise `TypeError` unless `trainer_class` is a class of a federated family (`family_roots`); a TRL trainer that
    cannot federate is refused by name with the reason (`UNFEDERABLE_TRAINERS`)."""
    if isinstance(trainer_class, type) and issubclass(trainer_class, tuple(family_roots())):
        return
    for klass in getattr(trainer_class, "__mro__", ()):
        reason = UNFEDERABLE_TRAINERS.get(f"{klass.__module__}.{klass.__qualname__}")
        if reason is not None:
            raise TypeError(f"`{klass.__qualname__}` cannot be federated: {reason}.")
    raise TypeError(
        f"Only a {' or '.join(f'`{path}`' for path in FEDERATED_FAMILIES)} subclass can be federated, got "
        f"{trainer_class!r}: the federation reads R̄ from their logs and builds one such trainer per client round."
    )


def named_trainer_class(path: str) -> type:
    """The trainer class the import path `path` names (`trainer_class` on the command line), checked to federate
    (`require_federable_trainer`); a ValueError that names the path and says why for one that does not."""
    trainer_class = import_object(path, "trainer_class", kind="Class")
    try:
        require_federable_trainer(trainer_class)
    except TypeError as refusal:
        raise ValueError(f"`trainer_class` {path!r}: {refusal}") from None
    return trainer_class


def trainer_config_class(trainer_class: type) -> type:
    """The TRL config class of `trainer_class`'s family (`family_roots`): `GRPOConfig` or `RLOOConfig`."""
    require_federable_trainer(trainer_class)
    return next(config for root, config in family_roots().items() if issubclass(trainer_class, root))


def require_family_config(trainer_class: type, args) -> None:
    """Raise `TypeError` unless `args` is a config of `trainer_class`'s family (`trainer_config_class`): an
    `RLOOTrainer` reads RLOO's fields, which a `FedGRPOConfig` lacks."""
    config_class = trainer_config_class(trainer_class)
    if not isinstance(args, config_class):
        raise TypeError(
            f"{base_name(trainer_class)} trains with a `{config_class.__name__}`, got a `{type(args).__name__}`: "
            f"give it `trl_federated.config.federated_config({config_class.__name__})`."
        )


def _from_step(schedule, first_step: int, step: int) -> float:
    """`schedule` (a LambdaLR factor) read `first_step` steps later; a module function, so the scheduler pickles."""
    return schedule(first_step + step)


class ProximalTerm(TrainerCallback):
    """FedProx (Li et al., MLSys 2020) on the trainable (adapter) parameters.

    The local objective gains μ/2 ||θ − θ^{[t]}||², where θ^{[t]} is the adapter the client started the round
    from. Its gradient μ (θ − θ^{[t]}), with θ the optimizer's float32 values (`master_weights`), joins the GRPO loss
    as a `loss_term`, so it reaches the gradient once per optimizer step in every engine (gradient accumulation,
    DDP, DeepSpeed) and, as in Flower's FedProx, is clipped together with the GRPO gradient.
    """

    def __init__(self, mu: float):
        self.mu = mu
        self.params: list[torch.Tensor] = []
        self.anchor: list[torch.Tensor] = []
        self.pull: list[torch.Tensor] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.params = [param for param in model.parameters() if param.requires_grad]
        self.anchor = [read_master(param).clone() for param in self.params]

    def on_step_begin(self, args, state, control, **kwargs):
        # The optimizer step ahead pulls with μ (θ − θ^{[t]}) at the values it starts from.
        masters = [read_master(param) for param in self.params]
        self.pull = torch._foreach_mul(torch._foreach_sub(masters, self.anchor), self.mu)

    def loss_term(self) -> torch.Tensor:
        return linear_term(self.params, self.pull)


class Deadline(TrainerCallback):
    """Ends local training at the first optimisation step that finishes past `deadline` (a `time.perf_counter()`
    value). A step in progress, its generation included, is never interrupted: stopping between steps leaves the
    model, the optimizer and TRL's buffers consistent, which killing a thread mid-step would not."""

    def __init__(self, deadline: float):
        self.deadline = deadline

    def on_step_end(self, args, state, control, **kwargs):
        # The main process's clock decides: processes that stopped at different steps would deadlock.
        if from_main_process(time.perf_counter() >= self.deadline):
            control.should_training_stop = True
