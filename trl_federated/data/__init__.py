"""Benchmarks for federated GRPO and the partitioning of their rows across clients."""

from .paper import (
    GEOMETRY_PRIMITIVES,
    GEOQA_DATASET,
    OPEN_R1_DATASET,
    build_geoqa_benchmark,
    build_open_r1_benchmark,
    difficulty_tiers,
    geometry_category,
)
from .partition import dirichlet_partition, label_histogram, partition_clients
from .reasoning_gym import DEFAULT_TASKS, DIFFICULTIES, SYSTEM_PROMPT, build_reasoning_benchmark

__all__ = [
    "DEFAULT_TASKS",
    "DIFFICULTIES",
    "GEOMETRY_PRIMITIVES",
    "GEOQA_DATASET",
    "OPEN_R1_DATASET",
    "SYSTEM_PROMPT",
    "build_geoqa_benchmark",
    "build_open_r1_benchmark",
    "build_reasoning_benchmark",
    "difficulty_tiers",
    "dirichlet_partition",
    "geometry_category",
    "label_histogram",
    "partition_clients",
]
