import json
import logging
from collections import Counter
from types import SimpleNamespace

import pytest
from datasets import Dataset

from trl_federated.data import (
    BALANCED_TASKS,
    DEFAULT_TASKS,
    DIFFICULTIES,
    MAX_ANSWER_SHARE,
    SYSTEM_PROMPT,
    build_balanced_benchmark,
    build_reasoning_benchmark,
    dirichlet_partition,
    label_histogram,
    partition_clients,
)
from trl_federated.data.partition import split_description
from trl_federated.scoring.rewards import answer_accuracy_reward

SMALL_TASKS = {
    "chain_sum": {
        "simple": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        "hard": {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2},
    },
    "letter_counting": {"simple": {"min_words": 2, "max_words": 3}},
}
COLUMNS = {"prompt", "answer", "difficulty", "category", "question", "rg_entry"}


@pytest.fixture(scope="module")
def small_benchmark():
    return build_reasoning_benchmark(SMALL_TASKS, size=30, seed=0)


def _rows(split):
    return split.to_list()


def test_benchmark_is_deterministic(small_benchmark):
    again = build_reasoning_benchmark(SMALL_TASKS, size=30, seed=0)
    other = build_reasoning_benchmark(SMALL_TASKS, size=30, seed=1)
    for split in ("train", "test"):
        assert _rows(again[split]) == _rows(small_benchmark[split])
    assert set(other["test"]["question"]) != set(small_benchmark["test"]["question"])


def test_benchmark_splits_80_20_per_group(small_benchmark):
    assert len(small_benchmark["train"]) == 24 and len(small_benchmark["test"]) == 6
    for split, per_group in (("train", 8), ("test", 2)):
        groups = Counter(zip(small_benchmark[split]["category"], small_benchmark[split]["difficulty"]))
        assert groups == {("chain_sum", "simple"): per_group, ("chain_sum", "hard"): per_group,
                          ("letter_counting", "simple"): per_group}  # fmt: skip


def test_benchmark_has_no_question_in_both_splits(small_benchmark):
    train, test = small_benchmark["train"]["question"], small_benchmark["test"]["question"]
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)


def test_benchmark_rows(small_benchmark):
    for split in small_benchmark.values():
        assert set(split.column_names) == COLUMNS
        for row in split:
            system, example_question, example_answer, question = row["prompt"]
            assert system == {"role": "system", "content": SYSTEM_PROMPT}
            assert example_question["role"] == "user" and question == {"role": "user", "content": row["question"]}
            assert example_answer["role"] == "assistant" and "</answer>" in example_answer["content"]
            assert row["category"] in SMALL_TASKS and row["difficulty"] in SMALL_TASKS[row["category"]]
            entry = json.loads(row["rg_entry"])
            assert entry["question"] == row["question"] and entry["answer"] == row["answer"]


def test_worked_examples_are_never_asked(small_benchmark):
    questions = set(small_benchmark["train"]["question"]) | set(small_benchmark["test"]["question"])
    for split in small_benchmark.values():
        examples = {row[1]["content"] for row in split["prompt"]}
        assert not examples & questions


def test_worked_example_reasons_then_answers(small_benchmark):
    row = next(row for row in small_benchmark["train"] if row["category"] == "chain_sum")
    reasoning = row["prompt"][2]["content"]
    assert reasoning.index("=") < reasoning.index("<answer>")


def test_gold_answers_score_one_with_the_reasoning_gym_scorer(small_benchmark):
    test = small_benchmark["test"]
    completions = [f"<answer>{answer}</answer>" for answer in test["answer"]]
    assert answer_accuracy_reward(completions, answer=test["answer"], rg_entry=test["rg_entry"]) == [1.0] * len(test)


def test_default_benchmark_composition():
    benchmark = build_reasoning_benchmark()
    assert len(benchmark["train"]) == 384 and len(benchmark["test"]) == 96
    assert set(benchmark["test"]["difficulty"]) == set(DIFFICULTIES)
    assert set(benchmark["test"]["category"]) == set(DEFAULT_TASKS)


