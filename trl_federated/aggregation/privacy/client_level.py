"""Client-level differential privacy of the aggregation (DP-FedAvg, McMahan et al., ICLR 2018), for every weighting
the server applies, RPG's included, with an RDP accountant from Google's `dp-accounting` (as Flower's).

In round t the server samples m of the N clients without replacement (`sampling.sample_clients`); over the n whose
updates it aggregates:

    ū_i = u_i · min(1, C / ‖u_i‖),   u_i = θ_i − θ                                    (clipping, on the server)
    R̃_i = clamp(R̄_i, R_min, R_max) + N(0, (σ_R B)²),   B = R_max − R_min             (RPG only: R̄'s own release)
    ω   = the method's weights, from R̃ (RPG) or the sample counts (FedAvg, FedProx)
    Δ̃   = Σ_i ω_i ū_i + N(0, (σ S)² I),   S = 2 C max_i ω_i                          (the weighted sum's release)

and the server optimizer steps on Δ̃: Adam's normalisation is post-processing of a private release. With adaptive
clipping (`AdaptiveClipping`), C itself follows a noised count of the updates it left unclipped, released and
accounted with the round.

Sensitivity, under the replace-one relation the accountant uses for sampling without replacement (N public): the
weights are fixed by what is already released (R̃, through its own mechanism) or public (sample counts, who replied),
so replacing client j changes one term of the sum, ω_j (ū_j − ū_j'), by at most 2 ω_j C ≤ 2 C max_i ω_i = S; and one
coordinate of the R̄ vector by at most B. Both releases of a round share its sample: the accountant composes them as
one sampled Gaussian of noise multiplier (σ⁻² + σ_R⁻²)^(-1/2) (`dp_accounting`'s `ComposedDpEvent`), whose ε at δ is
reported after every round. docs/privacy.md derives the bound on max_i ω_i that RPG's h_max and τ give.

The noise comes from its own generators, seeded from a secret noise seed, the round and the release's ordinal, never
from torch's global one: a run without DP draws nothing here. Every release is appended to a ledger outside the
checkpoints (`release_log`, `dp-releases.jsonl` in the output folder) before its adapter can leave the server, and the
ordinal is the count of releases that ledger holds: a round redone after its release (a resume from an earlier
checkpoint, or after a crash between the release and its checkpoint) is counted again in ε. Each checkpoint carries the
ledger up to itself, which the file must start with (a missing one is started from it, a differing one refused), and a
resumed process mixes fresh randomness of its own into the noise (`session`, recorded with each release), so that no
two releases share noise that their difference would cancel, even when the ledger lacks releases made after the
checkpoint (a resume into another output folder). Entries the clients never change (LoRA A under
`lora_aggregation: freeze_a`) take no noise. The clients sampled each round are drawn from a secret derived from the
noise seed (`sampling_seed`), not from the run's `seed` that clients may know: the sampling amplification the
accountant counts on holds against them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...adapters import AdapterState, scaled_update, state_distance
from ..update import RoundMetric
from .adaptive_clipping import AdaptiveClipping
from .ledger import append_ledger_line, load_dp_accounting
from .release_ledger import DamagedLedgerError, add_run, costlier_event, read_ledger

if TYPE_CHECKING:
    from ..update import ClientUpdate

logger = logging.getLogger(__name__)


class ClientLevelPrivacy:
    """The Gaussian mechanisms of one federation (see the module docstring) and their accountant.

    Args:
        noise_multiplier: σ, the std of Δ's noise in units of its sensitivity S; with `adaptive_clipping`, that of
            the round's releases together (Δ's own is then `update_noise_multiplier`, higher).
        clip_norm: C, the largest ‖θ_i − θ‖ that enters Δ; with `adaptive_clipping`, the first round's.
        num_clients: N, the population the rounds sample from.
        sample_size: m, the clients each round samples.
        reward_range: (R_min, R_max) for an aggregation that weighs by R̄ (RPG), whose R̄ is then released through its
            own mechanism; None for one that does not.
        reward_noise_multiplier: σ_R, the std of R̄'s noise in units of B (with `reward_range`).
        target_delta: δ at which ε is reported.
        max_epsilon: The budget: `affordable_rounds` stops before a round that would spend more (None: none).
        noise_seed: Seed of the noise; None draws one from the operating system, kept in `state_dict`.
        frozen_keys: Adapter entries no client can change (LoRA A under `freeze_a`): they take no noise, and the
            noise-to-signal floor counts the coordinates without them.
        release_log: The append-only ledger of every release (a JSON line each), outside the checkpoints; None keeps
            the releases in memory only (a caller that never resumes).
        adaptive_clipping: C's adaptation to the update norms (`AdaptiveClipping`); None keeps C fixed.
    """

    def __init__(
        self,
        noise_multiplier: float,
        clip_norm: float,
        num_clients: int,
        sample_size: int,
        reward_range: tuple[float, float] | None = None,
        reward_noise_multiplier: float | None = None,
        target_delta: float = 1e-5,
        max_epsilon: float | None = None,
        noise_seed: int | None = None,
        frozen_keys: frozenset[str] = frozenset(),
        release_log: str | Path | None = None,
        adaptive_clipping: AdaptiveClipping | None = None,
    ):
        if not noise_multiplier > 0 or not clip_norm > 0:
            raise ValueError(f"DP needs a noise multiplier and a clip norm > 0, got {noise_multiplier}, {clip_norm}.")
        if reward_range is not None and not (reward_noise_multiplier or 0) > 0:
            raise ValueError(f"R̄'s release needs a noise multiplier > 0, got {reward_noise_multiplier}.")
        if not 1 <= sample_size <= num_clients:
            raise ValueError(f"DP samples {sample_size} of {num_clients} clients: not a sample.")
        self.dp_event, privacy_accountant, self.rdp = load_dp_accounting()
        self.replace_one = privacy_accountant.NeighboringRelation.REPLACE_ONE
        self.noise_multiplier, self.clip_norm = noise_multiplier, clip_norm
        self.adaptive = adaptive_clipping
        self.update_noise_multiplier = (noise_multiplier if adaptive_clipping is None
                                        else adaptive_clipping.update_noise_multiplier(noise_multiplier))
        self.num_clients, self.sample_size = num_clients, sample_size
        self.reward_range = reward_range
        self.reward_noise_multiplier = reward_noise_multiplier if reward_range is not None else None
        self.target_delta, self.max_epsilon = target_delta, max_epsilon
        self.noise_seed = secrets.randbits(63) if noise_seed is None else noise_seed
        # Fresh randomness of this process, mixed into the noise once a checkpoint is resumed (`load_state_dict`);
        # None before: a run started afresh is reproducible from its noise seed alone.
        self.session: int | None = None
        self.frozen_keys = frozenset(frozen_keys)
        self.release_log = None if release_log is None else Path(release_log)
        self.releases = 0  # releases made so far, redone rounds included: the next one's noise ordinal
        # The rounds composed so far, as runs of identical events (a resumed run may change σ): [(event spec, count)].
        # ε is always computed from it, so that a resumed run reports the uninterrupted run's ε to the last bit.
        self.ledger: list[tuple[dict[str, Any], int]] = []
        # The releases as `release_log` holds them, where they differ from what `ledger` charges (a release logged
        # after a resumed checkpoint is charged as `costlier_event`); None: as `ledger`. The next resume checks the
        # file against it.
        self.logged: list[tuple[dict[str, Any], int]] | None = None
        self.last_epsilon: float | None = None
        self.last_noise_std: float | None = None
        self.last_rewards: dict[str, float] = {}
        # The round's count of updates left unclipped and of updates, kept for the count's release (never reported)
        self.unclipped: tuple[int, int] | None = None
        self.last_clip_norm: float | None = None  # the C that clipped the last round
        self.last_unclipped_share: float | None = None  # b̃, its released share of updates left unclipped

    # The mechanisms ------------------------------------------------------------------------------------------

    def generator(self, round_idx: int, stream: str) -> torch.Generator:
        """The generator of one stream of round `round_idx`'s noise ("rewards"; "delta/<key>", one per adapter tensor,
        so that a tensor's noise does not depend on the order of the others, which a checkpoint does not keep): a
        function of the noise seed, the round and the release's ordinal (`releases`), so that a redone round draws
        fresh noise (the separators keep seed 1, round 23 apart from seed 12, round 3)."""
        # A resumed process mixes in its own fresh `session`: the ledger it resumes may lack releases made after the
        # checkpoint elsewhere (another output folder, a ledger restored from a copy), whose ordinals it would repeat.
        session = "" if self.session is None else f"/{self.session}"
        key = f"dp-noise/{stream}/{self.noise_seed}/{round_idx}/{self.releases}{session}"
        seed = random.Random(key).getrandbits(63)
        return torch.Generator().manual_seed(seed)

    @property
    def sampling_seed(self) -> int:
        """The seed of the clients' sample each round: from the secret noise seed, so that no client can reproduce
        the draw the accountant's amplification by sampling assumes it cannot."""
        return random.Random(f"dp-sampling/{self.noise_seed}").getrandbits(63)

    def released_rewards(self, updates: list[ClientUpdate], round_idx: int) -> list[ClientUpdate]:
        """`updates` as the weighting sees them: with a reward range (RPG), copies whose R̄ is R̃, the clamped R̄ plus
        N(0, (σ_R B)²); the updates themselves (their R̄ recorded as reported) are left as they are."""
        if self.reward_range is None:
            return updates
        low, high = self.reward_range
        scale = self.reward_noise_multiplier * (high - low)
        noise = torch.randn(len(updates), generator=self.generator(round_idx, "rewards"), dtype=torch.float64)
        released = [
            dataclasses.replace(update, reward=min(max(float(update.reward), low), high) + scale * float(value))
            for update, value in zip(updates, noise)
        ]
        self.last_rewards = {update.client_id: update.reward for update in released}
        return released

    def clipped(self, global_state: AdapterState, client_states: list[AdapterState]) -> list[AdapterState]:
        """Each client's adapter with its update θ_i − θ scaled onto ‖·‖ ≤ C where it is longer; how many were not
        is kept for adaptive clipping's count (`unclipped`)."""
        norms = [state_distance(state, global_state) for state in client_states]
        self.unclipped = (sum(norm <= self.clip_norm for norm in norms), len(norms))
        return [
            state if norm <= self.clip_norm else scaled_update(state, global_state, self.clip_norm / norm)
            for state, norm in zip(client_states, norms)
        ]

    def noise_std(self, weights: list[float]) -> float:
        """σ_Δ S: S = 2 C max_i ω_i, the most one client's replacement moves Σ_i ω_i ū_i (σ_Δ = σ without adaptive
        clipping)."""
        return self.update_noise_multiplier * 2 * self.clip_norm * max(weights)

    def add_noise(self, delta: AdapterState, std: float, round_idx: int) -> None:
        """Add N(0, std²) to every coordinate of `delta` (a block of Δ in round `round_idx`), in place."""
        for key, value in delta.items():
            if key in self.frozen_keys:  # no client changes it: nothing to hide, and the release keeps it as seeded
                continue
            noise = torch.randn(value.shape, generator=self.generator(round_idx, f"delta/{key}"), dtype=value.dtype)
            value.add_(noise, alpha=std)

    # Accounting ----------------------------------------------------------------------------------------------

    def round_event(self) -> dict[str, Any]:
        """The release of one round, as the ledger records it (Δ's noise multiplier, and with adaptive clipping the
        count's, σ_b: the count's sensitivity is 1)."""
        event = {
            "noise_multiplier": self.update_noise_multiplier, "reward_noise_multiplier": self.reward_noise_multiplier,
            "sample_size": self.sample_size, "num_clients": self.num_clients,
        }
        if self.adaptive is not None:
            event["clipped_count_noise_multiplier"] = self.adaptive.count_stddev
        return event

    def dp_event_of(self, spec: dict[str, Any]):
        """`spec` (`round_event`) as a `dp_accounting` event: the Gaussian of Δ, composed with R̄'s and the clipped
        count's when there are, on a sample of m of N drawn without replacement."""
        gaussians = [self.dp_event.GaussianDpEvent(spec["noise_multiplier"])]
        for name in ("reward_noise_multiplier", "clipped_count_noise_multiplier"):
            if spec.get(name) is not None:
                gaussians.append(self.dp_event.GaussianDpEvent(spec[name]))
        return self.dp_event.SampledWithoutReplacementDpEvent(
            spec["num_clients"], spec["sample_size"], self.dp_event.ComposedDpEvent(gaussians)
        )

    def compose_round(self, noise_std: float, round_idx: int) -> None:
        """Account one released round, `round_idx`, whose Δ took noise of std `noise_std`; `last_epsilon` is then ε at
        δ over every round so far. With adaptive clipping the round also releases its count of updates left
        unclipped, whose noise is drawn like Δ's (this release's ordinal), and C moves for the next round."""
        self.last_noise_std, self.last_clip_norm = noise_std, self.clip_norm
        if self.adaptive is not None:
            noise = torch.randn(1, generator=self.generator(round_idx, "clipped_count"), dtype=torch.float64)
            self.last_unclipped_share, next_clip_norm = self.adaptive.step(self.clip_norm, *self.unclipped,
                                                                           float(noise))
        self.append_release(self.round_event())
        if self.adaptive is not None:
            self.clip_norm = next_clip_norm
        self.last_epsilon = self.epsilon_after(0)

    def append_release(self, event: dict[str, Any]) -> None:
        """Count one release in the ledger, and in `release_log` first (flushed to disk), so that a crash after it
        still counts it when the run resumes."""
        if self.release_log is not None:  # the session too: with the seed it reproduces the release's noise
            append_ledger_line(self.release_log, {"release": self.releases, "event": event, "session": self.session})
        self.releases += 1
        add_run(self.ledger, event)
        if self.logged is not None:
            add_run(self.logged, event)

    def read_release_log(self) -> list[dict[str, Any]]:
        """The events `release_log` holds, in order (`release_ledger.read_ledger`); [] without one."""
        return [] if self.release_log is None else read_ledger(self.release_log)

    def epsilon_after(self, more_rounds: int) -> float:
        """ε at δ were `more_rounds` rounds composed after those of the ledger (the ledger is left as it is)."""
        projected = self.rdp.RdpAccountant(neighboring_relation=self.replace_one)
        for event, count in self.ledger:
            projected.compose(self.dp_event_of(event), count)
        if more_rounds:
            projected.compose(self.dp_event_of(self.round_event()), more_rounds)
        return float(projected.get_epsilon(self.target_delta))

    def affordable_rounds(self, limit: int) -> int:
        """How many of the next `limit` rounds the budget `max_epsilon` allows (ε grows with every round)."""
        if self.max_epsilon is None or limit <= 0:
            return max(limit, 0)
        low, high = 0, limit  # the answer lies in [low, high]
        while low < high:
            middle = (low + high + 1) // 2
            if self.epsilon_after(middle) <= self.max_epsilon:
                low = middle
            else:
                high = middle - 1
        return low

    def round_metrics(self) -> list[RoundMetric]:
        """ε at δ after the round (`dp_epsilon`), the std of Δ's noise (`dp_noise_std`), when R̄ is released each
        client's R̃ (`dp_reward`), and with adaptive clipping the C that clipped the round (`dp_clip_norm`, in the
        update norms' own unit) and the released share b̃ of updates it left unclipped (`dp_unclipped_share`)."""
        metrics = [
            RoundMetric("dp_epsilon", "ε", self.last_epsilon, format=".3f"),
            RoundMetric("dp_noise_std", "σ_Δ", self.last_noise_std, format=".3g"),
        ]
        if self.reward_range is not None:
            metrics.append(RoundMetric("dp_rewards", "R̃", dict(self.last_rewards), per_client=True, format=".3f",
                                       log_name="dp_reward"))
        if self.adaptive is not None:  # released values: C follows b̃ alone
            metrics += [RoundMetric("dp_clip_norm", "C", self.last_clip_norm, format=".3g"),
                        RoundMetric("dp_unclipped_share", "b̃", self.last_unclipped_share, format=".2f")]
        return metrics

    def noise_to_signal_floor(self, num_coordinates: int) -> float:
        """The least ‖noise‖ / ‖Δ‖ any round can have, for an adapter of d = `num_coordinates`: the noise's norm is
        about σ_Δ S √d with S = 2 C ω_max ≥ 2 C / m (the largest of at most m weights summing to 1), while
        ‖Δ‖ = ‖Σ_i ω_i ū_i‖ ≤ C. Above 1, the noise outweighs every Δ the clients can send, however they agree."""
        return 2 * self.update_noise_multiplier * math.sqrt(num_coordinates) / self.sample_size

    def warn_of_noise_floor(self, num_coordinates: int) -> None:
        """Warn when DP's noise will outweigh whatever the clients send (`noise_to_signal_floor` above 1): then the
        run cannot learn, whatever the data, and it takes more clients a round or a smaller adapter. `num_coordinates`:
        the adapter's d; the server calls it as a run starts."""
        floor = self.noise_to_signal_floor(num_coordinates)
        if floor > 1:
            logger.warning(
                "Under differential privacy the noise on Δ will be at least %.3g times as long as any change the "
                "clients can make (‖noise‖ ≈ σ·2C·ω_max·√d ≥ 2σ√d/m with σ = %g, m = %d clients a round and d = %s "
                "adapter coordinates, against ‖Δ‖ ≤ C): this run cannot learn. The noise falls to the longest Δ's size "
                "only from %s clients a round at this σ, or with a smaller adapter (docs/privacy.md, 'What it "
                "costs').", floor, self.update_noise_multiplier, self.sample_size, f"{num_coordinates:,}",
                f"{math.ceil(floor * self.sample_size):,}",
            )

    def describe(self) -> str:
        """One line on the guarantee so far, for the model card."""
        epsilon = "no round released yet" if self.last_epsilon is None else f"ε = {self.last_epsilon:.3f}"
        rewards = "" if self.reward_range is None else f", R̄ released with σ_R = {self.reward_noise_multiplier:g}"
        clipping = f"clip norm {self.clip_norm:.4g}" if self.adaptive is None else (
            f"clip norm adapted to the {self.adaptive.target_quantile:g}-quantile of the update norms, "
            f"{self.clip_norm:.4g} after the last round, its count released with σ_b = {self.adaptive.count_stddev:g}")
        return (f"client-level, {epsilon} at δ = {self.target_delta:g} (replace-one, RDP accountant of "
                f"dp-accounting; {self.sample_size} of {self.num_clients} clients sampled a round, {clipping}, "
                f"noise multiplier {self.noise_multiplier:g}{rewards})")

    def state_dict(self) -> dict[str, Any]:
        state = {
            "noise_seed": self.noise_seed,
            "ledger": [{"event": dict(event), "rounds": count} for event, count in self.ledger],
        }
        if self.logged is not None:
            state["logged_ledger"] = [{"event": dict(event), "rounds": count} for event, count in self.logged]
        if self.adaptive is not None:  # the C the next round clips at
            state["clip_norm"] = self.clip_norm
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the noise seed, the ledger and, with adaptive clipping, C (a checkpoint of a run without it keeps
        the configured C), and draw this process's fresh `session` (logged), so that no release of the resumed run
        repeats the noise of one made before, wherever it was made.

        The checkpoint carries its ledger, and `release_log` must start with it: a file whose first releases differ
        (a σ rewritten, lines removed) is a `DamagedLedgerError` naming it, and a missing or empty one (a resume into
        another output folder) is started from the checkpoint's. Releases the file holds beyond the checkpoint's
        (made after it; a round redone on resume is then a further release) are counted too, each as the costlier of
        its logged event and this run's (`costlier_event`): the checkpoint cannot vouch for them."""
        def events(runs):
            return [dict(entry["event"]) for entry in runs for _ in range(int(entry["rounds"]))]

        checkpointed = events(state["ledger"])  # as charged
        expected = events(state.get("logged_ledger", state["ledger"]))  # as the file must hold them
        self.noise_seed = int(state["noise_seed"])
        if self.adaptive is not None and "clip_norm" in state:
            self.clip_norm = float(state["clip_norm"])
        logged = self.read_release_log()
        if self.release_log is None:  # no ledger kept (a caller that never resumes): the checkpoint's
            logged = list(expected)
        elif not logged and expected:
            logger.warning("The DP release ledger %s is missing or empty: starting it from the checkpoint's %d "
                           "releases (releases made after that checkpoint in another folder are not counted here).",
                           self.release_log, len(expected))
            for ordinal, event in enumerate(expected):
                append_ledger_line(self.release_log,
                                   {"release": ordinal, "event": event, "session": None, "from_checkpoint": True})
            logged = list(expected)
        elif (mismatch := next((ordinal for ordinal, event in enumerate(expected)
                                if ordinal >= len(logged) or logged[ordinal] != event), None)) is not None:
            found = "missing" if mismatch >= len(logged) else json.dumps(logged[mismatch], sort_keys=True)
            raise DamagedLedgerError(
                f"The DP release ledger {self.release_log} does not start with the {len(expected)} releases of the "
                f"checkpoint being resumed: release {mismatch} is {found} in the file, "
                f"{json.dumps(expected[mismatch], sort_keys=True)} in the checkpoint. The file was changed or belongs "
                "to another run: restore it, or resume into an empty output folder."
            )
        current = self.round_event()
        counted = checkpointed + [costlier_event(event, current) for event in logged[len(expected):]]
        self.ledger, self.releases = [], len(counted)
        for event in counted:
            add_run(self.ledger, event)
        self.logged = None
        if counted != logged:
            self.logged = []
            for event in logged:
                add_run(self.logged, event)
        self.last_epsilon = self.epsilon_after(0) if self.ledger else None
        self.session = secrets.randbits(63)
        if self.release_log is not None:  # the process that releases (other processes sync its state every round)
            logger.info("Resumed under DP after %d releases: this process draws fresh noise (session %x, recorded "
                        "with each release in %s), so no release repeats earlier noise; ε counts every release above.",
                        self.releases, self.session, self.release_log)
