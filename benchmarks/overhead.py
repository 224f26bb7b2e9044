"""Cost of federating: `FederatedRunner` (N clients x R rounds x E local steps) against plain `trl.GRPOTrainer`
doing the same N·R·E GRPO steps on the same model, LoRA, reward, data and batch settings.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py [--model tiny|smollm2] [--clients 3] [--rounds 2] \
        [--local_steps 4] [--repeats 3]

Both sides start from a freshly loaded base model (loading is not timed) that they wrap in the same LoRA
(`adapters.default_lora_config`); the plain trainer trains on the union of the clients' prompts. The two run
alternately in one process (plain first in even repeats, federated first in odd ones) after an untimed
warm-up, and the figure is the ratio of the median wall times, federated / plain. Target: <= 1.03. As the GRPO
steps do the same work on both sides but their times scatter (on the tiny model by more than the overhead), the
script also prints the ratio with the steps' time counted equal on both sides (median over the pairs), and
that ratio without the `gc.collect()` time of either side.

The federated time is split into phases with `time.perf_counter`, by wrapping from here the functions the
runner calls (nothing in the package is changed); each phase's time excludes the phases nested in it. The GRPO
steps themselves (from `on_step_begin` to `on_step_end`) are counted apart, on both sides, so that
"overhead" is everything else: building trainers, `train()`'s own setup and teardown, moving adapters in and
out of the model, validating updates, aggregating, writing `round-<t>` adapters and `checkpoint-<t>` folders,
round callbacks (metrics.jsonl), releasing trainers, evaluation (none here: no eval dataset).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import inspect
import itertools
import logging
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from harness.timing import alternated

MODELS = ("tiny", "smollm2")
# Module attributes the runner (or the client module split out of it) calls, wrapped by name when present.
TIMED_FUNCTIONS = {
    "set_adapter_state": "adapter get/set",
    "get_adapter_state": "adapter get/set",
    "validate_update": "update validation",
    "save_adapter": "adapter writes (round-<t>, final)",
}
# Methods of the runner's server (`trl_federated.core.server.FederatedServer`), wrapped by name when present.
TIMED_SERVER_METHODS = {
    "_fire": "round callbacks",
    "evaluate": "evaluation",
    "save_checkpoint": "checkpoint writes",
}
RUNNER_MODULES = ("trl_federated.runner", "trl_federated.local.client", "trl_federated.core.server")
GC_PHASE = "gc.collect() (Trainer.train, accelerate, runner)"


class PhaseTimer:
    """Wall time per named phase, each phase's time excluding the phases nested in it."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.total = 0.0  # wall time of the whole run
        self._stack: list[list] = []  # [phase, start, seconds of nested phases]

    @contextlib.contextmanager
    def phase(self, name: str):
        frame = [name, time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            elapsed = time.perf_counter() - frame[1]
            self.record(name, elapsed - frame[2])
            if self._stack:
                self._stack[-1][2] += frame[2]

    def record(self, name: str, seconds: float) -> None:
        """Add `seconds` to phase `name`, and take them out of the enclosing phase's own time."""
        self.seconds[name] += seconds
        self.calls[name] += 1
        if self._stack:
            self._stack[-1][2] += seconds

    def wrap(self, function, name: str):
        def timed(*args, **kwargs):
            with self.phase(name):
                return function(*args, **kwargs)

        return timed


def step_timer_callback(timer: PhaseTimer):
    """A `TrainerCallback` that times every optimisation step, generation included, as phase "GRPO steps"."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            timer.record("GRPO steps", time.perf_counter() - self.start)

    return StepTimer()


def timed_trainer_class(base, timer: PhaseTimer):
    """`base` with its construction and `train()` timed and its steps timed by `step_timer_callback`."""

    class TimedTrainer(base):
        def __init__(self, *args, **kwargs):
            with timer.phase("trainer construction"):
                super().__init__(*args, **kwargs)
                self.add_callback(step_timer_callback(timer))

        def train(self, *args, **kwargs):
            with timer.phase("train() setup and teardown"):
                return super().train(*args, **kwargs)

    return TimedTrainer


@contextlib.contextmanager
def patched(targets: list[tuple[object, str, object]]):
    """Set `setattr(owner, name, value)` for every target, and restore the originals on exit."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    try:
        for owner, name, value in targets:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


class Setup:
    """The model, data and GRPO settings that both sides share."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        from datasets import Dataset

        from trl_federated.runtime.models import load_model_and_tokenizer

        if args.model == "tiny":
            from trl_federated.testing import save_tiny_model

            self.model_path = str(save_tiny_model(workdir / "tiny-model"))
        else:
            self.model_path = None  # the embedded SmolLM2-135M-Instruct
        _, self.tokenizer = load_model_and_tokenizer(self.model_path)
        self.args = args
        prompts_per_client = max(8, args.local_steps * args.rounds)
        self.client_datasets = [
            Dataset.from_dict(
                {"prompt": [f"Client {c}, question {i}: what is {i} plus {c}?" for i in range(prompts_per_client)]}
            )
            for c in range(args.clients)
        ]
        self.union = Dataset.from_dict({"prompt": [row["prompt"] for d in self.client_datasets for row in d]})
        completion_length = args.max_completion_length or (12 if args.model == "tiny" else 48)
        generations = 4 if args.model == "tiny" else 8
        self.grpo_settings = dict(
            bf16=False,
            use_cpu=True,
            gradient_checkpointing=False,
            report_to="none",
            per_device_train_batch_size=generations,  # one prompt x `generations` completions per step
            num_generations=generations,
            max_completion_length=completion_length,
            learning_rate=1e-4,
            logging_steps=1,
            disable_tqdm=True,
            save_strategy="no",
            seed=0,
        )

    def fresh_model(self):
        from trl_federated.runtime.models import load_model_and_tokenizer

        return load_model_and_tokenizer(self.model_path)[0]


def length_reward(completions, **kwargs):
    """Varies on random text, so both sides take real gradient steps on any model."""
    return [min(len(completion), 64) / 64 for completion in completions]


def run_plain(setup: Setup, output_dir: Path) -> PhaseTimer:
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_federated.adapters import default_lora_config

    a = setup.args
    steps = a.clients * a.rounds * a.local_steps
    config = GRPOConfig(output_dir=str(output_dir), max_steps=steps, **setup.grpo_settings)
    model = setup.fresh_model()
    timer = PhaseTimer()
    gc.collect()
    start = time.perf_counter()
    with patched([(gc, "collect", timer.wrap(gc.collect, GC_PHASE))]):
        trainer = timed_trainer_class(GRPOTrainer, timer)(
            model=model,
            reward_funcs=length_reward,
            args=config,
            train_dataset=setup.union,
            processing_class=setup.tokenizer,
            peft_config=default_lora_config(),
        )
        trainer.remove_callback(PrinterCallback)  # the runner removes it from its clients' trainers too
        trainer.train()
    timer.total = time.perf_counter() - start
    _check_steps(trainer.state.global_step, steps)
    return timer


def run_federated(setup: Setup, output_dir: Path) -> PhaseTimer:
    from trl_federated import FederatedRunner, FedGRPOConfig

    a = setup.args
    config = FedGRPOConfig(
        output_dir=str(output_dir),
        num_rounds=a.rounds,
        local_steps=a.local_steps,
        reward_window=a.local_steps,
        **setup.grpo_settings,
    )
    model = setup.fresh_model()
    timer = PhaseTimer()
    # Every full collection walks all live Python objects (~450k after importing TRL): it is timed on its own.
    targets = [(gc, "collect", timer.wrap(gc.collect, GC_PHASE))]
    for module_name in RUNNER_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # trl_federated.local.client exists only once train_client moved there
            continue
        if hasattr(module, "FedGRPOTrainer"):  # a runner before `trainer_class` imported the trainer by name
            targets.append((module, "FedGRPOTrainer", timed_trainer_class(module.FedGRPOTrainer, timer)))
        targets += [
            (module, name, timer.wrap(getattr(module, name), phase))
            for name, phase in TIMED_FUNCTIONS.items()
            if hasattr(module, name)
        ]
    gc.collect()
    start = time.perf_counter()
    runner_kwargs = {}
    if "trainer_class" in inspect.signature(FederatedRunner).parameters:
        from trl_federated import FedGRPOTrainer

        runner_kwargs["trainer_class"] = timed_trainer_class(FedGRPOTrainer, timer)
    with patched(targets):
        with timer.phase("runner construction"):
            runner = FederatedRunner(
                model, length_reward, config, setup.client_datasets, processing_class=setup.tokenizer, **runner_kwargs
            )
        methods = [
            (runner.server, name, timer.wrap(getattr(runner.server, name), phase))
            for name, phase in TIMED_SERVER_METHODS.items()
            if hasattr(runner.server, name)
        ]
        methods.append((runner.aggregator, "aggregate", timer.wrap(runner.aggregator.aggregate, "aggregation")))
        with patched(methods), timer.phase("runner loop (rest)"):
            history = runner.run()
    timer.total = time.perf_counter() - start
    steps = sum(len(metrics["step_rewards"]) for record in history for metrics in record.client_metrics.values())
    _check_steps(steps, a.clients * a.rounds * a.local_steps)
    return timer


def _check_steps(steps: int, expected: int) -> None:
    if steps != expected:
        raise RuntimeError(f"Expected {expected} GRPO steps, ran {steps}: the two sides would not be comparable.")
    gc.collect()  # the finished run's garbage, before the next run's clock starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", choices=MODELS, default="tiny",
        help="tiny: the 2-layer Qwen2 of trl_federated.testing; smollm2: the embedded SmolLM2-135M-Instruct "
        "(~5-10 GiB RSS, seconds per GRPO step).",
    )
    parser.add_argument("--clients", type=int, default=3, help="N clients.")
    parser.add_argument("--rounds", type=int, default=2, help="R rounds.")
    parser.add_argument("--local_steps", type=int, default=4, help="E local GRPO steps per client and round.")
    parser.add_argument("--repeats", type=int, default=3, help="Timed runs per side, alternated.")
    parser.add_argument("--max_completion_length", type=int, default=None, help="Default: 12 (tiny), 48 (smollm2).")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads.")
    args = parser.parse_args()
    if min(args.clients, args.rounds, args.local_steps, args.repeats, args.threads) < 1:
        parser.error("--clients, --rounds, --local_steps, --repeats and --threads must all be positive.")
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        setup = Setup(args, workdir)
        # Untimed: imports, lazy initialisation and first-touch allocations of both code paths.
        warm = Setup(argparse.Namespace(**{**vars(args), "clients": 1, "rounds": 1, "local_steps": 1}), workdir)
        run_plain(warm, workdir / "warm-plain")
        run_federated(warm, workdir / "warm-federated")
        folders = itertools.count()  # every run writes to a folder of its own

        def side(name, run):
            return lambda: run(setup, workdir / f"{name}-{next(folders)}")

        timers = alternated({"plain": side("plain", run_plain), "federated": side("federated", run_federated)},
                            args.repeats)
    report(args, timers["plain"], timers["federated"])


def report(args: argparse.Namespace, plain: list[PhaseTimer], federated: list[PhaseTimer]) -> None:
    def median(timers, phase):
        return statistics.median(timer.seconds.get(phase, 0.0) for timer in timers)

    plain_total = statistics.median(timer.total for timer in plain)
    federated_total = statistics.median(timer.total for timer in federated)
    steps = args.clients * args.rounds * args.local_steps
    print(
        f"model={args.model}: {args.clients} clients x {args.rounds} rounds x {args.local_steps} local steps = "
        f"{steps} GRPO steps per side, {args.threads} thread(s), median of {args.repeats} alternated runs"
    )
    pairs = ", ".join(f"{f.total / p.total:.3f}" for f, p in zip(federated, plain))
    print(
        f"wall time: federated {federated_total:.2f} s, plain {plain_total:.2f} s, "
        f"ratio {federated_total / plain_total:.3f} (per-pair ratios: {pairs})"
    )
    # The GRPO steps do the same work on both sides; their times differ only by noise, often by more than the
    # overhead itself on the tiny model. Counting them equal on both sides gives the steadier figure; plain TRL's
    # own gc.collect() (one full collection per train()) is shown apart, as the runner avoids most of its cost.
    def normalised_ratio(excluded):
        return statistics.median(
            1 + ((f.total - sum(f.seconds[x] for x in excluded)) - (p.total - sum(p.seconds[x] for x in excluded)))
            / (p.total - sum(p.seconds[x] for x in excluded if x != "GRPO steps"))
            for f, p in zip(federated, plain)
        )

    print(
        f"ratio with the GRPO steps counted equal on both sides: {normalised_ratio(['GRPO steps']):.3f}; "
        f"and gc.collect() not counted on either side: {normalised_ratio(['GRPO steps', GC_PHASE]):.3f}"
    )
    phases = sorted(
        {phase for timer in federated + plain for phase in timer.seconds},
        key=lambda phase: (phase != "GRPO steps", -median(federated, phase)),
    )
    print("| phase | federated (s) | calls | plain (s) | calls | federated - plain (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for phase in phases:
        f, p = median(federated, phase), median(plain, phase)
        calls = federated[0].calls.get(phase, 0), plain[0].calls.get(phase, 0)
        print(f"| {phase} | {f:.3f} | {calls[0]} | {p:.3f} | {calls[1]} | {f - p:+.3f} |")
    print(f"| total | {federated_total:.3f} | | {plain_total:.3f} | | {federated_total - plain_total:+.3f} |")

if __name__ == "__main__":
    main()
