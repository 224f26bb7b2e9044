"""Memory handed back between client rounds."""

import sys
from pathlib import Path

import pytest
import torch

from trl_federated.runtime.memory import release_free_memory


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc are Linux's")
def test_freed_heap_memory_goes_back_to_the_system():
    # 3000 tensors of 100 KiB: below glibc's mmap threshold, so they live in the heap, which keeps them once freed
    tensors = [torch.ones(25_600) for _ in range(3000)]
    del tensors[:-1]  # the last one pins the top of the heap, so freeing does not shrink it by itself
    before = resident_mib()
    release_free_memory()
    assert before - resident_mib() > 150
