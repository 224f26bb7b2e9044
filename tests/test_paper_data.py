"""The paper's benchmark builders on offline fixtures with the Hub datasets' schemas (tests/fixtures/)."""

import math
from collections import Counter

import pytest
from datasets import Dataset, Features, Image, List, Value, load_from_disk
from PIL import Image as PILImage

from conftest import GEOQA_FIXTURE, GEOQA_R1V_FIXTURE, OPEN_R1_FIXTURE
from trl_federated.data import (
    DIFFICULTIES,
    GEOMETRY_PRIMITIVES,
    GEOQA_DATASET,
    build_geoqa_benchmark,
    build_open_r1_benchmark,
    difficulty_tiers,
    geometry_category,
    partition_clients,
)
from trl_federated.data.paper import VISUAL_SYSTEM_PROMPT, reasoning_trace
from trl_federated.scoring.rewards import answer_accuracy_reward, extract_answer

RECIPE_MAX_PIXELS = 501_760  # the paper recipes' cap (examples/configs/paper/)


@pytest.fixture(scope="module")
def open_r1():
    return build_open_r1_benchmark(str(OPEN_R1_FIXTURE))


@pytest.fixture(scope="module")
def geoqa():
    return build_geoqa_benchmark(str(GEOQA_FIXTURE))


def test_open_r1_tiers_are_equal_tertiles_of_trace_length(open_r1):
    rows = [row for split in open_r1.values() for row in split.to_list()]
    assert len(rows) == 24
    assert Counter(row["difficulty"] for row in rows) == {"simple": 8, "medium": 8, "hard": 8}
    by_tier = {tier: [row["trace_length"] for row in rows if row["difficulty"] == tier] for tier in DIFFICULTIES}
    assert max(by_tier["simple"]) <= min(by_tier["medium"]) and max(by_tier["medium"]) <= min(by_tier["hard"])
    tagged = [s for s in load_from_disk(str(OPEN_R1_FIXTURE))["solution"] if extract_answer(s) is not None]
    assert sorted(row["trace_length"] for row in rows) == sorted(len(reasoning_trace(s)) for s in tagged)


def test_open_r1_solutions_without_an_answer_pair_are_dropped_and_counted(caplog):
    raw = load_from_disk(str(OPEN_R1_FIXTURE))
    untagged = [index for index, solution in enumerate(raw["solution"]) if "<answer>" not in solution]
    assert untagged == [4, 13, 22]
    splits = build_open_r1_benchmark(str(OPEN_R1_FIXTURE))
    answers = [answer for split in splits.values() for answer in split["answer"]]
    assert len(answers) == 24 and not any("<think>" in answer or "result is" in answer for answer in answers)
    assert (
        "Multimodal-Open-R1: dropping 3 of 27 rows whose `solution` has no <answer></answer> pair: the whole "
        "solution would become the gold answer, which no completion matches (first indices: [4, 13, 22])"
    ) in caplog.text


def test_open_r1_rows_hold_prompt_image_and_gold_answer(open_r1):
    raw = {row["problem"]: row for row in load_from_disk(str(OPEN_R1_FIXTURE)).to_list()}
    for split in open_r1.values():
        assert set(split.column_names) == {"prompt", "image", "answer", "question", "difficulty", "trace_length"}
        for row in split:
            assert row["prompt"] == [
                {"role": "system", "content": VISUAL_SYSTEM_PROMPT},
                {"role": "user", "content": row["question"]},
            ]
            assert isinstance(row["image"], PILImage.Image) and row["image"].size == (48, 48)
            assert raw[row["question"]]["solution"].endswith(f"<answer>{row['answer']}</answer>")


def test_splits_are_80_20_within_every_label(open_r1, geoqa):
    for split, per_label in (("train", 6), ("test", 2)):
        assert Counter(open_r1[split]["difficulty"]) == {"simple": per_label, "medium": per_label, "hard": per_label}
    # GEOQA's Hub train and test splits (20 + 4 rows) are pooled and re-split by category
    for split, per_label in (("train", 5), ("test", 1)):
        assert Counter(geoqa[split]["category"]) == {primitive: per_label for primitive in GEOMETRY_PRIMITIVES}


def test_split_is_seeded(geoqa):
    again = build_geoqa_benchmark(str(GEOQA_FIXTURE), seed=0)
    other = build_geoqa_benchmark(str(GEOQA_FIXTURE), seed=1)
    assert list(again["test"]["question"]) == list(geoqa["test"]["question"])
    assert set(other["test"]["question"]) != set(geoqa["test"]["question"])
    every = sorted([*geoqa["train"]["question"], *geoqa["test"]["question"]])
    assert sorted([*other["train"]["question"], *other["test"]["question"]]) == every  # the same rows, re-split


