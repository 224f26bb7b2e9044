"""Splitting a dataset across federated clients, IID or with Dirichlet label skew.

The paper controls heterogeneity with a Dirichlet(alpha) distribution over a label column (task category or
difficulty): a small alpha gives each client a few dominant labels, `alpha = inf` an IID split. The sampling
itself is Flower Datasets' `DirichletPartitioner` (Hsu et al., 2019, "Measuring the Effects of Non-Identical
Data Distribution for Federated Visual Classification"), so partitions match those of Flower baselines; this
module adds argument checks with errors that name the problem, the IID limit, and logging.
"""

from __future__ import annotations

import logging
import math
import random
import warnings
from collections import Counter
from typing import TYPE_CHECKING

from datasets import Dataset
from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, Partitioner, PathologicalPartitioner

if TYPE_CHECKING:
    from ..config import FedGRPOConfig

logger = logging.getLogger(__name__)


def dirichlet_partition(
    dataset: Dataset,
    num_clients: int,
    partition_column: str | None,
    alpha: float,
    seed: int = 0,
    min_partition_size: int = 1,
    self_balancing: bool = False,
) -> list[Dataset]:
    """Split `dataset` into `num_clients` disjoint partitions whose label mix follows Dirichlet(`alpha`).

    For every label value, the share of its rows that each client receives is drawn from a symmetric
    Dirichlet(`alpha`) distribution. Small `alpha` (e.g. 0.05) concentrates each label on one or two
    clients; large `alpha` approaches an even split; `alpha = float("inf")` is exactly the IID limit: the
    rows are shuffled and dealt into partitions whose sizes differ by at most one. Every row is assigned to
    exactly one client, and the result depends only on the arguments (same `seed`, same partitions).

    Args:
        dataset: the rows to split.
        num_clients: number of partitions, at least 1.
        partition_column: the label column the skew is defined over, e.g. `"category"` or `"difficulty"`; None
            for a uniform (IID) split, which needs no label (as `alpha = inf`, which reads no column either).
        alpha: the Dirichlet concentration, > 0; `float("inf")` for IID.
        seed: seeds both the Dirichlet draws and the shuffling of rows inside each partition.
        min_partition_size: the fewest rows any client may get. Dirichlet draws that break it are redrawn, a
            limited number of times (Flower's `DirichletPartitioner` allows 10 retries).
        self_balancing: stop giving rows to a client once it holds more than an even share (Flower's
            `self_balancing`). Off by default: it weakens the label skew that `alpha` asks for.

    Returns:
        `num_clients` datasets with the columns of `dataset`.

    Raises:
        ValueError: for a missing column, `num_clients < 1`, `alpha <= 0`, or a `min_partition_size` that
            cannot be met (or was not met by any of the Dirichlet draws).
    """
    uniform = partition_column is None or math.isinf(alpha)
    if not uniform and partition_column not in dataset.column_names:
        raise ValueError(
            f"Cannot partition by column {partition_column!r}: the dataset has no such column (columns: "
            f"{dataset.column_names}). Name a label column with `partition_column`, or split uniformly with "
            "`partition_column: null` (or `dirichlet_alpha: inf`)."
        )
    if num_clients < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}.")
    if not alpha > 0:  # also rejects NaN
        raise ValueError(f"alpha must be > 0 (float('inf') for an IID split), got {alpha}.")
    if min_partition_size < 0:
        raise ValueError(f"min_partition_size must be >= 0, got {min_partition_size}.")
    if num_clients * max(min_partition_size, 1) > len(dataset):
        raise ValueError(
            f"Cannot give each of {num_clients} clients at least {max(min_partition_size, 1)} row(s): the "
            f"dataset has only {len(dataset)} rows. Use fewer clients or a smaller min_partition_size."
        )

    if partition_column is None and not math.isinf(alpha):
        logger.info("`partition_column` is None: a uniform split; the Dirichlet μ=%s needs a label and is not used.",
                    alpha)
    partitioner: Partitioner
    if uniform:
        partitioner = IidPartitioner(num_partitions=num_clients)
        # IidPartitioner deals contiguous shards: shuffle first, or a dataset sorted by label stays skewed.
        partitioner.dataset = dataset.shuffle(seed=seed)
    else:
        partitioner = DirichletPartitioner(
            num_partitions=num_clients,
            partition_by=partition_column,
            alpha=float(alpha),
            min_partition_size=min_partition_size,
            self_balancing=self_balancing,
            shuffle=True,
            seed=seed,
        )
        partitioner.dataset = dataset
    try:
        with warnings.catch_warnings():
            # Flower warns on every redraw; the outcome is reported once below, or raised.
            warnings.filterwarnings("ignore", message="The specified min_partition_size")
            partitions = [partitioner.load_partition(client_id) for client_id in range(num_clients)]
    except ValueError as error:
        if "max number of attempts" not in str(error):
            raise
        raise ValueError(
            f"No Dirichlet(alpha={alpha}) draw gave all {num_clients} clients at least {min_partition_size} "
            f"row(s) of the {len(dataset)} (seed={seed}; Flower gives up after 10 redraws). Increase alpha, lower "
            f"min_partition_size, use fewer clients, or try another seed."
        ) from error

    for client_id, partition in enumerate(partitions):
        if partition_column in dataset.column_names:
            logger.info("Client %d: %d rows, %s histogram %s", client_id, len(partition), partition_column,
                        label_histogram(partition, partition_column))
        else:
            logger.info("Client %d: %d rows", client_id, len(partition))
    return partitions


