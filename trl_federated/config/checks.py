"""The checks of a federated configuration: one message per invalid field, naming it and its value
(`ConfigChecks._type_errors`, `_federation_errors`, `_robustness_errors`, `_privacy_errors`, which
`FedGRPOConfig.__post_init__` raises), what makes a federation learn something other than the user likely means
(`federation_warnings`), and the vLLM settings federated clients cannot generate with (`check_vllm`). The chosen
aggregation's, server optimizer's and robust combiner's own fields are checked by their implementations
(`config_errors`, through the registries of `choices`): RPG's `rpg_*` ranges by
`aggregation.RPGAggregator.config_errors`. Adaptive clipping's ranges (`adaptive_clipping_errors`) are the one rule
for the config's `dp_*` fields and `aggregation.privacy.AdaptiveClipping`'s arguments."""

from __future__ import annotations

import math
from importlib.util import find_spec

from transformers.trainer_utils import IntervalStrategy

from ..choices import (
    AGGREGATIONS,
    GENERATION_DTYPE_CHOICES,
    LORA_AGGREGATIONS,
    NORM_ACTIONS,
    ROBUST_AGGREGATIONS,
    RPG_SIGNALS,
    SCAFFOLD_CORRECTIONS,
    SERVER_OPTIMIZERS,
    TRANSFER_DTYPES,
    choice_error,
)
from ..sampling import participation_errors
from .declared_fields import declared_annotations


def _is_of_type(value, type_name: str) -> bool:
    """Whether `value` fits the annotation `type_name` ("int", "float", "str", "bool"); booleans are not numbers."""
    if type_name == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, {"int": int, "float": (int, float), "str": str, "dict": dict}[type_name])


def wants_record_privacy(args) -> bool:
    """Whether `args` (any config: a plain TRL one has none of the fields) turns record-level DP on
    (`local.record_privacy`)."""
    return getattr(args, "dp_record_noise_multiplier", None) is not None or (
        getattr(args, "dp_record_epsilon", None) is not None
    )


# The DP settings whose accountant is Google's `dp-accounting`, the `dp` extra (`aggregation.privacy`,
# `local.record_privacy`): checked when the config is built, so that a run without the extra stops in one line before
# the model loads rather than in every client's first round.
DP_ACCOUNTING_FIELDS = ("dp_noise_multiplier", "dp_record_noise_multiplier", "dp_record_epsilon")


def missing_extra_errors(config):
    """One message naming the `pip install` that fixes it when `config` sets a field whose optional extra is not
    installed (`DP_ACCOUNTING_FIELDS`: the `dp` extra)."""
    wanted = [name for name in DP_ACCOUNTING_FIELDS if getattr(config, name, None) is not None]
    if wanted and find_spec("dp_accounting") is None:
        yield (f"{', '.join(f'`{name}`' for name in wanted)} accounts privacy with Google's `dp-accounting`, which is "
               "not installed: pip install -e '.[dp]' in this package's clone (the `dp` extra: dp-accounting).")


def positive_errors(config, optional: tuple[str, ...] = (), required: tuple[str, ...] = ()):
    """One message per field of `config` named in `optional` that is neither None nor > 0, and in `required` that is
    not > 0."""
    for name in optional:
        value = getattr(config, name)
        if value is not None and not value > 0:
            yield f"`{name}` must be > 0 or None, got {value}."
    for name in required:
        value = getattr(config, name)
        if not value > 0:
            yield f"`{name}` must be > 0, got {value}."


def adaptive_clipping_errors(target_quantile, clip_norm_lr, clipped_count_stddev, noise_multiplier):
    """One message per adaptive-clipping setting out of its range, named as `FedGRPOConfig`'s `dp_*` field: the one
    rule for the config's fields and `aggregation.privacy.AdaptiveClipping`'s arguments. The ranges are those Flower's
    `DifferentialPrivacyServerSideAdaptiveClipping` checks; the count's noise against σ is this library's: its
    accountant's replace-one relation makes the count a Gaussian of noise multiplier σ_b (see `AdaptiveClipping`)."""
    if not 0 <= target_quantile <= 1:
        yield f"`dp_target_quantile` must lie in [0, 1], got {target_quantile}."
    if not clip_norm_lr > 0:
        yield f"`dp_clip_norm_lr` must be > 0, got {clip_norm_lr}."
    if clipped_count_stddev is None:
        return
    if not clipped_count_stddev > 0:
        yield f"`dp_clipped_count_stddev` must be > 0 or None, got {clipped_count_stddev}."
    elif noise_multiplier is not None and noise_multiplier > 0 and not clipped_count_stddev > noise_multiplier:
        yield (
            f"`dp_clipped_count_stddev` ({clipped_count_stddev}) must exceed `dp_noise_multiplier` "
            f"({noise_multiplier}): for the round to cost what σ alone would, Δ's noise multiplier rises to "
            "(σ⁻² − σ_b⁻²)^(-1/2), which exists only for σ_b > σ (and is large near it). Raise it, or leave it None "
            "(max(m/20, 2σ))."
        )


