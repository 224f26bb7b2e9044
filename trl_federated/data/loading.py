"""The train and test splits `BenchmarkArguments` name (`load_benchmark`), and the Hub id of the clients' data for
the model card (`hub_dataset_id`)."""

from __future__ import annotations

from pathlib import Path

GENERATED_BENCHMARKS = {
    "reasoning_gym_balanced": "build_balanced_benchmark",
    "reasoning_gym": "build_reasoning_benchmark",
}
"""`dataset_name` -> the builder in `data.reasoning_gym` of an embedded benchmark (by name: importing it takes
seconds, and the argument parser checks names without it). The balanced one is the default; the first version stays
reachable for the results measured on it."""


def load_benchmark(data_args):
    """The train and test splits named by `data_args` (`arguments.BenchmarkArguments`)."""
    from datasets import load_dataset, load_from_disk

    from . import reasoning_gym
    from .paper import GEOQA_DATASET, OPEN_R1_DATASET, build_geoqa_benchmark, build_open_r1_benchmark

    paper_benchmarks = {
        "open_r1": (build_open_r1_benchmark, OPEN_R1_DATASET),
        "geoqa": (build_geoqa_benchmark, GEOQA_DATASET),
    }
    for name in ("benchmark_source", "max_pixels"):
        if getattr(data_args, name) is not None and data_args.dataset_name not in paper_benchmarks:
            raise ValueError(
                f"`{name}` is read only by the paper benchmarks {list(paper_benchmarks)}, not by "
                f"dataset_name={data_args.dataset_name!r}."
            )
    saved = (Path(data_args.dataset_name) / "dataset_dict.json").is_file()  # a `save_to_disk` folder
    generated = data_args.dataset_name in (*GENERATED_BENCHMARKS, *paper_benchmarks)
    if data_args.dataset_config is not None and (saved or generated):
        raise ValueError(
            f"`dataset_config` names a configuration of a `datasets.load_dataset` dataset; "
            f"dataset_name={data_args.dataset_name!r} has none."
        )
    if data_args.dataset_name in GENERATED_BENCHMARKS:
        build = getattr(reasoning_gym, GENERATED_BENCHMARKS[data_args.dataset_name])
        splits = build(size=data_args.benchmark_size, seed=data_args.benchmark_seed)
    elif data_args.dataset_name in paper_benchmarks:
        build, hub_id = paper_benchmarks[data_args.dataset_name]
        splits = build(
            data_args.benchmark_source or hub_id, seed=data_args.benchmark_seed, max_pixels=data_args.max_pixels
        )
    elif saved:
        splits = load_from_disk(data_args.dataset_name)
    else:
        splits = load_dataset(data_args.dataset_name, data_args.dataset_config)
    train, test = splits[data_args.dataset_train_split], splits[data_args.dataset_test_split]
    if data_args.max_eval_samples is not None:
        test = test.select(range(min(data_args.max_eval_samples, len(test))))
    return train, test


def hub_dataset_id(data_args) -> str | None:
    """The Hub id of the clients' data, for the model card; None for the generated benchmark or local data."""
    from .paper import GEOQA_DATASET, OPEN_R1_DATASET

    sources = {"open_r1": OPEN_R1_DATASET, "geoqa": GEOQA_DATASET}
    name = data_args.dataset_name
    if name in sources:
        name = data_args.benchmark_source or sources[name]
    return None if name in GENERATED_BENCHMARKS or Path(name).exists() else name
