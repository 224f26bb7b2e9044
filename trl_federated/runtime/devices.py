"""What the device a run computes on can do: bf16 natively or not; the CPU's kind and how many of its cores are
free."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import platform
from pathlib import Path

import torch


def has_native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 matrix products natively: a CPU with AVX512-BF16 or AMX tiles whose oneDNN may
    use them (`ONEDNN_MAX_CPU_ISA=AVX2` makes such a CPU answer no, as an AVX2-only one does), a CUDA device that
    supports bf16. Elsewhere bf16 is emulated and slower than float32."""
    if device.type == "cpu":
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return native and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return False


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one, else every core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def free_cpu_threads(processes: int = 1, cores: int | None = None, load: float | None = None) -> int:
    """The intra-op threads each of `processes` processes of a CPU run takes: the cores left free by the load of the
    last minute (`os.getloadavg`), shared among the processes, at least one. Threads beyond the free cores do not
    compute faster, they wait for each other: beside one other job on 2 cores, `make demo` took 14 times its quiet
    time at 2 threads (docs/getting-started.md). A load at or above the cores leaves one thread."""
    cores = usable_cores() if cores is None else cores
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    free = math.floor(cores - load + 0.5)  # a core more than half idle counts as free
    return max(1, min(cores, free) // processes)


def cpu_kind() -> str:
    """The CPU's family as its model name gives it, before the first word with a digit ("AMD EPYC", "Intel(R) Xeon(R)
    Platinum"): what the measured times of a run are keyed by, with its bf16 support (`has_native_bf16`)."""
    name = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1]
                break
    words = list(itertools.takewhile(lambda word: not any(char.isdigit() for char in word), name.split()))
    return " ".join(words) or "unknown CPU"