def _own_fields_class(config_class: type) -> type:
    """The class that declares the federation's fields (`FedGRPOConfig`, with its field mixins, or the class
    `federated_config` makes of an `RLOOConfig`): the one whose bases name `fields.FederatedConfig`, the class whose
    bases name `ConfigChecks`."""
    return next(cls for cls in config_class.__mro__ if any(ConfigChecks in base.__bases__ for base in cls.__bases__))


class ConfigChecks:
    """The checks of `FedGRPOConfig` (a mixin of it: the methods read the config's fields)."""

    def check_vllm(self, parallel_clients: bool = False) -> None:
        """Refuse, by name, a vLLM setting that federated clients cannot generate with. Every entry point calls it
        before it loads a model or starts an engine: this config when it declares a federation (`num_clients > 1`),
        `FederatedRunner`, the federated `FedGRPOTrainer` and the Flower `ClientApp` (whose config may have been
        changed since), and the Flower `ServerApp` under the Simulation Engine with `parallel_clients`: there the
        ClientApps run in worker processes of their own, concurrently.

        Supported: `use_vllm` with `vllm_mode="server"` (one vLLM server, `trl vllm-serve`), shared by the clients of
        one process in turn, each client's trainer pushing its merged weights before it generates (see
        `vllm_server`).
        """
        if not self.use_vllm:
            return
        if self.vllm_mode == "colocate":  # TRL's default mode
            raise ValueError(
                "`use_vllm` with `vllm_mode='colocate'` would start a vLLM engine, and load the base model into it, "
                "for every client's trainer in every round. Use `vllm_mode='server'`: one `trl vllm-serve` engine "
                "serves all clients and rounds, and TRL pushes each client's merged weights to it without reloading."
            )
        if parallel_clients:
            raise ValueError(
                "`use_vllm` with clients trained in parallel processes (Flower's Simulation Engine): a vLLM server "
                "holds one set of weights, which each client's trainer overwrites with its own before it generates, "
                "so concurrent clients would generate with each other's weights, and each process would open a "
                "weight-sync group of its own to the server on `vllm_group_port`. Train the clients in one process "
                "(`trl-federated run`, `FederatedRunner`, `FedGRPOTrainer`), or give each SuperNode of a Flower "
                "deployment its own vLLM server."
            )


    def federation_warnings(self, reward_range: tuple[float, float] | None = None) -> list[str]:
        """What about this configuration makes a federation learn something other than the user likely means, one
        message per problem; the runner and the Flower server log them. `reward_range`: the interval the reward
        functions declare (`rewards.combined_reward_range`), None when unknown."""
        warnings = []
        # A generation batch serves steps_per_generation micro-batches, num_iterations times over: the policy that
        # generated it is that of the batch's first optimisation step. R̄ reflects local training only if some step
        # of the round trains on a batch generated after the round's first update.
        steps_per_batch = self.steps_per_generation * self.num_iterations / self.gradient_accumulation_steps
        if self.local_steps <= steps_per_batch:
            # Only the remedies this configuration has: steps_per_generation cannot go below the accumulation steps
            remedies = [f"raise `local_steps` above {steps_per_batch:g}"]
            if self.steps_per_generation > self.gradient_accumulation_steps:
                remedies.append(f"lower `steps_per_generation` towards `gradient_accumulation_steps` "
                                f"({self.gradient_accumulation_steps})")
            if self.num_iterations > 1:
                remedies.append("lower `num_iterations`")
            warnings.append(
                f"Every local step of a round trains on completions generated by the global model: `local_steps` "
                f"({self.local_steps}) <= `steps_per_generation` ({self.steps_per_generation}) x `num_iterations` "
                f"({self.num_iterations}) / `gradient_accumulation_steps` ({self.gradient_accumulation_steps}), so "
                f"R̄ measures θ^{{[t]}}, not the client's local progress: {' or '.join(remedies)}."
            )
        if self.aggregation == "rpg" and self.rpg_h_max is None and reward_range is None:
            warnings.append(
                "`rpg_h_max` is None and the reward functions declare no `reward_range`: nothing bounds the R̄ a "
                "client reports, so one client can take all of RPG's weight by reporting a large one. Set "
                "`rpg_h_max` (10 by default), or give every reward function a `reward_range` attribute."
            )
        if self.aggregation == "rpg" and self.rpg_signal == "held-out" and self.rpg_gain == "noise-aware" and (
                reward_range is None):
            warnings.append(
                "`rpg_gain: noise-aware` reads the standard error of a held-out R̄ from the reward functions' declared "
                "`reward_range`, and they declare none: every client's is unknown, so the gain is the paper's. Give "
                "every reward function a `reward_range` attribute."
            )
        if self.aggregation == "rpg" and reward_range is not None and reward_range[1] - reward_range[0] > 1:
            low, high = reward_range
            warnings.append(
                f"The reward functions declare rewards in [{low}, {high}], wider than the [0, 1] that `rpg_sigma_min` "
                f"({self.rpg_sigma_min}) and `rpg_sigma_max` ({self.rpg_sigma_max}) are tuned for: they are absolute "
                f"reward units, so scale them by {high - low:g} to weigh clients as the paper does."
            )
        # TrainingArguments' schedule fields a TRL script sets; the federation's schedule is its own.
        if self.max_steps > 0:
            warnings.append(
                f"`max_steps` ({self.max_steps}) is ignored by a federation: every client takes `local_steps` "
                f"({self.local_steps}) steps in each of `num_rounds` ({self.num_rounds}) rounds."
            )
        if self.eval_strategy != IntervalStrategy.NO:
            warnings.append(
                f"`eval_strategy` ({self.eval_strategy.value}) is ignored by a federation: the server evaluates the "
                f"global adapter before the first round (`eval_initial`), every `eval_every` ({self.eval_every}) "
                "rounds and after the last."
            )
        return warnings


    def _type_errors(self):
        """Yield one message per federated field whose value is not of its declared type."""
        for name, annotation in declared_annotations(_own_fields_class(type(self))).items():
            value, allowed = getattr(self, name), annotation.split(" | ")
            if value is None and "None" in allowed:
                continue
            if not any(_is_of_type(value, type_name) for type_name in allowed if type_name != "None"):
                yield f"`{name}` must be of type {annotation}, got {value!r} ({type(value).__name__})."


    def _federation_errors(self):
        """Yield one message per invalid federated field, each naming the field and its value."""
        # Every float of the whole configuration, TRL's included: NaN and inf pass every range check below.
        for name, value in vars(self).items():
            if isinstance(value, float) and not math.isfinite(value) and not (name == "dirichlet_alpha" and value > 0):
                yield f"`{name}` must be a finite number, got {value}."
        for name in (
            "num_rounds", "local_steps", "reward_window", "num_clients", "min_partition_size", "min_clients_per_round",
            "min_train_clients", "min_evaluate_clients", "rpg_signal_items",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                yield f"`{name}` must be a positive integer, got {value!r}."
        if self.reward_window > self.local_steps:
            yield f"`reward_window` (W={self.reward_window}) must not exceed `local_steps` (E={self.local_steps})."
        if not 0 <= self.fraction_evaluate <= 1:
            yield f"`fraction_evaluate` must lie in [0, 1], got {self.fraction_evaluate}."
        if not 0 < self.fraction_train <= 1:
            yield f"`fraction_train` must lie in (0, 1], got {self.fraction_train}."
        elif self.num_clients > 1:
            yield from participation_errors(self, self.num_clients)
        if self.client_timeout is not None and not self.client_timeout > 0:
            yield f"`client_timeout` must be > 0 seconds or None, got {self.client_timeout}."
        if not self.node_wait_timeout >= 0:
            yield f"`node_wait_timeout` must be >= 0 seconds, got {self.node_wait_timeout}."
        if self.federation_round is not None and (
            not isinstance(self.federation_round, int) or self.federation_round < 0
        ):
            yield f"`federation_round` must be a round index >= 0 or None, got {self.federation_round!r}."
        if self.eval_every < 0:
            yield f"`eval_every` must be >= 0, got {self.eval_every}."
        if not self.dirichlet_alpha > 0 or math.isnan(self.dirichlet_alpha):
            yield f"`dirichlet_alpha` must be > 0 (or 'inf' for a uniform split), got {self.dirichlet_alpha}."
        for name, choices in (
            ("aggregation", AGGREGATIONS), ("lora_aggregation", LORA_AGGREGATIONS),
            ("transfer_dtype", TRANSFER_DTYPES), ("server_optimizer", SERVER_OPTIMIZERS),
            ("scaffold_correction", SCAFFOLD_CORRECTIONS), ("generation_dtype", GENERATION_DTYPE_CHOICES),
            ("rpg_signal", RPG_SIGNALS),
        ):
            if message := choice_error(name, getattr(self, name), choices):
                yield message
        if self.labels_per_client is not None:
            if not isinstance(self.labels_per_client, int) or self.labels_per_client < 1:
                yield f"`labels_per_client` must be a positive integer or None, got {self.labels_per_client!r}."
            elif self.partition_column is None:
                yield ("`labels_per_client` deals the values of `partition_column` to the clients: name that column "
                       "(e.g. `partition_column: category`), or leave `labels_per_client` unset.")
        for name in ("aggregation_args", "server_optimizer_args"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                yield f"`{name}` must be a mapping (a JSON object on the command line), got {getattr(self, name)!r}."
        # The chosen methods' own hyperparameters, checked by their implementations (`config_errors`).
        aggregator_class = getattr(AGGREGATIONS.get(self.aggregation), "aggregator_class", None)
        for implementation in (aggregator_class, SERVER_OPTIMIZERS.get(self.server_optimizer)):
            if implementation is not None:
                yield from implementation.config_errors(self)
        for name in ("server_learning_rate", "server_epsilon"):
            value = getattr(self, name)
            if value is None and name == "server_epsilon":  # FedAdam's τ, derived from the first Δ
                continue
            if not value > 0:
                derived = name in self.derived_server_fields
                yield f"`{name}` must be > 0, got {value}" + (
                    f" (derived from `learning_rate` {self.learning_rate}: set one of them)." if derived else "."
                )
        if self.fedprox_mu < 0:
            yield f"`fedprox_mu` must be >= 0, got {self.fedprox_mu}."
        for name in ("beta", "max_grad_norm"):  # TRL's fields, with this config's help: 0 turns each off
            if getattr(self, name) < 0:
                yield f"`{name}` must be >= 0, got {getattr(self, name)}."
        for name in ("server_beta1", "server_beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                yield f"`{name}` must lie in [0, 1), got {value}."


    def _robustness_errors(self):
        """Yield one message per invalid field of the "Robustness" block."""
        if self.update_norm_bound is not None and not self.update_norm_bound > 0:
            yield f"`update_norm_bound` must be > 0 or None, got {self.update_norm_bound}."
        for name, choices in (("update_norm_action", NORM_ACTIONS), ("robust_aggregation", ROBUST_AGGREGATIONS)):
            if message := choice_error(name, getattr(self, name), choices):
                yield message
        if not 0 < self.robust_trim_fraction < 0.5:
            yield f"`robust_trim_fraction` must lie in (0, 0.5), got {self.robust_trim_fraction}."
        # The chosen combiner's own checks, with the fewest clients it needs (`RobustCombiner.config_errors`).
        if (combiner_class := ROBUST_AGGREGATIONS.get(self.robust_aggregation)) is not None:
            yield from combiner_class.config_errors(self)
        if not isinstance(self.robust_num_malicious, int) or self.robust_num_malicious < 0:
            yield f"`robust_num_malicious` must be an integer >= 0, got {self.robust_num_malicious!r}."
        if self.robust_num_selected is not None and (
            not isinstance(self.robust_num_selected, int) or self.robust_num_selected < 1
        ):
            yield f"`robust_num_selected` must be a positive integer or None, got {self.robust_num_selected!r}."
        elif (self.robust_aggregation == "multi_krum" and self.robust_num_selected is not None
              and isinstance(self.robust_num_malicious, int)
              and self.robust_num_selected > self.min_clients_per_round - self.robust_num_malicious):
            # more than n − f would average at least one of the f arbitrary clients in, in a round of the fewest
            yield (
                f"`robust_num_selected` = {self.robust_num_selected} exceeds `min_clients_per_round` − "
                f"`robust_num_malicious` = {self.min_clients_per_round - self.robust_num_malicious}: Multi-Krum would "
                "then average in an arbitrary client in a round of the fewest clients. Lower it, or leave it None "
                "(n − f every round)."
            )
        if self.max_client_samples is not None and (
            isinstance(self.max_client_samples, bool) or not isinstance(self.max_client_samples, int)
            or self.max_client_samples < 1
        ):
            yield f"`max_client_samples` must be a positive integer or None, got {self.max_client_samples!r}."


    def _record_privacy_errors(self):
        """Yield one message per invalid field of record-level DP, and per setting whose loss couples the records
        (`local.record_privacy` clips each record's gradient of its own loss)."""
        yield from positive_errors(
            self, optional=("dp_record_noise_multiplier", "dp_record_epsilon", "dp_record_reward_noise_multiplier"),
            required=("dp_record_clip_norm",),
        )
        if not wants_record_privacy(self):
            return
        if self.dp_record_noise_multiplier is not None and self.dp_record_epsilon is not None:
            yield ("Set one of `dp_record_noise_multiplier` (σ) and `dp_record_epsilon` (a budget σ is calibrated "
                   "to), not both.")
        coupled = {
            "steps_per_generation": (self.steps_per_generation != self.gradient_accumulation_steps,
                                     "must equal `gradient_accumulation_steps`, so that a record's completions "
                                     "train in one optimizer step"),
            "scale_rewards": (getattr(self, "scale_rewards", None) == "batch",
                              "'batch' scales every advantage by the whole batch's spread; use 'group' or 'none'"),
            "normalize_advantages": (getattr(self, "normalize_advantages", False),
                                     "normalises every advantage over the whole batch; turn it off"),
            "top_entropy_quantile": (getattr(self, "top_entropy_quantile", 1.0) < 1.0,
                                     "masks tokens by a threshold of the whole batch's entropies; set it to 1.0"),
            "use_adaptive_entropy": (getattr(self, "use_adaptive_entropy", False),
                                     "moves the entropy coefficient with the whole batch's entropy; turn it off"),
        }
        for name, (refused, why) in coupled.items():
            if refused:
                yield f"Under record-level DP `{name}` {why}: each record's gradient must depend on that record alone."
        if self.rpg_signal == "held-out":
            yield ("`rpg_signal='held-out'` cannot run under record-level DP: each round measures the client's own "
                   "held-out items, a release its accountant does not count. Use `rpg_signal: reward-window`.")
        if self.aggregation == "rpg" and self.rpg_gain == "noise-aware":
            yield ("`rpg_gain='noise-aware'` cannot run under record-level DP: it reads each client's step rewards, "
                   "which stay on the client (R̄ alone is released, noised). Use `rpg_gain: paper`.")

    def _privacy_errors(self):
        """Yield one message per invalid field of the "Differential privacy" block, and per setting DP cannot cover."""
        yield from positive_errors(
            self, optional=("dp_noise_multiplier", "dp_reward_noise_multiplier", "dp_max_epsilon"),
            required=("dp_clip_norm",),
        )
        if not 0 < self.dp_target_delta < 1:
            yield f"`dp_target_delta` must lie in (0, 1), got {self.dp_target_delta}."
        yield from adaptive_clipping_errors(self.dp_target_quantile, self.dp_clip_norm_lr,
                                            self.dp_clipped_count_stddev, self.dp_noise_multiplier)
        if self.dp_noise_multiplier is None:
            return
        if self.aggregation == "scaffold":
            yield (
                "`aggregation='scaffold'` cannot run under differential privacy (`dp_noise_multiplier`): SCAFFOLD's "
                "controls c and c_i are per-client state the DP noise does not cover. Use 'fedavg', 'fedprox' or 'rpg'."
            )
        # With a held-out R̄ its standard error is computed from the released R̃ and n alone: post-processing
        if self.aggregation == "rpg" and self.rpg_gain == "noise-aware" and self.rpg_signal != "held-out":
            yield (
                "`rpg_gain='noise-aware'` cannot run under differential privacy (`dp_noise_multiplier`) with the "
                "window's R̄: it reads each client's step rewards, which the DP mechanism does not release (it releases "
                "a noised R̄ alone). Use `rpg_gain: paper`, or `rpg_signal: held-out`, whose standard error it reads "
                "from the released R̃."
            )
        if self.robust_aggregation != "none":
            yield (
                f"`robust_aggregation={self.robust_aggregation!r}` cannot run under differential privacy "
                "(`dp_noise_multiplier`): the noise is calibrated to the weighted sum's sensitivity. Set it to 'none'."
            )