def _answer_shares(split) -> dict[str, float]:
    """Per task, the share of its items that its most common gold answer holds."""
    answers: dict[str, Counter] = {}
    for task, answer in zip(split["category"], split["answer"], strict=True):
        answers.setdefault(task, Counter())[answer] += 1
    return {task: counts.most_common(1)[0][1] / counts.total() for task, counts in answers.items()}


@pytest.fixture(scope="module")
def balanced_benchmark():
    return build_balanced_benchmark()


def test_balanced_benchmark_no_answer_pays(balanced_benchmark):
    """The balanced benchmark's default: over 1,000 test items, every task in three tiers in both splits, and no gold
    answer over 10% of any task's train or test items (the default benchmark's letter_counting: 75% "1")."""
    assert len(balanced_benchmark["test"]) >= 1000
    for split in ("train", "test"):
        rows = balanced_benchmark[split]
        assert set(zip(rows["category"], rows["difficulty"])) == {
            (task, tier) for task, tiers in BALANCED_TASKS.items() for tier in tiers
        }
        assert max(_answer_shares(rows).values()) <= MAX_ANSWER_SHARE
    quickstart = build_balanced_benchmark(size=400)  # groups of 7 test items: the task's cap binds, not the group's
    assert max(_answer_shares(quickstart["test"]).values()) <= MAX_ANSWER_SHARE
    default_shares = _answer_shares(build_reasoning_benchmark(size=3300)["test"])
    assert default_shares["letter_counting"] > 0.5  # what the cap removes
    test = balanced_benchmark["test"]
    completions = [f"<answer>{answer}</answer>" for answer in test["answer"]]
    assert answer_accuracy_reward(completions, answer=test["answer"], rg_entry=test["rg_entry"]) == [1.0] * len(test)


def test_answer_cap_skips_common_answers_and_keeps_the_split():
    """Stratified draws: single-digit products (19% of them 0 uncapped) keep each answer to its share per split,
    and a tier that runs out within its shares is drawn again smaller, keeping the 80/20 proportion."""
    tasks = {"products": {"simple": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}}
    capped = build_reasoning_benchmark(tasks, size=60, max_answer_share=0.1)
    uncapped = build_reasoning_benchmark(tasks, size=60)
    for split in ("train", "test"):
        counts = Counter(capped[split]["answer"])
        assert max(counts.values()) <= max(1, int(0.1 * len(capped[split])))
    assert Counter(uncapped["train"]["answer"]).most_common(1)[0][0] == "0"
    assert len(capped["test"]) == round(0.2 * (len(capped["train"]) + len(capped["test"])))
    assert set(capped["test"]["question"]).isdisjoint(capped["train"]["question"])


def test_leg_counting_worked_example_adds_each_animals_legs():
    tasks = {"leg_counting": {"hard": {"min_animals": 3, "max_animals": 4, "max_instances": 4}}}
    row = build_reasoning_benchmark(tasks, size=20)["train"][0]
    example = row["prompt"][2]["content"]
    steps, total = example.split(" Total: ")
    products = [int(step.rsplit("= ", 1)[1].rstrip(".")) for step in steps.split(". ")]
    answer = int(total.split("<answer>")[1].split("</answer>")[0])
    assert sum(products) == answer
    assert total.endswith(f"<answer>{answer}</answer>")


def test_basic_arithmetic_worked_example_gives_the_expressions_value(balanced_benchmark):
    row = next(row for row in balanced_benchmark["train"] if row["category"] == "basic_arithmetic")
    example = row["prompt"][2]["content"]
    expression, value = example.split(" <answer>")[0].rstrip(".").rsplit(" = ", 1)
    assert row["prompt"][1]["content"] == f"Calculate {expression}."  # the worked example's own question
    assert example.endswith(f"<answer>{value}</answer>")