def label_partition(
    dataset: Dataset, num_clients: int, partition_column: str, labels_per_client: int, seed: int = 0
) -> list[Dataset]:
    """Give each of `num_clients` clients exactly `labels_per_client` values of `partition_column`, dealt in sorted
    order (client i holds the i-th label with 1 label a client), each label's rows split evenly among the clients
    that hold it: Flower Datasets' `PathologicalPartitioner` with `class_assignment_mode="first-deterministic"` (McMahan
    et al., 2017's pathological non-IID split). With as many clients as labels and 1 label each, one task per client.

    Raises:
        ValueError: for a missing column, or more labels asked for than the column has (a client would hold none).
    """
    if partition_column not in dataset.column_names:
        raise ValueError(
            f"Cannot deal labels of column {partition_column!r}: the dataset has no such column (columns: "
            f"{dataset.column_names}). Name a label column with `partition_column`."
        )
    labels = sorted(set(map(str, dataset[partition_column])))
    if labels_per_client > len(labels):
        raise ValueError(
            f"`labels_per_client` is {labels_per_client}, but column {partition_column!r} has only {len(labels)} "
            f"values ({labels[:8]}): give each client at most {len(labels)}."
        )
    partitioner = PathologicalPartitioner(
        num_partitions=num_clients, partition_by=partition_column, num_classes_per_partition=labels_per_client,
        class_assignment_mode="first-deterministic", shuffle=True, seed=seed,
    )
    partitioner.dataset = dataset
    partitions = [partitioner.load_partition(client_id) for client_id in range(num_clients)]
    for client_id, partition in enumerate(partitions):
        logger.info("Client %d: %d rows, %s histogram %s", client_id, len(partition), partition_column,
                    label_histogram(partition, partition_column))
    return partitions


def equalize_sizes(partitions: list[Dataset]) -> list[Dataset]:
    """Every partition cut to the smallest one's size (its first rows, already shuffled by the partitioner)."""
    size = min(len(partition) for partition in partitions)
    logger.info("Equal partition sizes: every client keeps %d rows (of %s).", size,
                [len(partition) for partition in partitions])
    return [partition.select(range(size)) for partition in partitions]


