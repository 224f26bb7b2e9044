"""The default benchmark: procedurally generated reasoning-gym tasks in three difficulty tiers.

The paper evaluates on OpenR1 math problems split into simple, medium and hard. Those need the Hub and a
model far larger than one that trains on a CPU, so the default benchmark keeps the paper's shape (tiers,
accuracy per tier, an 80/20 split, label columns to partition clients by) with tasks that
SmolLM2-135M-Instruct can partly solve and visibly improve on within a few dozen GRPO steps. Difficulty is set
through each generator's own settings (number of terms, digits, words, value range).

Each prompt is a conversation: a system message asking for brief reasoning and a tagged final answer, one
worked example of the same task and tier (without it the 135M model never uses the answer tags), then the
question. Examples are drawn from questions that appear in neither split.
"""

from __future__ import annotations

import json
import logging
import math
import random
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from datasets import Dataset, DatasetDict

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a helpful assistant. Reason briefly, then give the final answer inside <answer></answer>."
"""The system message of every prompt: brief reasoning keeps completions inside a CPU-sized token budget."""

DIFFICULTIES = ("simple", "medium", "hard")
"""The paper's difficulty tiers, easiest first."""

TaskLevels = Mapping[str, Mapping[str, Mapping[str, Any]]]
"""Task name -> difficulty label -> keyword arguments of the task's reasoning-gym config."""

DEFAULT_TASKS: TaskLevels = {
    "chain_sum": {
        "simple": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        "medium": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
        "hard": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2},
    },
    "products": {
        "simple": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        "medium": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
        "hard": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2},
    },
    "gcd": {
        "simple": {"min_value": 1, "max_value": 20},
        "medium": {"min_value": 1, "max_value": 50},
        "hard": {"min_value": 1, "max_value": 100},
    },
    "letter_counting": {
        "simple": {"min_words": 1, "max_words": 2},
        "medium": {"min_words": 2, "max_words": 3},
        "hard": {"min_words": 3, "max_words": 4},
    },
}
"""Four task families, three tiers each, calibrated on SmolLM2-135M-Instruct (`benchmarks/calibrate_tiers.py`).

Greedy accuracy of the embedded model (64 new tokens), 24 questions per (task, setting) outside the benchmark:
simple 53% (chain_sum 62.5, gcd 29.2, letter_counting 41.7, products 79.2), medium 20% (16.7, 20.8, 20.8, 20.8),
hard 9% (12.5, 16.7, 4.2, 4.2), aiming at 50 / 25 / 10%: every tier starts above zero, so a client holding
mostly hard items still sees some rewarded completions, and no tier is near saturation. Two-digit sums (12.5%)
are harder for this model than mixed chains of two or three one- and two-digit terms (16.7%), and a letter count
over 3-4 words (4.2%) is as hard as over 5-6. Per task, the measured settings closest to each tier's target were
chosen by hand, looking at the tier's mean: gcd's hard tier keeps `max_value` 100 (16.7%) rather than 200 (4.2%),
which holds the hard tier at 9% instead of 6%.
"""

BALANCED_TASKS: TaskLevels = {
    "chain_sum": DEFAULT_TASKS["chain_sum"],
    "products": DEFAULT_TASKS["products"],
    "gcd": {
        "simple": {"min_value": 1, "max_value": 50},
        "medium": {"min_value": 1, "max_value": 100},
        "hard": {"min_value": 1, "max_value": 200},
    },
    "basic_arithmetic": {
        "simple": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        "medium": {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1},
        "hard": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2},
    },
}
"""The balanced benchmark's tasks (`build_balanced_benchmark`): arithmetic chains, products, GCDs and signed
expressions, each with many possible answers, drawn so that none is common (`MAX_ANSWER_SHARE`).

It replaces letter_counting, whose gold answer is "1" for three items in four at these sizes and cannot be spread (a
letter that occurs 5 times in 2-4 words is rare), with basic_arithmetic (two or three signed terms with + - * / and
brackets; greedy accuracy of the embedded model on 40 questions a tier, its worked example showing the expression's
value: 25.0%, 7.5%, 7.5%). gcd takes wider ranges, so that a GCD of 5-12 is common enough to fill its share. chain_sum
and products keep the default benchmark's tiers. The first version (2026-11-28, `benchmarks/results/grid-balanced-v1`)
had leg_counting instead: the base model scored 2.7% there and FedAvg learned nothing (it counts a cat's legs as 3),
so the pilot's gate failed on it.
"""

MAX_ANSWER_SHARE = 0.1
"""The balanced benchmark's cap: no gold answer is more than this share of a task's train or of its test items,
so that no constant answer scores more than 10% of a task (on the default benchmark answering "1" scores 75% of
letter_counting)."""