def test_small_tiers_shrink_with_a_warning(caplog):
    tasks = {"products": {"simple": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}}
    with caplog.at_level(logging.WARNING):
        benchmark = build_reasoning_benchmark(tasks, size=200)
    assert "distinct" in caplog.text
    total = len(benchmark["train"]) + len(benchmark["test"])
    assert total < 100  # 10 x 10 single-digit products, minus the worked examples


def test_benchmark_argument_errors():
    with pytest.raises(ValueError, match="'chain_sum'.*'simple'"):
        build_reasoning_benchmark({"chain_sum": {"simple": {"no_such_setting": 1}}})
    with pytest.raises(ValueError, match="size"):
        build_reasoning_benchmark(SMALL_TASKS, size=4)
    with pytest.raises(ValueError, match="test_size"):
        build_reasoning_benchmark(SMALL_TASKS, size=30, test_size=1.0)
    with pytest.raises(ValueError, match="empty"):
        build_reasoning_benchmark({})


@pytest.fixture(scope="module")
def labelled():
    labels = ["a"] * 200 + ["b"] * 100 + ["c"] * 60 + ["d"] * 40
    return Dataset.from_dict({"row_id": list(range(len(labels))), "label": labels})


def _ids(partitions):
    return [sorted(partition["row_id"]) for partition in partitions]


def _mean_max_share(partitions, column="label"):
    shares = [max(label_histogram(p, column).values()) / len(p) for p in partitions]
    return sum(shares) / len(shares)


@pytest.mark.parametrize("alpha", [0.05, 1.0, float("inf")])
def test_every_row_is_assigned_exactly_once(labelled, alpha):
    partitions = dirichlet_partition(labelled, num_clients=4, partition_column="label", alpha=alpha, seed=0)
    assigned = [row_id for ids in _ids(partitions) for row_id in ids]
    assert sorted(assigned) == list(range(len(labelled)))
    assert set(partitions[0].column_names) == {"row_id", "label"}


@pytest.mark.parametrize("alpha", [0.05, float("inf")])
def test_partition_is_deterministic(labelled, alpha):
    first = dirichlet_partition(labelled, 4, "label", alpha, seed=0)
    assert _ids(dirichlet_partition(labelled, 4, "label", alpha, seed=0)) == _ids(first)
    assert _ids(dirichlet_partition(labelled, 4, "label", alpha, seed=1)) != _ids(first)


def test_small_alpha_skews_labels(labelled):
    skewed = [_mean_max_share(dirichlet_partition(labelled, 4, "label", 0.05, seed=s)) for s in range(5)]
    iid = [_mean_max_share(dirichlet_partition(labelled, 4, "label", float("inf"), seed=s)) for s in range(5)]
    # The largest label is half the data, so IID clients hold about 50% of it; skewed ones mostly one label.
    assert max(iid) < 0.65
    assert sum(skewed) / len(skewed) > sum(iid) / len(iid) + 0.2


def test_iid_partition_sizes_differ_by_at_most_one(labelled):
    sizes = [len(p) for p in dirichlet_partition(labelled, 3, "label", float("inf"), seed=0)]
    assert max(sizes) - min(sizes) <= 1


def test_min_partition_size_is_respected(labelled):
    partitions = dirichlet_partition(labelled, 4, "label", 0.5, seed=0, min_partition_size=20)
    assert min(len(p) for p in partitions) >= 20


def test_partition_logs_each_client_histogram(labelled, caplog):
    with caplog.at_level(logging.INFO, logger="trl_federated.data.partition"):
        dirichlet_partition(labelled, 2, "label", 1.0, seed=0)
    assert "Client 0" in caplog.text and "Client 1" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"partition_column": "difficulty"}, "'difficulty'"),
        ({"num_clients": 0}, "num_clients"),
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": -1.0}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"num_clients": 5, "min_partition_size": 100}, "at least 100"),
        ({"num_clients": 401}, "401 clients"),
    ],
)
def test_partition_argument_errors(labelled, kwargs, message):
    arguments = {"num_clients": 2, "partition_column": "label", "alpha": 1.0} | kwargs
    with pytest.raises(ValueError, match=message):
        dirichlet_partition(labelled, **arguments)


