"""The differential-privacy fields of `FedGRPOConfig` (`PrivacyFields`, a field mixin of it), each documented beside
its declaration; `aggregation.privacy` and `local.record_privacy` implement what they set, `checks.ConfigChecks`'s
`_privacy_errors` and `_record_privacy_errors` check them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .results import ResultHelp


@dataclass
class PrivacyFields:
    r"""
    The differential-privacy fields of [`FedGRPOConfig`]: client-level DP of the global adapters the server releases,
    and record-level DP of each client's prompts in its local steps.

    Parameters:
        > Differential privacy: client-level, of the global adapters the server releases (docs/privacy.md)

        dp_noise_multiplier (`float` or `None`, *optional*):
            Noise multiplier σ of client-level differential privacy, which it turns on: the server clips each
            client's update θ_i − θ to `dp_clip_norm`, adds Gaussian noise of std σ × 2 C max_i ω_i to the weighted sum
            Δ (its sensitivity when one client is replaced, the weights fixed by public or already released values)
            and steps on the noised Δ; under RPG, each R̄ is released through its own Gaussian mechanism first
            (`dp_reward_noise_multiplier`). An RDP accountant (`dp-accounting`, as Flower's) composes every round
            with the sampling the run does (`fraction_train`) and reports ε at `dp_target_delta`. SCAFFOLD (its
            controls are per-client state the noise does not cover) and `robust_aggregation` are refused. `None`: no
            DP, and the server draws no random number.
        dp_clip_norm (`float`, *optional*, defaults to `0.6`):
            Clip norm C of each client's update under DP, in the unit of `update_norm_bound` (`local_steps` ×
            `learning_rate` × √d), near which honest Adam-family updates stay: a lower C clips more updates and
            needs less noise for the same σ. The default is about the median update norm measured on the
            quickstart's model and data (docs/privacy.md), so that about half the updates are clipped; with
            `dp_adaptive_clipping`, the clip norm the first round starts from.
        dp_adaptive_clipping (`bool`, *optional*, defaults to `False`):
            Adapt C every round toward the `dp_target_quantile` of the clients' update norms (Andrew et al., NeurIPS
            2021, as Flower's `DifferentialPrivacyServerSideAdaptiveClipping`): the count of updates C left
            unclipped is released with Gaussian noise (`dp_clipped_count_stddev`) and C moves geometrically by
            `dp_clip_norm_lr`. The count's release is accounted: Δ's noise multiplier rises so that the round costs
            what `dp_noise_multiplier` alone would, and ε is unchanged.
        dp_target_quantile (`float`, *optional*, defaults to `0.5`):
            γ, the share of the clients' updates that adaptive clipping aims to leave unclipped (Flower's
            `target_clipped_quantile`): C tracks the γ-quantile of their norms. 0.5, the median, as Andrew et al.
        dp_clip_norm_lr (`float`, *optional*, defaults to `0.2`):
            η_C, the learning rate of adaptive clipping's geometric update C ← C · exp(−η_C (b̃ − γ)), as Andrew et
            al. and Flower's `clip_norm_lr`.
        dp_clipped_count_stddev (`float` or `None`, *optional*):
            σ_b, the std of the Gaussian noise on the count of unclipped updates (Flower's `clipped_count_stddev`);
            it must exceed `dp_noise_multiplier`. `None`: max(m / 20, 2σ) for m clients sampled a round: Andrew et
            al.'s m / 20 (Flower's default), or where a small federation cannot afford it, 2σ, which raises Δ's
            noise by 15%.
        dp_reward_noise_multiplier (`float` or `None`, *optional*):
            Noise multiplier σ_R of R̄'s release under DP with `aggregation="rpg"`: each client's R̄, clamped to the
            reward functions' declared range B, gets Gaussian noise of std σ_R × B before RPG weighs it; the
            accountant composes both releases of a round as one. `None`: `dp_noise_multiplier`.
        dp_target_delta (`float`, *optional*, defaults to `1e-5`):
            δ at which ε is reported, well below 1 / `num_clients` as client-level DP needs.
        dp_max_epsilon (`float` or `None`, *optional*):
            Privacy budget: the run ends, with its checkpoint, final adapter and model card, after the last round
            whose ε at `dp_target_delta` stays within it (fewer than `num_rounds` if need be). `None`: no budget.
        dp_noise_seed (`int` or `None`, *optional*):
            Seed of the DP noise, whose generators are the server's own (no other random stream moves). Whoever knows
            it can remove the noise: leave it `None` (a seed drawn from the operating system, kept in the
            checkpoints) except for tests and reproducible experiments. A resumed run mixes fresh randomness of its own
            into the noise (recorded in dp-releases.jsonl), so its noise is not the uninterrupted run's.
            It also seeds record-level DP's noise and sampling on the clients (with the round and client).

        > Differential privacy: record-level, of each client's prompts, in its local steps (docs/privacy.md)

        dp_record_noise_multiplier (`float` or `None`, *optional*):
            Noise multiplier σ of record-level DP-SGD in every client's local steps, a record being one prompt with
            its group of completions: each record's gradient is clipped to `dp_record_clip_norm` C, their sum gets
            Gaussian noise of std 2σC, prompts are sampled without replacement from a secret generator, and R̄ is
            released with noise; each client accounts its own ε and reports it. `None`: off, unless
            `dp_record_epsilon` is set. Composes with client-level DP (`dp_noise_multiplier`).
        dp_record_epsilon (`float` or `None`, *optional*):
            Record-level privacy budget ε at `dp_target_delta` of each client over the run: each client calibrates σ
            to its own data size so that `num_rounds` rounds stay within it. Exclusive with
            `dp_record_noise_multiplier`.
        dp_record_clip_norm (`float`, *optional*, defaults to `0.5`):
            C, the norm each record's gradient is clipped to: about the median of the non-zero per-record gradient
            norms of the quickstart's LoRA, so that clipping bounds the large ones without shrinking the typical
            (`benchmarks/record_dp_step.py`). The noise-to-signal ratio does not depend on it.
        dp_record_reward_noise_multiplier (`float` or `None`, *optional*):
            σ_R of R̄'s release under record-level DP: each of the last `reward_window` step rewards, clamped to the
            reward functions' declared range B, gets noise of std σ_R × B / b (b prompts a step) with its sampled
            step, and R̄ is their mean. `None`: the noise multiplier σ.
    """

    dp_noise_multiplier: float | None = field(
        default=None,
        metadata={
            "help": ResultHelp(
                "Noise multiplier σ of client-level differential privacy, which it turns on: updates clipped to "
                "`dp_clip_norm`, Gaussian noise of std σ x 2 C max_i ω_i on their weighted sum before the server "
                "step, R̄ released through its own Gaussian mechanism under RPG, and ε reported every round. Not "
                "with SCAFFOLD or `robust_aggregation`. None: no DP."
            )
        },
    )
    dp_clip_norm: float = field(
        default=0.6,
        metadata={
            "help": ResultHelp(
                "Clip norm C of each client's update under DP, in the unit of `update_norm_bound` (local_steps x "
                "learning_rate x sqrt(d)), near which honest Adam-family updates stay; the first round's C with "
                "dp_adaptive_clipping. 0.6: about the median update norm measured on the quickstart, so that "
                "clipping bites on about half the updates."
            )
        },
    )
    dp_adaptive_clipping: bool = field(
        default=False,
        metadata={
            "help": ResultHelp(
                "Adapt the clip norm each round toward the dp_target_quantile of the clients' update norms (Andrew "
                "et al., 2021, as Flower's adaptive-clipping wrapper), from dp_clip_norm: the count of unclipped "
                "updates is released with noise and accounted, at the same ε for the same dp_noise_multiplier."
            )
        },
    )
    dp_target_quantile: float = field(
        default=0.5,
        metadata={
            "help": ResultHelp(
                "γ, the share of updates adaptive clipping aims to leave unclipped: C tracks the γ-quantile of the "
                "update norms (Flower's target_clipped_quantile)."
            )
        },
    )
    dp_clip_norm_lr: float = field(
        default=0.2,
        metadata={
            "help": ResultHelp(
                "η_C, the learning rate of adaptive clipping's geometric update C <- C exp(−η_C (b̃ − γ)) "
                "(Flower's clip_norm_lr; Andrew et al.'s 0.2)."
            )
        },
    )
    dp_clipped_count_stddev: float | None = field(
        default=None,
        metadata={
            "help": ResultHelp(
                "σ_b, the std of the noise on adaptive clipping's count of unclipped updates (Flower's "
                "clipped_count_stddev); above dp_noise_multiplier. None: max(m/20, 2σ) for m clients a round."
            )
        },
    )
    dp_reward_noise_multiplier: float | None = field(
        default=None,
        metadata={
            "help": ResultHelp(
                "Noise multiplier σ_R of R̄'s release under DP with RPG: Gaussian noise of std σ_R x the reward "
                "range on each clamped R̄ before RPG weighs it. None: dp_noise_multiplier."
            )
        },
    )
    dp_target_delta: float = field(
        default=1e-5,
        metadata={"help": "δ at which ε is reported under DP; keep it well below 1 / num_clients."},
    )
    dp_max_epsilon: float | None = field(
        default=None,
        metadata={
            "help": "Privacy budget under DP: the run ends, checkpointed and saved, after the last round whose ε "
            "stays within it. None: no budget."
        },
    )
    dp_noise_seed: int | None = field(
        default=None,
        metadata={
            "help": "Seed of the DP noise's own generators. Whoever knows it can remove the noise: None draws one "
            "from the operating system and keeps it in the checkpoints; set it only for tests and experiments."
        },
    )

    # Differential privacy, record-level (`local.record_privacy`)
    dp_record_noise_multiplier: float | None = field(
        default=None,
        metadata={
            "help": ResultHelp(
                "σ of record-level DP-SGD in the clients' local steps (a record: one prompt with its completions): "
                "per-record clipping to dp_record_clip_norm, noise of std 2σC, secret sampling, R̄ noised, ε per "
                "client. None: off, unless dp_record_epsilon."
            )
        },
    )
    dp_record_epsilon: float | None = field(
        default=None,
        metadata={
            "help": ResultHelp(
                "Record-level budget ε at dp_target_delta of each client over the run: each client calibrates σ to "
                "its own data size. Exclusive with dp_record_noise_multiplier."
            )
        },
    )
    dp_record_clip_norm: float = field(
        default=0.5,
        metadata={
            "help": ResultHelp(
                "C, the norm each record's gradient is clipped to under record-level DP: about the median of the "
                "non-zero per-record norms of the quickstart's LoRA, so that it clips the large ones only."
            )
        },
    )
    dp_record_reward_noise_multiplier: float | None = field(
        default=None,
        metadata={
            "help": ResultHelp(
                "σ_R of R̄'s release under record-level DP: noise of std σ_R x reward range / prompts a step on each "
                "step reward of the window, R̄ their mean. None: σ."
            )
        },
    )
