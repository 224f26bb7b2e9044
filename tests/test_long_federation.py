"""Nothing a client round does accumulates on the shared model: every client trainer patches the model's forward (TRL's
fused LM head), and a federation of R rounds x N clients must not run its forwards through R·N nested wrappers."""

import statistics
import time
from pathlib import Path

import pytest

from conftest import length_reward
from test_reliability import make_runner
from trl_federated import RoundCallback
from trl_federated.local.client import module_patches


def forward_depth(module) -> int:
    """How many forward wrappers (TRL's fused LM head keeps the forward it wrapped as `original_forward`) stand
    between `module.forward` and its class's forward."""
    forward, depth = module.forward, 0
    while getattr(forward, "__func__", None) is not None and forward.__func__.__closure__:
        cells = dict(zip(forward.__func__.__code__.co_freevars, forward.__func__.__closure__))
        if "original_forward" not in cells:
            break
        forward, depth = cells["original_forward"].cell_contents, depth + 1
    return depth


class ForwardDepth(RoundCallback):
    """Records, after every client round, the forward depth of the base model and the seconds of its local steps."""

    def __init__(self):
        self.depths, self.hooks, self.step_seconds = [], [], []

    def on_client_end(self, args, round_idx, update, **kwargs):
        self.depths.append(forward_depth(self.model.get_base_model()))
        self.hooks.append(hook_count(self.model))
        self.step_seconds.append(update.metrics["train_seconds"])


def run_federation(model_dir, output_dir, num_rounds, **overrides):
    probe = ForwardDepth()
    runner = make_runner(model_dir, output_dir, callbacks=[probe], num_rounds=num_rounds, save_every_round=False,
                         save_total_limit=1, reward_funcs=length_reward, **overrides)
    probe.model = runner.model
    before = module_patches(runner.model)
    runner.run()
    return runner, probe, before


def hook_count(model) -> int:
    """Forward and backward hooks on all modules of `model`."""
    return sum(
        len(hooks) for module in model.modules()
        for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks)
    )


def test_client_rounds_leave_the_shared_models_forwards_and_hooks_as_they_were(tmp_path, tiny_model_dir):
    # Gradient checkpointing: every trainer also hooks the input embeddings (`enable_input_require_grads`).
    runner, probe, before = run_federation(tiny_model_dir, tmp_path / "run", num_rounds=3, gradient_checkpointing=True)
    assert probe.depths == [0] * 6  # 3 rounds x 2 clients, each trainer's fused head undone after its round
    assert probe.hooks == [0] * 6  # ... and its hooks removed (3 input-grad hooks per client-round before)
    after = module_patches(runner.model)
    assert after.keys() == before.keys()
    for name, patches in before.items():
        assert after[name].keys() == patches.keys(), name
        for attribute in ("forward", "_original_forward"):  # the instance forwards, the very same objects
            assert after[name].get(attribute) is patches.get(attribute), (name, attribute)


def current_rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


@pytest.mark.slow
def test_hundreds_of_client_rounds_keep_depth_step_time_and_memory_flat(tmp_path, tiny_model_dir):
    """300 client-rounds (150 rounds x 2 clients): the forward depth stays 0, the local step does not slow down and
    the resident memory does not grow (what would accumulate per client-round: wrappers, hooks, adapters, caches)."""
    rss = []

    class Memory(ForwardDepth):
        def on_round_end(self, args, record, **kwargs):
            rss.append(current_rss_mib())

    probe = Memory()
    runner = make_runner(tiny_model_dir, tmp_path / "run", callbacks=[probe], num_rounds=150, save_every_round=False,
                         save_total_limit=1)
    probe.model = runner.model
    started = time.perf_counter()
    runner.run()
    assert set(probe.depths) == {0} and len(probe.depths) == 300
    early, late = statistics.median(probe.step_seconds[20:70]), statistics.median(probe.step_seconds[-50:])
    print(f"300 client-rounds in {time.perf_counter() - started:.0f} s; median seconds of a client's local round, "
          f"client-rounds 20-70: {early:.4f}, last 50: {late:.4f}; RSS after round 10: {rss[9]:.0f} MiB, after round "
          f"150: {rss[-1]:.0f} MiB")
    assert late < 1.3 * early  # medians: a step that another process slowed down does not decide
    assert rss[-1] - rss[9] < 64