_NUM_EXAMPLES_PER_LEVEL = 8  # distinct worked examples per (task, difficulty), never asked as questions
_MAX_DRAWS_FACTOR = 50  # generator draws allowed per distinct question wanted, before giving up


def _arithmetic_steps(entry: dict[str, Any]) -> str:
    """Left-to-right evaluation of a `+`/`-`/`*` chain, e.g. "3 + 4 = 7. 7 - 2 = 5." (chain_sum, products)."""
    tokens = entry["metadata"]["expression"].split()
    value = int(tokens[0])
    steps = []
    for operator, operand in zip(tokens[1::2], tokens[2::2]):
        operand_value = int(operand)
        result = {"+": value + operand_value, "-": value - operand_value, "*": value * operand_value}[operator]
        steps.append(f"{value} {operator} {operand} = {result}.")
        value = result
    return " ".join(steps)


def _euclid_steps(entry: dict[str, Any]) -> str:
    """Euclid's algorithm as chains of equalities, e.g. "gcd(12, 8) = gcd(8, 4) = gcd(4, 0) = 4." (gcd)."""
    result, *others = entry["metadata"]["numbers"]
    sentences = []
    for other in others:
        a, b = result, other
        chain = [f"gcd({a}, {b})"]
        while b:
            a, b = b, a % b
            chain.append(f"gcd({a}, {b})")
        sentences.append(" = ".join(chain) + f" = {a}.")
        result = a
    return " ".join(sentences)


def _expression_value(entry: dict[str, Any]) -> str:
    """The expression and its value, e.g. "( -9 / 9 ) - 6 = -7." (basic_arithmetic)."""
    return f"{entry['metadata']['expression']} = {entry['answer']}."


def _letter_count_steps(entry: dict[str, Any]) -> str:
    """The count of the letter in each word, then the total (letter_counting)."""
    letter = entry["metadata"]["target_letter"]
    counts = ", ".join(f"{word}: {word.lower().count(letter)}" for word in entry["metadata"]["span"])
    return f"{counts}. Total: {entry['answer']}."


def _leg_count_steps(entry: dict[str, Any]) -> str:
    """Each kind of animal's legs, then the sum, e.g. "2 dogs: 2 * 4 = 8. 1 crab: 1 * 10 = 10. Total: 8 + 10 = 18."
    (leg_counting)."""
    from reasoning_gym.arithmetic.leg_counting import ANIMALS  # legs per animal, as the generator counts them

    parts = [(count, animal, count * ANIMALS[animal]) for animal, count in entry["metadata"]["animals"].items()]
    steps = " ".join(f"{count} {animal}: {count} * {ANIMALS[animal]} = {legs}." for count, animal, legs in parts)
    total = " + ".join(str(legs) for *_, legs in parts)
    return f"{steps} Total: {total} = {entry['answer']}." if len(parts) > 1 else f"{steps} Total: {entry['answer']}."


WORKED_SOLUTIONS: dict[str, Callable[[dict[str, Any]], str]] = {
    "chain_sum": _arithmetic_steps,
    "products": _arithmetic_steps,
    "gcd": _euclid_steps,
    "letter_counting": _letter_count_steps,
    "leg_counting": _leg_count_steps,
    "basic_arithmetic": _expression_value,
}
"""Task name -> the brief reasoning shown in the worked example. Tasks without one show only the tagged answer."""


def _worked_example(entry: dict[str, Any], task: str) -> list[dict[str, str]]:
    """The user/assistant turns that demonstrate one solved item of `task`."""
    solution = WORKED_SOLUTIONS.get(task)
    reasoning = f"{solution(entry)} " if solution is not None else ""
    return [
        {"role": "user", "content": entry["question"]},
        {"role": "assistant", "content": f"{reasoning}<answer>{entry['answer']}</answer>"},
    ]


def _level_seed(seed: int, task: str, difficulty: str) -> int:
    """A generator seed per (task, difficulty) that is stable across processes, unlike `hash()`."""
    return (seed * 1_000_003 + zlib.crc32(f"{task}/{difficulty}".encode())) % 2**32


def _split_sizes(wanted: int, test_size: float) -> dict[str, int]:
    """A group of `wanted` items' test and train sizes: `test_size` of it, at least one item each."""
    num_test = min(max(1, round(test_size * wanted)), wanted - 1)
    return {"test": num_test, "train": wanted - num_test}


def _answer_caps(sizes: dict[str, int], max_answer_share: float | None) -> dict[str, int | float]:
    """The most items of one gold answer a test and a train split of `sizes` items may hold: at least 1, so that a
    split of fewer than 1 / `max_answer_share` items takes one item of each answer; none without a share."""
    return {split: math.inf if max_answer_share is None else max(1, math.floor(max_answer_share * size))
            for split, size in sizes.items()}  # fmt: skip


