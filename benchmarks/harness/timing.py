"""Timing and memory for the speed benchmarks: the sides of a comparison run in turns (`alternated`), the wall
seconds of one call, of the best of several, and of wrapped methods per phase (`Phases`), the machine's floors
(`machine_floors`), and the resident memory and its high-water mark, which the kernel lets a process reset (Linux)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

Side = TypeVar("Side", bound=Hashable)
Result = TypeVar("Result")


def alternated(sides: dict[Side, Callable[[], Result]], repeats: int) -> dict[Side, list[Result]]:
    """Every side of a comparison run `repeats` times, each repeat starting one side later than the one before (with
    two sides, which goes first alternates), so that neither always runs on a warmer cache or under the same load;
    the results of each side in the order they ran. The caller warms both sides up first, untimed."""
    names = list(sides)
    results: dict[Side, list[Result]] = {name: [] for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            results[name].append(sides[name]())
    return results


def wall_seconds(function: Callable[[], object]) -> float:
    """Wall seconds of `function()`; what it returns is freed outside the timed region."""
    start = time.perf_counter()
    result = function()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def best_seconds(function: Callable[[], object], repeats: int = 5) -> float:
    """The fewest wall seconds `function()` took over `repeats` calls, after one untimed call: the machine's floor."""
    function()
    return min(wall_seconds(function) for _ in range(repeats))


def read_gb_s(mib: int = 512) -> float:
    """The machine's read bandwidth in GB/s: the best time to sum a float32 tensor of `mib` MiB (larger than the
    caches at the default), the rate a weight-streaming decode step cannot beat."""
    import torch

    data = torch.ones(mib * 2**20 // 4)
    return data.numel() * 4 / best_seconds(data.sum) / 1e9


MATMUL_SHAPES = ((512, 576, 1536), (1024, 2048, 2048))  # a prefill's MLP projection, and a larger product


def machine_floors(tiny: bool = False) -> dict[str, float]:
    """Read bandwidth (GB/s) and matrix-product throughput (GFLOP/s, the best of `MATMUL_SHAPES`) in float32 and
    bfloat16: what a weight-streaming step and a compute-bound one cannot beat. `tiny`: small sizes, for tests."""
    import torch

    floors = {"read_gb_s": read_gb_s(32 if tiny else 512)}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        throughputs = []
        for m, k, n in ((64, 64, 128),) if tiny else MATMUL_SHAPES:
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            throughputs.append(2 * m * k * n / best_seconds(lambda: a @ b, repeats=10) / 1e9)  # noqa: B023
        floors[f"matmul_{name}_gflop_s"] = max(throughputs)  # the machine's best: a floor
    return floors


class Phases:
    """Wall seconds of wrapped methods, summed per phase until `take()`."""

    def __init__(self):
        self.seconds = defaultdict(float)

    def wrap(self, owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        setattr(owner, attribute, timed)

    def take(self) -> dict[str, float]:
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        return seconds


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"No {field} in /proc/self/status: this benchmark needs Linux.")


def read_peak_rss_mib() -> float:
    """The process's peak resident memory (VmHWM) since its start or the last `reset_peak_rss`, in MiB."""
    return _status_mib("VmHWM")


def resident_mib() -> float:
    """The process's resident memory now (VmRSS), in MiB."""
    return _status_mib("VmRSS")


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # "5" resets the peak RSS to the current RSS