def test_geoqa_rows_take_the_first_image_of_the_list_and_the_answer_column(geoqa):
    raw = load_from_disk(str(GEOQA_FIXTURE))
    answers = {row["problem"].removeprefix("<image>"): row["answer"] for split in raw.values() for row in split}
    for row in geoqa["test"]:
        assert isinstance(row["image"], PILImage.Image)
        assert row["answer"] == answers[row["question"]]
        assert row["category"] == geometry_category(row["question"])


def test_gold_answers_earn_the_full_reward(open_r1, geoqa):
    for split in (open_r1["test"], geoqa["train"]):
        completions = [[{"role": "assistant", "content": f"I reason. <answer>{a}</answer>"}] for a in split["answer"]]
        assert answer_accuracy_reward(completions, answer=split["answer"]) == [1.0] * len(split)
        wrong = [[{"role": "assistant", "content": "<answer>-1</answer>"}]] * len(split)
        assert answer_accuracy_reward(wrong, answer=split["answer"]) == [0.0] * len(split)


def test_label_column_feeds_the_dirichlet_partitioner(geoqa, fast_args):
    args = fast_args(num_clients=2, partition_column="category", dirichlet_alpha=0.05)
    clients = partition_clients(geoqa["train"], args)
    assert sum(len(client) for client in clients) == len(geoqa["train"])
    assert all(set(client.column_names) == set(geoqa["train"].column_names) for client in clients)


def test_geoqa_questions_lose_the_image_placeholder(geoqa):
    raw = load_from_disk(str(GEOQA_FIXTURE))
    assert all(problem.startswith("<image>") for split in raw.values() for problem in split["problem"])
    for row in (row for split in geoqa.values() for row in split):
        assert "<image>" not in row["question"] and row["prompt"][1]["content"] == row["question"]
    rows = Dataset.from_list(
        [{"images": [PILImage.new("RGB", (8, 8))], "problem": problem, "answer": "1"}
         for problem in ["<image>\nLine a ∥ b.", "Line a ∥ b. <image>", "Line a <image> ∥ b.", "Line a ∥ b."]],
        features=Features(images=List(Image()), problem=Value("string"), answer=Value("string")),
    )  # fmt: skip
    splits = build_geoqa_benchmark(rows, test_size=0.25)
    assert {row["question"] for split in splits.values() for row in split} == {"Line a ∥ b."}


def test_both_geoqa_copies_give_the_same_benchmark(geoqa):
    r1v = build_geoqa_benchmark(str(GEOQA_R1V_FIXTURE))  # image, problem, tagged solution; one split
    columns = ["prompt", "answer", "question", "category"]
    for split in ("train", "test"):
        assert r1v[split].select_columns(columns).to_list() == geoqa[split].select_columns(columns).to_list()
    assert GEOQA_DATASET == "leonardPKU/GEOQA_R1V_Train_8K"  # R1-V's own release, which the paper cites


def test_max_pixels_scales_down_only_larger_figures_keeping_their_aspect_ratio():
    sizes = {row["problem"]: row["image"].size for row in load_from_disk(str(GEOQA_R1V_FIXTURE))["train"]}
    splits = build_geoqa_benchmark(str(GEOQA_R1V_FIXTURE), max_pixels=RECIPE_MAX_PIXELS)
    scaled = []
    for row in (row for split in splits.values() for row in split):
        (width, height), (new_width, new_height) = sizes[row["question"]], row["image"].size
        if width * height <= RECIPE_MAX_PIXELS:
            assert (new_width, new_height) == (width, height)
        else:
            scaled.append((width, height))
            assert 0.99 * RECIPE_MAX_PIXELS <= new_width * new_height <= RECIPE_MAX_PIXELS
            assert new_width / new_height == pytest.approx(width / height, rel=0.01)
    assert sorted(scaled) == [(600, 900), (1024, 768)]
    # the cap also applies to the first figure of an `images` list (EasyR1's copy of 48 x 48 figures)
    easyr1 = build_geoqa_benchmark(str(GEOQA_FIXTURE), max_pixels=24 * 24)
    assert {row["image"].size for split in easyr1.values() for row in split} == {(24, 24)}


@pytest.mark.parametrize("max_pixels", [0, -1, math.nan, 1.5, True])
def test_bad_max_pixels_are_refused_by_name(max_pixels):
    for build, source in ((build_geoqa_benchmark, GEOQA_FIXTURE), (build_open_r1_benchmark, OPEN_R1_FIXTURE)):
        with pytest.raises(ValueError, match="`max_pixels` must be a positive whole number"):
            build(str(source), max_pixels=max_pixels)


