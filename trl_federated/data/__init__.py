"""Benchmarks for federated GRPO and the partitioning of their rows across clients."""

from .partition import dirichlet_partition, label_histogram, partition_clients
from .reasoning_gym import DEFAULT_TASKS, DIFFICULTIES, SYSTEM_PROMPT, build_reasoning_benchmark

__all__ = [
    "DEFAULT_TASKS",
    "DIFFICULTIES",
    "SYSTEM_PROMPT",
    "build_reasoning_benchmark",
    "dirichlet_partition",
    "label_histogram",
    "partition_clients",
]