def test_unmet_min_partition_size_is_a_clear_error(labelled):
    with pytest.raises(ValueError, match="No Dirichlet.*min_partition_size"):
        dirichlet_partition(labelled, 8, "label", 0.01, seed=0, min_partition_size=45)


def test_partition_clients_reads_the_federation_settings(labelled):
    args = SimpleNamespace(num_clients=3, partition_column="label", dirichlet_alpha=0.5, min_partition_size=2, seed=7,
                           labels_per_client=None, equal_partition_sizes=False, rpg_signal="reward-window")
    expected = dirichlet_partition(labelled, 3, "label", 0.5, seed=7, min_partition_size=2)
    training_data = labelled.add_column("prompt", ["q"] * len(labelled))  # GRPO generates from a `prompt` column
    assert _ids(partition_clients(training_data, args)) == _ids(expected)
    with pytest.raises(ValueError, match="no `prompt` column"):
        partition_clients(labelled, args)


def test_label_histogram(labelled):
    assert label_histogram(labelled, "label") == {"a": 200, "b": 100, "c": 60, "d": 40}
    with pytest.raises(ValueError, match="'nope'"):
        label_histogram(labelled, "nope")


def test_a_dataset_without_a_label_column_splits_uniformly(tmp_path, caplog):
    """A TRL dataset without `difficulty` (DeepMath, say): `partition_column: None` (from YAML as null or None) or
    `dirichlet_alpha: inf` split it uniformly; a finite μ over a missing column names both ways out."""
    from trl_federated.config import FedGRPOConfig

    plain = Dataset.from_dict({"row_id": list(range(30)), "prompt": ["q"] * 30})
    for column, alpha in ((None, 0.05), ("difficulty", float("inf"))):
        with caplog.at_level(logging.INFO, logger="trl_federated.data.partition"):
            partitions = dirichlet_partition(plain, 3, column, alpha, seed=0)
        assert sorted(len(p) for p in partitions) == [10, 10, 10]
        assert sorted(row for ids in _ids(partitions) for row in ids) == list(range(30))
    assert "needs a label and is not used" in caplog.text
    with pytest.raises(ValueError, match=r"no such column.*`partition_column: null`.*`dirichlet_alpha: inf`"):
        dirichlet_partition(plain, 3, "difficulty", 0.05, seed=0)
    for spelled in (None, "None", "null"):
        args = FedGRPOConfig(output_dir=str(tmp_path), use_cpu=True, partition_column=spelled, report_to="none")
        assert args.partition_column is None
        assert _ids(partition_clients(plain, args)) == _ids(dirichlet_partition(plain, 1, None, 0.05, seed=args.seed))


def test_a_plain_trl_dataset_federates_at_the_default_partition_column(tmp_path, caplog):
    """A dataset with `prompt` and `solution` only (a plain TRL dataset) at the defaults: split uniformly, said once;
    a column the user named that the dataset lacks is still refused, naming the way out."""
    from trl_federated.config import FedGRPOConfig

    plain = Dataset.from_dict({"row_id": list(range(30)), "prompt": ["q"] * 30, "solution": ["1"] * 30})
    args = FedGRPOConfig(output_dir=str(tmp_path), bf16=False, num_clients=3)
    assert args.partition_column == "difficulty"
    with caplog.at_level(logging.WARNING, logger="trl_federated.data.partition"):
        partitions = partition_clients(plain, args)
    assert sorted(len(p) for p in partitions) == [10, 10, 10]
    assert caplog.text.count("split uniformly") == 1
    assert split_description(args, plain) == "a uniform split"
    named = FedGRPOConfig(output_dir=str(tmp_path), bf16=False, num_clients=3, partition_column="topic")
    with pytest.raises(ValueError, match="no such column"):
        partition_clients(plain, named)
