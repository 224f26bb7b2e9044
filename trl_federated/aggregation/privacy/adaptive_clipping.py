"""Adaptive clipping for client-level DP (`AdaptiveClipping`): the clip norm C follows a noised count of the updates
it left unclipped, released and accounted with the round (`client_level.ClientLevelPrivacy`)."""

from __future__ import annotations

import math

from ...config.checks import adaptive_clipping_errors


class AdaptiveClipping:
    """The clip norm as a private estimate of the γ-quantile of the clients' update norms (Andrew et al.,
    "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021, Algorithm 1 with the clipping on the
    server), with the parameters of Flower's `DifferentialPrivacyServerSideAdaptiveClipping`
    (`flwr.server.strategy.dp_adaptive_clipping`).

    In round t, over the n clients aggregated, their updates u_i clipped at C^t:

        b_i     = 1[‖u_i‖ ≤ C^t]                                  the update was left unclipped
        b̃       = (Σ_i b_i + N(0, σ_b²)) / n                      the count's release
        C^{t+1} = C^t · exp(−η_C (b̃ − γ))                         the geometric update (Algorithm 1)

    so that C falls while more than a share γ of updates fit under it, and rises while fewer do. Replacing one client
    moves Σ_i b_i by at most 1 (one b_i from 0 to 1), so the count is a Gaussian mechanism of noise multiplier σ_b on
    the round's sample, as Δ̃ is of σ_Δ; the pair costs what one Gaussian of (σ_Δ⁻² + σ_b⁻²)^(-1/2) would (Theorem 1),
    so that Δ's noise multiplier is raised for the round to cost what the configured σ alone would:

        σ_Δ = (σ⁻² − σ_b⁻²)^(-1/2)                                 (Theorem 1, for σ_b > σ)

    Andrew et al. and Flower's `compute_adaptive_noise_params` write (2σ_b)⁻²: under add-or-remove, the centred bit
    b_i − ½ moves the count by ½; under replace-one, the relation this accountant uses, it moves by 1. Two departures
    from Flower 1.42's wrapper, both for the paper's algorithm: b_i counts the updates left unclipped (Flower's counts
    those clipped, `adaptive_clip_inputs_inplace`, then applies the paper's update to it, which moves C away from the
    target), and Δ's noise is calibrated to the C^t that clipped the round (Flower's to C^{t+1}).

    Args:
        count_stddev: σ_b (Flower's `clipped_count_stddev`; `default_count_stddev`).
        target_quantile: γ, the share of updates to leave unclipped (Flower's `target_clipped_quantile`).
        learning_rate: η_C (Flower's `clip_norm_lr`).
    """

    def __init__(self, count_stddev: float, target_quantile: float = 0.5, learning_rate: float = 0.2):
        if errors := list(adaptive_clipping_errors(target_quantile, learning_rate, count_stddev, None)):
            raise ValueError(" ".join(errors))
        self.target_quantile, self.learning_rate, self.count_stddev = target_quantile, learning_rate, count_stddev

    @staticmethod
    def default_count_stddev(sample_size: int, noise_multiplier: float) -> float:
        """σ_b when none is set: Andrew et al.'s m / 20 (Flower's default: b̃ then has std 0.05), or where that is
        not above σ, as in a federation of a few clients a round, 2σ, which raises Δ's noise multiplier by
        (1 − ¼)^(-1/2) ≈ 1.15 and leaves b̃ a std of 2σ / n."""
        return max(sample_size / 20, 2 * noise_multiplier)

    def update_noise_multiplier(self, noise_multiplier: float) -> float:
        """σ_Δ for a round that costs what a Gaussian of `noise_multiplier` σ would (Theorem 1, above)."""
        if errors := list(adaptive_clipping_errors(self.target_quantile, self.learning_rate, self.count_stddev,
                                                   noise_multiplier)):
            raise ValueError(" ".join(errors))
        return (noise_multiplier**-2 - self.count_stddev**-2) ** -0.5

    def step(self, clip_norm: float, unclipped: int, count: int, noise: float) -> tuple[float, float]:
        """(b̃, C^{t+1}) after a round that left `unclipped` of `count` updates under `clip_norm`, the count's noise
        drawn as the standard normal `noise`."""
        released = (unclipped + self.count_stddev * noise) / count
        return released, clip_norm * math.exp(-self.learning_rate * (released - self.target_quantile))