@pytest.mark.parametrize(
    ("problem", "category"),
    [
        ("As shown in the figure, AB is the diameter of ⊙O, ∠BAC = 30°, then ∠ADC = ?", "circles"),
        ("In triangle ABC inscribed in a circle, the chord AB = 6. Find the radius.", "circles"),  # circle wins
        ("如图，AB是圆O的直径，∠C=30°，则∠ABD的度数是（）", "circles"),
        ("As shown in the figure, in parallelogram ABCD, ∠A = 110°, then ∠C = ?", "polygons"),
        ("As shown in the figure, in Rttriangle ABC, ∠C = 90°, AC = 3, BC = 4, then AB = ?", "polygons"),  # "Rt△"
        ("如图，在△ABC中，∠A=50°，∠B=60°，则∠C的度数为（）", "polygons"),
        ("As shown in the figure, line a ∥ line b, ∠1 = 50°, then ∠2 = ?", "lines"),
        ("As shown, OC bisects ∠AOB and ∠AOC = 35°. Find ∠AOB.", "lines"),
        ("如图，直线AB、CD相交于点O，∠AOC=70°，则∠BOD=（）", "lines"),
        ("Point C is on the line segment AB, AC = 6, and D is the midpoint of CB. If AB = 10, find AD.", "points"),
        ("如图，点C是线段AB上一点，AC=4，BC=6，点D是AB的中点，则CD=（）", "points"),
    ],
)
def test_geometry_category_rule(problem, category):
    assert geometry_category(problem) == category


def test_difficulty_tiers_split_ties_by_position():
    assert difficulty_tiers([5, 1, 9, 1, 7, 3]) == ["medium", "simple", "hard", "simple", "hard", "medium"]
    assert difficulty_tiers([4] * 7) == ["simple"] * 3 + ["medium"] * 2 + ["hard"] * 2


def test_reasoning_trace_is_the_think_block_else_the_text_around_the_answer():
    assert reasoning_trace("<think> add 2 and 3 </think>\n<answer>5</answer>") == "add 2 and 3"
    assert reasoning_trace("Adding gives 5. <answer>5</answer>") == "Adding gives 5."


def test_solutions_without_reasoning_are_flagged(caplog):
    rows = Dataset.from_list(
        [{"image": PILImage.new("RGB", (8, 8)), "problem": f"Q{i}", "solution": f"<answer>{i}</answer>"}
         for i in range(6)],
        features=Features(image=Image(), problem=Value("string"), solution=Value("string")),
    )
    splits = build_open_r1_benchmark(rows)
    assert len(splits["train"]) + len(splits["test"]) == 6
    assert "6 of 6 solutions hold no reasoning trace" in caplog.text


def test_rows_without_a_gold_answer_are_dropped(caplog):
    rows = Dataset.from_list(
        [{"image": PILImage.new("RGB", (8, 8)), "problem": f"Line a meets line b at {i}°.", "answer": a}
         for i, a in enumerate(["1", "", "3", "4", "5", "6"])],
        features=Features(image=Image(), problem=Value("string"), answer=Value("string")),
    )  # fmt: skip
    splits = build_geoqa_benchmark(rows)
    assert len(splits["train"]) + len(splits["test"]) == 5
    assert "without a gold answer" in caplog.text
    solutions = [f"<think>{'x' * i}</think><answer>{a}</answer>" for i, a in enumerate(["1", "", "3", "4", "5", "6"])]
    splits = build_open_r1_benchmark(rows.remove_columns("answer").add_column("solution", solutions))
    kept = sorted((row["answer"], row["trace_length"]) for split in splits.values() for row in split)
    assert kept == [("1", 0), ("3", 2), ("4", 3), ("5", 4), ("6", 5)]  # each row keeps its own trace length


def test_missing_columns_are_named():
    no_image = Dataset.from_dict({"problem": ["p"], "solution": ["<answer>1</answer>"]})
    with pytest.raises(ValueError, match=r"image \(or images\)"):
        build_open_r1_benchmark(no_image)
    with pytest.raises(ValueError, match="'solution'"):
        build_open_r1_benchmark(Dataset.from_dict({"problem": ["p"], "image": [None]}))
    with pytest.raises(ValueError, match="neither an `answer` nor a `solution`"):
        build_geoqa_benchmark(Dataset.from_dict({"problem": ["p"], "image": [None]}))
    with pytest.raises(ValueError, match="test_size"):
        build_geoqa_benchmark(str(GEOQA_FIXTURE), test_size=1.0)
