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
from .reasoning_gym import (
    BALANCED_TASKS,
    DEFAULT_TASKS,
    DIFFICULTIES,
    MAX_ANSWER_SHARE,
    SYSTEM_PROMPT,
    build_balanced_benchmark,
    build_reasoning_benchmark,
)

__all__ = [
    "BALANCED_TASKS",
    "DEFAULT_TASKS",
    "DIFFICULTIES",
    "GEOMETRY_PRIMITIVES",
    "GEOQA_DATASET",
    "MAX_ANSWER_SHARE",
    "OPEN_R1_DATASET",
    "SYSTEM_PROMPT",
    "build_balanced_benchmark",
    "build_geoqa_benchmark",
    "build_open_r1_benchmark",
    "build_reasoning_benchmark",
    "difficulty_tiers",
    "dirichlet_partition",
    "geometry_category",
    "label_histogram",
    "partition_clients",
]
