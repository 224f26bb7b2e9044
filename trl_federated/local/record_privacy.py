"""Record-level differential privacy of a client's local steps: DP-SGD (Abadi et al., CCS 2016) on the trainable
(LoRA) parameters, where a record is one prompt of the client's data with its group of G completions.

In every optimizer step of a client round, over the b prompts of its generation batch:

    records   b of the client's N prompts, uniformly without replacement, from a generator only the client seeds
              (`RecordSampler`; TRL's own sampler shuffles with the run's `seed`, which the server and the others know)
    g_r  = ∇ℓ_r(θ)                      ℓ_r: the trainer's own loss on record r's G completions alone
    ḡ_r  = g_r · min(1, C / ‖g_r‖)      (per-record clipping, over every trainable parameter together)
    g̃    = (Σ_r ḡ_r + N(0, (2σC)² I)) / b

and the optimizer steps on g̃: `max_grad_norm` and Adam's normalisation are post-processing of it. Replacing one record
moves Σ_r ḡ_r by at most 2C, so σ is the noise multiplier of that replace-one sensitivity, as client-level DP's is
(`aggregation.privacy`). The client's report R̄ is the mean of its last W step rewards, each the mean of one batch's b
records' group means, which one record moves by at most B/b (B = R_max − R_min, the reward functions' declared range).
Each step's reward is released with that step's gradient, from the same sampled batch, and R̄ is their mean:

    R̃_e = clamp(R_e, R_min, R_max) + N(0, (σ_R B / b)²)        for each of the last W steps e
    R̃   = clamp(mean_e R̃_e, R_min, R_max)                       (post-processing: the server refuses R̄ out of range)

so that R̄'s release enjoys the sampling's amplification too (released once a round outside it, it would cost more
than every step's gradient at small b/N). No other number computed from the data leaves the client (step rewards,
loss and TRL's per-step metrics stay in its own logs). FedProx's and SCAFFOLD's loss terms do not read the data: they
join g̃ after the noise.

Accounting, per client, with `dp_accounting`'s RDP accountant under replace-one (N is public): each generation batch is
a `SampledWithoutReplacementDpEvent(N, b, ·)` of the Gaussians its `num_iterations` optimizer steps release, with
theirs of the step reward (σ_R) where R̄ is released: every step is counted as releasing its reward, an upper bound of
the W that do. The client appends every round's releases to its own ledger (`RECORD_LEDGER`, in its output folder)
before the update leaves it and reports ε at `dp_target_delta` over the whole ledger (`RECORD_EPSILON` in its
metrics); the server reports the worst (`dp_record_epsilon_worst`). With the budget `dp_record_epsilon`, each client
calibrates σ to its own N so that `num_rounds` rounds, every one of them with this client, stay within it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import secrets
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Sampler

from ..aggregation import ClientUpdate
from ..aggregation.privacy import RECORD_EPSILON, append_ledger_line, load_dp_accounting
from ..runtime.master_weights import linear_term
from .shared_prefix import rows_of
from .speedups import TrainerMixin

# The file, in a client's output folder, that holds one JSON line per round of record-level releases.
RECORD_LEDGER = "record-dp-releases.jsonl"
# The column that `RecordPrivacyMixin` adds to a generation batch: the record (prompt group) of every row.
RECORD_INDEX = "record_index"


class RecordSampler(Sampler[int]):
    """TRL's `RepeatSampler` layout (each prompt `mini_repeat_count` times in a row, each batch `repeat_count` times),
    except that every batch of `batch_size` prompts is a fresh uniform sample without replacement of the
    `num_records`, drawn from `generator`: the sampling the accountant's amplification assumes, secret to the
    client. An epoch is `num_records // batch_size` batches, as TRL's."""

    def __init__(self, num_records: int, batch_size: int, mini_repeat_count: int, repeat_count: int,
                 generator: torch.Generator):
        if not 0 < batch_size <= num_records:
            raise ValueError(f"Record-level DP samples {batch_size} prompts a generation batch from a client's "
                             f"{num_records}: a client needs at least as many prompts as a batch holds.")
        self.num_records, self.batch_size = num_records, batch_size
        self.mini_repeat_count, self.repeat_count = mini_repeat_count, repeat_count
        self.generator = generator

    def __iter__(self):
        for _ in range(self.num_records // self.batch_size):
            batch = torch.randperm(self.num_records, generator=self.generator)[: self.batch_size].tolist()
            for _ in range(self.repeat_count):
                for index in batch:
                    yield from [index] * self.mini_repeat_count

    def __len__(self) -> int:
        return (self.num_records // self.batch_size) * self.batch_size * self.mini_repeat_count * self.repeat_count


def secret_generator(args, stream: str, ordinal: int) -> torch.Generator:
    """A generator for one stream of a client round's draws ("noise", "sampling"). Seeded from the operating system,
    unless `dp_noise_seed` is set (tests, experiments): then from it, the round's seed (`args.seed`, a function of the
    round and the client) and `ordinal`, the count of rounds this client's ledger holds, so that a redone round draws
    afresh."""
    noise_seed = getattr(args, "dp_noise_seed", None)
    if noise_seed is None:
        return torch.Generator().manual_seed(secrets.randbits(63))
    seed = random.Random(f"dp-record/{stream}/{noise_seed}/{args.seed}/{ordinal}").getrandbits(63)
    return torch.Generator().manual_seed(seed)


def read_ledger(path: Path) -> list[dict[str, Any]]:
    """The rounds a client's ledger holds, in order; [] without one. A torn last line (a crash while appending)
    counts as nothing was released then: the update it would have accounted never left the client."""
    if not path.exists():
        return []
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return entries


def round_releases(batches: int, dataset_size: int, sample_size: int, steps_per_batch: int, noise_multiplier: float,
                   step_reward_noise_multiplier: float | None) -> dict[str, Any]:
    """One client round's releases as its ledger keeps them (`step_reward_noise_multiplier`: σ_R of every step's
    reward, released with the step's gradient; None where R̄ is not released)."""
    return {
        "generation_batches": batches, "dataset_size": dataset_size, "sample_size": sample_size,
        "steps_per_batch": steps_per_batch, "noise_multiplier": noise_multiplier,
        "step_reward_noise_multiplier": step_reward_noise_multiplier,
    }


def ledger_event(entries: list[dict[str, Any]]):
    """The `dp_accounting` event of every round of `entries` (`round_releases`): each generation batch the Gaussians
    of its `steps_per_batch` steps (gradient, and step reward where released) on a sample of b of N drawn without
    replacement."""
    dp_event, _, _ = load_dp_accounting()
    runs: list[tuple[dict[str, Any], int]] = []  # equal rounds in a row, composed once with their count
    for entry in entries:
        if runs and runs[-1][0] == entry:
            runs[-1] = (entry, runs[-1][1] + 1)
        else:
            runs.append((entry, 1))
    events = []
    for entry, rounds in runs:
        step = [dp_event.GaussianDpEvent(entry["noise_multiplier"])]
        if entry["step_reward_noise_multiplier"] is not None:
            step.append(dp_event.GaussianDpEvent(entry["step_reward_noise_multiplier"]))
        steps = dp_event.SelfComposedDpEvent(dp_event.ComposedDpEvent(step), entry["steps_per_batch"])
        batch = dp_event.SampledWithoutReplacementDpEvent(entry["dataset_size"], entry["sample_size"], steps)
        events.append(dp_event.SelfComposedDpEvent(batch, entry["generation_batches"] * rounds))
    return dp_event.ComposedDpEvent(events)


def record_accountant():
    """A fresh RDP accountant under replace-one, the relation of sampling without replacement (N public)."""
    _, privacy_accountant, rdp = load_dp_accounting()
    return rdp.RdpAccountant(neighboring_relation=privacy_accountant.NeighboringRelation.REPLACE_ONE)


def ledger_epsilon(entries: list[dict[str, Any]], delta: float) -> float:
    """ε at δ of a client's records over every round of `entries`; 0 before any."""
    if not entries:
        return 0.0
    return record_accountant().compose(ledger_event(entries)).get_epsilon(delta)


@functools.cache
def calibrated_noise_multiplier(target_epsilon: float, delta: float, num_rounds: int, batches_per_round: int,
                                dataset_size: int, sample_size: int, steps_per_batch: int,
                                reward_noise_multiplier: float | None) -> float:
    """The least σ (dp_accounting's calibration) whose `num_rounds` rounds of releases (`round_releases`) stay within
    ε = `target_epsilon` at δ, step rewards released with σ_R = `reward_noise_multiplier`, or σ itself when None."""
    from dp_accounting import mechanism_calibration

    def run_event(sigma: float):
        entry = round_releases(batches_per_round, dataset_size, sample_size, steps_per_batch, sigma,
                               reward_noise_multiplier or sigma)
        return ledger_event([entry] * num_rounds)

    try:
        return float(mechanism_calibration.calibrate_dp_mechanism(
            record_accountant, run_event, target_epsilon, delta,
            mechanism_calibration.LowerEndpointAndGuess(1e-2, 1.0),
        ))
    except mechanism_calibration.NoBracketIntervalFoundError as error:
        raise ValueError(
            f"No noise multiplier keeps the records' ε within dp_record_epsilon={target_epsilon:g} at δ = {delta:g} "
            f"over {num_rounds} rounds: the step rewards' releases alone exceed it (dp_record_reward_noise_multiplier"
            f"={reward_noise_multiplier}); raise that or the budget."
        ) from error


def record_noise_multiplier(args, dataset_size: int, sample_size: int) -> float:
    """σ of a client with `dataset_size` prompts sampled `sample_size` a generation batch: `dp_record_noise_multiplier`,
    or calibrated to `dp_record_epsilon` over the run's `num_rounds` rounds of `local_steps` steps."""
    if args.dp_record_noise_multiplier is not None:
        return args.dp_record_noise_multiplier
    return calibrated_noise_multiplier(
        args.dp_record_epsilon, args.dp_target_delta, args.num_rounds,
        math.ceil(args.local_steps / args.num_iterations), dataset_size, sample_size, args.num_iterations,
        args.dp_record_reward_noise_multiplier,
    )


class RecordPrivacyMixin(TrainerMixin):
    """DP-SGD with one record per prompt group for a client's trainer (see the module's docstring); first among the
    bases, before `local_trainer.LocalGRPOMixin`, which `local_trainer(trainer_class, args)` arranges when `args`
    turns record-level DP on. It relies on TRL's `_get_train_sampler` (replaced by `RecordSampler`) and
    `_generate_and_score_completions` (whose rows it labels with their record before TRL shuffles them), and computes
    each record's loss with `LocalGRPOMixin.data_loss`, the loss of the class it extends, and adds the federation's loss
    terms (`LocalGRPOMixin.callback_loss_terms`: FedProx, SCAFFOLD), which read no data, after the noise."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.accelerator.num_processes > 1 or self.is_deepspeed_enabled:
            raise ValueError(
                "Record-level DP (dp_record_noise_multiplier, dp_record_epsilon) clips each record's gradient in one "
                "process: run each client on one device, without DeepSpeed."
            )
        self.ledger_path = Path(self.args.output_dir) / RECORD_LEDGER
        self.rounds_before = len(read_ledger(self.ledger_path))
        self.records_per_batch = self.args.generation_batch_size // self.num_generations
        self.record_noise_multiplier = record_noise_multiplier(self.args, len(self.train_dataset),
                                                               self.records_per_batch)
        # σ_R of the step rewards' release: its own field, else σ (as the calibration assumes)
        self.step_reward_noise_multiplier = self.args.dp_record_reward_noise_multiplier or self.record_noise_multiplier
        self.record_clip_norm = self.args.dp_record_clip_norm
        self.noise_generator = secret_generator(self.args, "noise", self.rounds_before)
        self.generation_batches = 0  # sampled generation batches trained on this round, the ledger's count
        self.record_gradients: dict[int, list[torch.Tensor]] = {}
        self.micro_batches = 0
        self.record_norms: list[list[float]] = []  # per optimizer step: ‖g_r‖ of its records, before clipping

    def _get_train_sampler(self, dataset=None) -> Sampler:
        return RecordSampler(
            len(self.train_dataset if dataset is None else dataset), self.records_per_batch, self.num_generations,
            self.num_iterations * self.args.steps_per_generation,
            secret_generator(self.args, "sampling", self.rounds_before),
        )

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            rows = output["completion_ids"].size(0)
            output[RECORD_INDEX] = torch.arange(rows) // self.num_generations
            self.generation_batches += 1
        return output

    @property
    def private_parameters(self) -> list[torch.Tensor]:
        return [param for param in self.model.parameters() if param.requires_grad]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """In training: each record's gradient of the extended class's loss on its rows alone, summed over the
        micro-batches of the optimizer step; at the step's last micro-batch, g̃ from their clipped sum, as a loss
        term whose gradient it is (`master_weights.linear_term`), with the federation's loss terms. The value is the
        mean record loss, as the trainer logs it."""
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = dict(inputs)
        record_index = inputs.pop(RECORD_INDEX)
        params = self.private_parameters
        accumulation = self.current_gradient_accumulation_steps
        kept = [param.grad for param in params]
        losses = []
        for record in record_index.unique().tolist():
            rows = record_index == record
            record_inputs = {key: rows_of(value, rows) for key, value in inputs.items()}
            if "num_items_in_batch" in record_inputs:  # DAPO-style losses normalise by the tokens of their batch
                tokens = inputs["completion_mask"][rows].sum()
                record_inputs["num_items_in_batch"] = tokens * self.args.steps_per_generation
            for param in params:
                param.grad = None
            # The class's loss is scaled for gradient accumulation: × accumulation, ℓ_r is the record's own mean.
            loss = self.data_loss(model, record_inputs) * accumulation
            loss.backward()
            gradient = [torch.zeros_like(param) if param.grad is None else param.grad for param in params]
            partial = self.record_gradients.get(record)
            self.record_gradients[record] = gradient if partial is None else torch._foreach_add(partial, gradient)
            losses.append(loss.detach())
        for param, grad in zip(params, kept):
            param.grad = grad
        self.micro_batches += 1
        value = torch.stack(losses).mean() / (accumulation if self.loss_is_scaled_for_ga else 1)
        if self.micro_batches < accumulation:  # no gradient yet: the step's records may have rows still to come
            return value + sum(param.sum() for param in params) * 0.0 + self.callback_loss_terms()
        private = self.private_gradient()
        # The trainer divides an unscaled loss by the accumulation steps; g̃ is the whole step's gradient.
        term = linear_term(params, private if self.loss_is_scaled_for_ga else torch._foreach_mul(private, accumulation))
        return value + term + self.callback_loss_terms()

    def private_gradient(self) -> list[torch.Tensor]:
        """g̃ = (Σ_r ḡ_r + N(0, (2σC)² I)) / b over the records of the step now ending; resets for the next."""
        if len(self.record_gradients) != self.records_per_batch:
            raise RuntimeError(f"An optimizer step held {len(self.record_gradients)} records, not the "
                               f"{self.records_per_batch} of a generation batch: record-level DP needs "
                               "steps_per_generation = gradient_accumulation_steps.")
        clip, total, norms = self.record_clip_norm, None, []
        for gradient in self.record_gradients.values():
            norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gradient))))
            norms.append(norm)
            scaled = torch._foreach_mul(gradient, min(1.0, clip / norm) if norm > 0 else 1.0)
            total = scaled if total is None else torch._foreach_add(total, scaled)
        std = 2 * self.record_noise_multiplier * clip
        for value in total:
            value.add_(torch.randn(value.shape, generator=self.noise_generator, dtype=value.dtype), alpha=std)
        self.record_norms.append(norms)
        self.record_gradients, self.micro_batches = {}, 0
        return torch._foreach_div(total, self.records_per_batch)

    def account_round(self, reward_noise_multiplier: float | None) -> float:
        """Append this round's releases (`round_releases`; step rewards released with `reward_noise_multiplier`,
        None: not released) to the ledger, flushed before anything leaves, and return ε at `dp_target_delta` over
        it all."""
        entry = round_releases(self.generation_batches, len(self.train_dataset), self.records_per_batch,
                               self.num_iterations, self.record_noise_multiplier, reward_noise_multiplier)
        entries = [*read_ledger(self.ledger_path), entry]
        append_ledger_line(self.ledger_path, entry)
        return ledger_epsilon(entries, self.args.dp_target_delta)


# What a client sends in its metrics under record-level DP besides its ε: when it trained, which reads no record.
PUBLIC_METRICS = ("train_seconds", "wall_clock")


def private_update(update: ClientUpdate, trainer: RecordPrivacyMixin,
                   reward_range: tuple[float, float] | None) -> ClientUpdate:
    """`update` as it leaves a client under record-level DP: R̃ for R̄, no metric computed from the data, and the
    client's ε over its ledger, to which this round's releases are appended first."""
    if reward_range is None:
        raise ValueError(
            "Record-level DP releases R̄ clamped to the reward functions' declared range, and they declare none: give "
            "every reward function a `reward_range` attribute (`trl_federated.scoring.rewards`)."
        )
    args = trainer.args
    reward_noise_multiplier = trainer.step_reward_noise_multiplier
    low, high = reward_range
    window = trainer.window_rewards()
    noise = torch.randn(len(window), generator=secret_generator(args, "reward", trainer.rounds_before),
                        dtype=torch.float64)
    scale = reward_noise_multiplier * (high - low) / trainer.records_per_batch
    # A step whose rewards scored nothing (NaN) counts as R_min; clamped again after the noise (post-processing).
    released = [min(max(reward, low), high) if math.isfinite(reward) else low for reward in window]
    mean = sum(value + scale * float(draw) for value, draw in zip(released, noise)) / len(window)
    reward = min(max(mean, low), high)
    metrics = {name: update.metrics[name] for name in PUBLIC_METRICS if name in update.metrics}
    metrics[RECORD_EPSILON] = trainer.account_round(reward_noise_multiplier)
    return dataclasses.replace(update, reward=reward, metrics=metrics)