def partition_clients(dataset: Dataset, args: FedGRPOConfig) -> list[Dataset]:
    """The clients' partitions under the federation settings of a `FedGRPOConfig`: `label_partition` with
    `labels_per_client`, else `dirichlet_partition` (`partition_column`, `dirichlet_alpha`); cut to equal sizes with
    `equal_partition_sizes`; `min_partition_size` checked on the result. The trainer, the runner and the CLI all
    split the data here, the same way.

    Raises:
        ValueError: for data without a `prompt` column, a partition that cannot be drawn, or a client left with fewer
            than `min_partition_size` rows.
    """
    if "prompt" not in dataset.column_names:  # TRL's GRPOTrainer would fail on it only at the first local step
        raise ValueError(
            f"The training data has no `prompt` column, which GRPO generates the completions from (columns: "
            f"{dataset.column_names}). Rename the column that holds the prompts, e.g. "
            "`dataset.rename_column('question', 'prompt')`; a prompt is a string or a conversation (a list of "
            "`{'role': ..., 'content': ...}` messages), as TRL's GRPOTrainer takes it."
        )
    column = args.partition_column
    if args.labels_per_client is not None:
        partitions = label_partition(dataset, args.num_clients, column, args.labels_per_client, seed=args.seed)
    else:
        if column == default_partition_column() and column not in dataset.column_names:
            # A plain TRL dataset (prompt, solution) has no difficulty label: split it as it can be, and say so.
            logger.warning(
                "The dataset has no %r column (the default `partition_column`): its rows are split uniformly across "
                "the %d clients. Name a label column with `partition_column` for a non-IID split.", column,
                args.num_clients,
            )
            column = None
        partitions = dirichlet_partition(
            dataset,
            num_clients=args.num_clients,
            partition_column=column,
            alpha=args.dirichlet_alpha,
            seed=args.seed,
            min_partition_size=args.min_partition_size,
        )
    if args.equal_partition_sizes:
        partitions = equalize_sizes(partitions)
    sizes = [len(partition) for partition in partitions]
    if min(sizes) < args.min_partition_size:
        raise ValueError(
            f"The partition gives a client {min(sizes)} rows (sizes {sizes}), fewer than `min_partition_size` "
            f"({args.min_partition_size}): use fewer clients, more labels a client, or a smaller min_partition_size."
        )
    for index, size in enumerate(sizes):  # the clients' held-out slices, refused now rather than in their first round
        check_held_out_room(size, args, f"client_{index}")
    return partitions


def check_held_out_room(size: int, args: FedGRPOConfig, client_id: str) -> None:
    """`ValueError`, naming `rpg_signal_items`, when under `rpg_signal="held-out"` a client of `size` rows would keep
    fewer than it may train on beside its held-out slice: `min_partition_size` rows, and one generation batch's prompts
    (TRL's sampler takes no step on fewer)."""
    if args.rpg_signal != "held-out":
        return
    needed = max(args.min_partition_size, args.generation_batch_size // args.num_generations)
    if size - args.rpg_signal_items < needed:
        raise ValueError(
            f"`rpg_signal_items` ({args.rpg_signal_items}) leaves client {client_id!r} {size - args.rpg_signal_items} "
            f"of its {size} rows to train on, fewer than {needed} (`min_partition_size`, and one generation batch's "
            "prompts): lower `rpg_signal_items`, or give the clients more data."
        )


def held_out_split(dataset: Dataset, args: FedGRPOConfig, client_id: str) -> tuple[Dataset, Dataset | None]:
    """(the rows client `client_id` trains on, its held-out slice) under `rpg_signal`: with "held-out",
    `rpg_signal_items` rows set aside (`check_held_out_room`), drawn by a generator seeded with the client's id alone,
    so that every round, whose trainer has a seed of its own, and either transport set aside the same rows; otherwise
    all of `dataset` and None."""
    if args.rpg_signal != "held-out":
        return dataset, None
    check_held_out_room(len(dataset), args, client_id)
    held_out = set(random.Random(f"rpg-signal/{client_id}").sample(range(len(dataset)), args.rpg_signal_items))
    return dataset.select([row for row in range(len(dataset)) if row not in held_out]), dataset.select(sorted(held_out))


def default_partition_column() -> str | None:
    """`FedGRPOConfig.partition_column`'s default: the label `partition_clients` does without in a dataset lacking
    it."""
    from ..config import FedGRPOConfig

    return FedGRPOConfig.__dataclass_fields__["partition_column"].default


def split_description(args: FedGRPOConfig, dataset: Dataset | None = None) -> str:
    """How `partition_clients` splits the data (`dataset`: the rows it splits, when known), for run headers and model
    cards."""
    equal = ", equal sizes" if args.equal_partition_sizes else ""
    if args.labels_per_client is not None:
        return f"{args.labels_per_client} value(s) of `{args.partition_column}` a client{equal}"
    missing = dataset is not None and args.partition_column not in dataset.column_names
    if args.partition_column is None or math.isinf(args.dirichlet_alpha) or missing:
        return f"a uniform split{equal}"
    return f"Dirichlet μ={args.dirichlet_alpha} over `{args.partition_column}`{equal}"


def label_histogram(dataset: Dataset, column: str) -> dict[str, int]:
    """Count the rows of each value of `column`, keyed by the value as a string, in sorted key order.

    Raises:
        ValueError: if `dataset` has no column `column`.
    """
    if column not in dataset.column_names:
        raise ValueError(f"The dataset has no column {column!r} (columns: {dataset.column_names}).")
    counts = Counter(str(value) for value in dataset[column])
    return dict(sorted(counts.items()))