def _group_items(
    task: str,
    difficulty: str,
    config: Mapping[str, Any],
    wanted: int,
    test_size: float,
    seed: int,
    seen: set[str],
    max_answer_share: float | None,
    task_answers: dict[str, Counter[str]],
    task_caps: dict[str, int | float],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """One (task, difficulty) group: its worked examples, test items and train items, in generation order.

    Distinct generated questions not in `seen` go to the examples first, then to the test split and then the train
    split, each up to its size; with `max_answer_share`, a question whose gold answer has filled its share of a split
    goes to the next split with room, or is skipped. The share holds within the group (so a client that holds one
    tier still sees varied answers) and within the task: `task_caps` bounds the answers counted over the task's
    groups so far (`task_answers`, updated), which binds only where a group's split is too small for its own cap
    (under 1 / `max_answer_share` items, where the group takes one item of each answer). A generator that runs out of
    questions within `_MAX_DRAWS_FACTOR` draws per item wanted leaves the group smaller: it is drawn again for as many
    items as it gave, so that both splits keep `test_size`'s proportion and their shares. `seen` is shared across every
    task and tier, so a question generated by two overlapping tiers lands in only one of them, and so in only one
    split; it is updated with the group's questions.
    """
    import reasoning_gym  # here, not at the top: it takes seconds to import and only generation needs it

    level_seed = _level_seed(seed, task, difficulty)
    draws = _MAX_DRAWS_FACTOR * (_NUM_EXAMPLES_PER_LEVEL + wanted)
    try:
        generator = reasoning_gym.create_dataset(task, seed=level_seed, size=draws, **config)
    except (TypeError, AssertionError, ValueError) as error:
        raise ValueError(
            f"Invalid reasoning-gym settings {dict(config)} for task {task!r}, difficulty {difficulty!r}: {error}"
        ) from error
    while True:
        sizes = _split_sizes(wanted, test_size)
        caps = _answer_caps(sizes, max_answer_share)
        examples: list[dict[str, Any]] = []
        items: dict[str, list[dict[str, Any]]] = {"test": [], "train": []}
        counts: dict[str, Counter[str]] = {"test": Counter(), "train": Counter()}
        drawn: set[str] = set()
        for entry in generator:
            if entry["question"] in seen or entry["question"] in drawn:
                continue
            drawn.add(entry["question"])
            if len(examples) < _NUM_EXAMPLES_PER_LEVEL:
                examples.append(entry)
                continue
            answer = str(entry["answer"])
            split = next(
                (split for split in items if len(items[split]) < sizes[split] and counts[split][answer] < caps[split]
                 and task_answers[split][answer] + counts[split][answer] < task_caps[split]),
                None,
            )  # fmt: skip
            if split is not None:
                items[split].append(entry)
                counts[split][answer] += 1
                if all(len(items[split]) == sizes[split] for split in items):
                    break
        found = len(items["test"]) + len(items["train"])
        if found == wanted or found < 2:
            break
        wanted = found
    if found < 2:
        raise ValueError(
            f"Task {task!r} at difficulty {difficulty!r} yields only {len(examples) + found} distinct questions not "
            f"already used{' within its answer shares' if max_answer_share is not None else ''}, too few for "
            f"{_NUM_EXAMPLES_PER_LEVEL} worked examples plus a train and a test item. Make this tier harder or "
            f"remove it."
        )
    seen.update(entry["question"] for entry in (*examples, *items["test"], *items["train"]))
    for split, counter in counts.items():
        task_answers[split].update(counter)
    return examples, items["test"], items["train"]


def build_reasoning_benchmark(
    tasks: TaskLevels | None = None,
    size: int = 480,
    test_size: float = 0.2,
    seed: int = 0,
    system_prompt: str = SYSTEM_PROMPT,
    max_answer_share: float | None = None,
) -> DatasetDict:
    """Build the default federated GRPO benchmark from reasoning-gym generators.

    Args:
        tasks: task name -> difficulty label -> generator settings; `DEFAULT_TASKS` when `None`. Any
            reasoning-gym task works; those in `WORKED_SOLUTIONS` get reasoning in their worked example.
        size: distinct questions in both splits together, shared evenly by the (task, difficulty) groups. The
            default, 480, gives 384 train and 96 test rows (40 per group), which a CPU evaluates in about
            a minute. A group whose generator cannot produce its share of distinct questions (e.g. there are
            only 200 single-digit sums) gets fewer, with a warning.
        test_size: the fraction of each group that goes to the test split (0.2: the paper's 80/20 split),
            so that both splits hold every group in the same proportions.
        seed: makes the benchmark reproducible: the same arguments give the same rows in the same order.
        system_prompt: the system message of every prompt.
        max_answer_share: no gold answer may be more than this share of a task's test items, or of its train items,
            nor of a (task, difficulty) group's where the group's split has at least 1 / `max_answer_share` items:
            draws are stratified by answer, skipping a question whose answer has filled its share
            (`build_balanced_benchmark`). A group that runs out of questions leaves its task smaller than planned,
            which can lift a share above it (said in a warning). None: the generators' own answer distribution.

    Returns:
        A `DatasetDict` with `"train"` and `"test"` splits and columns `prompt` (conversational: system,
        worked example, question), `answer` (the reference), `difficulty`, `category` (the task name),
        `question` (the plain question, unique across both splits) and `rg_entry` (the reasoning-gym entry
        as JSON, which `scoring.rewards.answer_accuracy_reward` scores with the task's own scorer). The train
        split is shuffled; the test split is grouped by task and difficulty.
    """
    tasks = DEFAULT_TASKS if tasks is None else tasks
    groups = [(task, difficulty, config) for task, levels in tasks.items() for difficulty, config in levels.items()]
    if not groups:
        raise ValueError("tasks is empty: give at least one reasoning-gym task with at least one difficulty.")
    if size < 2 * len(groups):
        raise ValueError(
            f"size={size} is too small for {len(groups)} (task, difficulty) groups: each needs at least one train "
            f"and one test item, so size must be at least {2 * len(groups)}."
        )
    if not 0 < test_size < 1:
        raise ValueError(f"test_size must be strictly between 0 and 1, got {test_size}.")

    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    wanted_sizes = [size // len(groups) + (index < size % len(groups)) for index in range(len(groups))]
    # Each task's answer caps, from its planned split sizes, and its answers counted over its tiers as they are drawn.
    task_caps, task_answers = {}, {}
    for task in tasks:
        planned = [_split_sizes(wanted, test_size) for (name, *_), wanted in zip(groups, wanted_sizes) if name == task]
        task_caps[task] = _answer_caps({split: sum(sizes[split] for sizes in planned) for split in ("test", "train")},
                                       max_answer_share)  # fmt: skip
        task_answers[task] = {"test": Counter(), "train": Counter()}
    for (task, difficulty, config), wanted in zip(groups, wanted_sizes):
        examples, test, train = _group_items(
            task, difficulty, config, wanted, test_size, seed, seen, max_answer_share, task_answers[task],
            task_caps[task],
        )
        if len(test) + len(train) < wanted:
            logger.warning(
                "Task %r at difficulty %r has only %d distinct unused questions%s; using %d items instead of %d.",
                task, difficulty, len(examples) + len(test) + len(train),
                " within its answer shares" if max_answer_share is not None else "", len(test) + len(train), wanted,
            )  # fmt: skip
        for split, entry in [*(("test", entry) for entry in test), *(("train", entry) for entry in train)]:
            example = examples[rng.randrange(len(examples))]
            row = {
                "prompt": [
                    {"role": "system", "content": system_prompt},
                    *_worked_example(example, task),
                    {"role": "user", "content": entry["question"]},
                ],
                "answer": entry["answer"],
                "difficulty": difficulty,
                "category": task,
                "question": entry["question"],
                "rg_entry": json.dumps(entry, default=str),
            }
            splits[split].append(row)

    if max_answer_share is not None:
        for task, answers in task_answers.items():
            for split, counter in answers.items():
                answer, count = counter.most_common(1)[0]
                if count > max_answer_share * counter.total():
                    logger.warning("Task %r's gold answer %r is %d of its %d %s items, over the share %g: a tier ran "
                                   "out of questions.", task, answer, count, counter.total(), split, max_answer_share)
    rng.shuffle(splits["train"])
    benchmark = DatasetDict({name: Dataset.from_list(rows) for name, rows in splits.items()})
    logger.info(
        "Built a reasoning-gym benchmark: %d train / %d test rows over %d tasks",
        len(benchmark["train"]), len(benchmark["test"]), len(tasks),
    )  # fmt: skip
    return benchmark


def build_balanced_benchmark(
    size: int = 6000, test_size: float = 0.2, seed: int = 0, system_prompt: str = SYSTEM_PROMPT
) -> DatasetDict:
    """The balanced benchmark (`dataset_name: reasoning_gym_balanced`): `BALANCED_TASKS` with no gold answer over
    `MAX_ANSWER_SHARE` of any task's train or test items, built as `build_reasoning_benchmark` builds the default
    one (three tiers, the 80/20 split, a worked example in every prompt). The default size gives about 1,100 test
    items (single-digit sums and products have only ~200 and ~100 distinct questions), so that one item is under
    0.1 points of total accuracy."""
    return build_reasoning_benchmark(
        BALANCED_TASKS, size=size, test_size=test_size, seed=seed, system_prompt=system_prompt,
        max_answer_share=MAX_ANSWER_SHARE,
    )  # fmt: skip
