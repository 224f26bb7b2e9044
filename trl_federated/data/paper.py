"""The paper's benchmarks: Multimodal-Open-R1-8k-Verified (difficulty tiers) and GEOQA-8k (geometric primitives).

Both are image + question datasets with a verifiable final answer. The builders read the raw rows from the Hugging
Face Hub (the default) or from a local copy with the same columns, label every row with the column the Dirichlet
partitioner splits clients by, and make the paper's stratified 80/20 train/test split (Section 4.2, Appendix C).

Each output row has:

- `prompt`: a conversation, a system message asking for reasoning and a tagged final answer, then the problem as
  the user turn. TRL puts the `image` in front of the user text when it builds the model input.
- `image`: the problem's figure (a PIL image once decoded).
- `answer`: the gold final answer, scored by `trl_federated.rewards.accuracy_reward` (`answers_match`: units,
  unicode and LaTeX normalised, then complete expressions compared).
- `question`: the problem text.
- the label column: `difficulty` (Open-R1) or `category` (GEOQA).

What could only be checked offline: the column schemas below are taken from the datasets' public use (TRL's
`grpo_vlm.py` example for Open-R1; EasyR1's and R1-V's GEOQA recipes), and the repository tests the builders on
fixture datasets with those schemas (`tests/fixtures/`), not on the Hub data itself.
"""

from __future__ import annotations

import logging
import random
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from datasets import Dataset, DatasetDict, Image, List, concatenate_datasets, load_dataset, load_from_disk

from ..rewards import extract_answer
from .reasoning_gym import DIFFICULTIES

logger = logging.getLogger(__name__)

OPEN_R1_DATASET = "lmms-lab/multimodal-open-r1-8k-verified"
"""Hub id of Multimodal-Open-R1-8k-Verified (7.69k rows, one `train` split)."""

GEOQA_DATASET = "leonardPKU/GEOQA_8K_R1V"
"""Hub id of GEOQA-8k as R1-V and EasyR1 publish it (`train` and `test` splits, merged and re-split 80/20 here)."""

VISUAL_SYSTEM_PROMPT = (
    "You are a helpful assistant. Look at the image, reason step by step, then give the final answer inside "
    "<answer></answer>."
)
"""The system message of every paper-benchmark prompt: the answer tags are what the accuracy reward reads."""

GEOMETRY_PRIMITIVES = ("points", "lines", "circles", "polygons")
"""GEOQA's categories, in the order of the paper's Table 1."""

Source = str | Path | Dataset | DatasetDict

# GEOQA categories: a problem is labelled with the most complex primitive its text names (circles > polygons >
# lines > points). English terms are matched as whole words, case-insensitively; Chinese terms and symbols anywhere.
_CIRCLE_TERMS = re.compile(
    r"\b(circles?|circular|circumference|radius|radii|diameters?|chords?|arcs?|tangents?|sectors?|semicircles?)\b"
    r"|⊙|圆|弦|弧|切线|半径|直径|扇形",
    re.IGNORECASE,
)
_POLYGON_TERMS = re.compile(
    r"\b(triangles?|quadrilaterals?|parallelograms?|rectangles?|squares?|rhomb(us|i|uses)|trapezoids?|trapezi(um|a)"
    r"|polygons?|pentagons?|hexagons?|octagons?)\b"
    r"|△|▱|三角形|四边形|矩形|菱形|正方形|梯形|多边形|五边形|六边形",
    re.IGNORECASE,
)
# "line segment" is a segment between points, not a line relation: it falls through to "points".
_LINE_TERMS = re.compile(
    r"\b(lines?(?!\s+segments?)|parallel|perpendicular|intersect(s|ing|ion)?|rays?|transversals?|bisects?|bisectors?"
    r"|angles?|collinear)\b"
    r"|∥|⊥|∠|直线|射线|平行|垂直|相交|平分|角",
    re.IGNORECASE,
)
_THINK_RE = re.compile(r"<think>(.*?)</think>", re.IGNORECASE | re.DOTALL)
_ANSWER_PAIR_RE = re.compile(r"<answer>.*?</answer>", re.IGNORECASE | re.DOTALL)


def geometry_category(problem: str) -> str:
    """The GEOQA category of a problem, by the geometric primitives its text names.

    The paper partitions GEOQA "by topological complexity and geometric primitives (points, lines, circles,
    polygons)" without publishing the rule; this is ours. A problem gets the most complex primitive it mentions:

    1. `circles`: a circle or one of its parts (circle, radius, diameter, chord, arc, tangent, sector, ⊙, 圆, ...);
    2. else `polygons`: a named polygon (triangle, quadrilateral, parallelogram, rectangle, square, rhombus,
       trapezoid, polygon, △, 三角形, ...);
    3. else `lines`: a line relation or an angle between lines (line, parallel, perpendicular, intersect, ray,
       bisector, angle, ∥, ⊥, ∠, 直线, 平行, ...);
    4. else `points`: problems posed only through points and the segments between them (midpoints, lengths
       along a line segment).

    Matching is on the problem text only (English terms as whole words, any case; Chinese terms and symbols
    anywhere), so it is deterministic and needs no model.
    """
    if _CIRCLE_TERMS.search(problem):
        return "circles"
    if _POLYGON_TERMS.search(problem):
        return "polygons"
    if _LINE_TERMS.search(problem):
        return "lines"
    return "points"


def reasoning_trace(solution: str) -> str:
    """The reasoning part of a solution: the `<think>` content, else the text around the `<answer>` pair."""
    match = _THINK_RE.search(solution)
    if match:
        return match.group(1).strip()
    return _ANSWER_PAIR_RE.sub("", solution).strip()


def difficulty_tiers(lengths: Sequence[int]) -> list[str]:
    """Label each row simple / medium / hard by equal tertiles of its reasoning-trace length (Appendix C).

    Rows are ranked by length and the ranking is cut into three equal thirds (sizes differ by at most one), so
    the tiers are balanced whatever the length distribution; rows of equal length are ranked in dataset order,
    so a tie across a cut is broken deterministically.
    """
    order = sorted(range(len(lengths)), key=lambda index: (lengths[index], index))
    tiers = [""] * len(lengths)
    for rank, index in enumerate(order):
        tiers[index] = DIFFICULTIES[3 * rank // len(lengths)]
    return tiers


def build_open_r1_benchmark(
    source: Source = OPEN_R1_DATASET,
    test_size: float = 0.2,
    seed: int = 0,
    system_prompt: str = VISUAL_SYSTEM_PROMPT,
) -> DatasetDict:
    """Multimodal-Open-R1-8k-Verified with the paper's difficulty tiers and 80/20 split.

    Expected columns (those of `lmms-lab/multimodal-open-r1-8k-verified`, as TRL's `grpo_vlm.py` example reads
    them): `image` (the figure), `problem` (the question) and `solution`, GPT-4o's verified solution with the final
    answer in an `<answer>` pair (what open-r1-multimodal's reward reads), assumed to hold its reasoning in a
    `<think>` block or around that pair. Other columns (`original_question`, `original_answer`) are dropped. The
    gold answer is the content of the `<answer>` pair; `difficulty` is the equal tertile, over all rows, of the
    length in characters of the reasoning (`reasoning_trace`), which the extra column `trace_length` keeps.

    Args:
        source: a Hub dataset id (default: the paper's), a local `save_to_disk` folder or parquet file, or a
            `Dataset` / `DatasetDict` (all splits are pooled before the split).
        test_size: fraction of every difficulty tier that goes to the test split (the paper's 0.2).
        seed: seeds the split and the row order.
        system_prompt: the system message of every prompt.

    Returns:
        `DatasetDict(train=..., test=...)` with columns `prompt`, `image`, `answer`, `question`, `difficulty`,
        `trace_length`.
    """
    rows = _load_rows(source, required=("problem", "solution"), name="Multimodal-Open-R1")
    solutions = list(rows["solution"])
    lengths = [len(reasoning_trace(solution)) for solution in solutions]
    untraced = sum(length == 0 for length in lengths)
    if untraced:
        logger.warning(
            "%d of %d solutions hold no reasoning trace (no <think> block, no text besides the <answer>): they rank "
            "as the shortest, so the difficulty tiers of this source are partly arbitrary.", untraced, len(lengths),
        )  # fmt: skip
    labelled = _standardise(
        rows, system_prompt, solutions, "difficulty", difficulty_tiers(lengths), extra_columns={"trace_length": lengths}
    )
    return _stratified_split(labelled, "difficulty", test_size, seed, name="Multimodal-Open-R1")


def build_geoqa_benchmark(
    source: Source = GEOQA_DATASET,
    test_size: float = 0.2,
    seed: int = 0,
    system_prompt: str = VISUAL_SYSTEM_PROMPT,
    categorise: Callable[[str], str] = geometry_category,
) -> DatasetDict:
    """GEOQA-8k with the paper's geometric-primitive categories and 80/20 split.

    Expected columns: `problem` (the question), the figure as `images` (a list; its first image is used) or
    `image`, and the gold answer as `answer` or as the `<answer>` pair of a `solution` column. The first layout
    is that of `leonardPKU/GEOQA_8K_R1V` as EasyR1 reads it (`problem`, `answer`, `images`); the second that of
    R1-V's `GEOQA_R1V_Train_8K`. Both are accepted so that either copy can be used.

    Args:
        source: a Hub dataset id (default: the paper's), a local `save_to_disk` folder or parquet file, or a
            `Dataset` / `DatasetDict` (all splits, e.g. the Hub's train and test, are pooled and re-split).
        test_size: fraction of every category that goes to the test split (the paper's 0.2).
        seed: seeds the split and the row order.
        system_prompt: the system message of every prompt.
        categorise: maps a problem text to its category; `geometry_category` (whose docstring states the rule)
            by default.

    Returns:
        `DatasetDict(train=..., test=...)` with columns `prompt`, `image`, `answer`, `question`, `category`.
    """
    rows = _load_rows(source, required=("problem",), name="GEOQA")
    answer_column = next((column for column in ("answer", "solution") if column in rows.column_names), None)
    if answer_column is None:
        raise ValueError(
            f"The GEOQA source has neither an `answer` nor a `solution` column (columns: {rows.column_names})."
        )
    labels = [categorise(problem) for problem in rows["problem"]]
    answers = list(rows[answer_column])
    labelled = _standardise(rows, system_prompt, answers, "category", labels)
    return _stratified_split(labelled, "category", test_size, seed, name="GEOQA")


def _load_rows(source: Source, required: Sequence[str], name: str) -> Dataset:
    """All rows of `source` as one `Dataset`, after checking that it has the `required` columns and an image."""
    if isinstance(source, DatasetDict):
        loaded: Dataset | DatasetDict = source
    elif isinstance(source, Dataset):
        loaded = source
    else:
        path = Path(source)
        if path.is_dir() and any((path / marker).exists() for marker in ("dataset_dict.json", "state.json")):
            # In memory: later maps, shuffles and selections must not write cache files into someone's folder.
            loaded = load_from_disk(str(path), keep_in_memory=True)
        elif path.is_file() and path.suffix == ".parquet":
            loaded = load_dataset("parquet", data_files=str(path), split="train")
        else:
            loaded = load_dataset(str(source))  # a Hub id, or a folder of data files
    rows = concatenate_datasets(list(loaded.values())) if isinstance(loaded, DatasetDict) else loaded
    missing = [column for column in required if column not in rows.column_names]
    if not any(column in rows.column_names for column in ("image", "images")):
        missing.append("image (or images)")
    if missing:
        raise ValueError(f"The {name} source lacks the columns {missing} (columns: {rows.column_names}).")
    if len(rows) == 0:
        raise ValueError(f"The {name} source has no rows.")
    return rows


def _gold_answer(text: str | None) -> str:
    """The content of the last `<answer>` pair of `text`, else `text` itself, stripped ("" for no answer)."""
    if text is None:
        return ""
    tagged = extract_answer(text)
    return (tagged if tagged is not None else text).strip()


def _standardise(
    rows: Dataset,
    system_prompt: str,
    answers: Sequence[str | None],
    label_column: str,
    labels: Sequence[str],
    extra_columns: dict[str, Sequence] | None = None,
) -> Dataset:
    """Rows in the output layout: `prompt`, `image`, `answer`, `question`, the label column and `extra_columns`.

    Rows without a gold answer cannot be rewarded; they are dropped with a warning.
    """
    if "images" in rows.column_names and "image" not in rows.column_names:
        # The first figure of each row, moved as encoded bytes: no image is decoded and re-encoded.
        rows = rows.cast_column("images", List(Image(decode=False)))
        rows = rows.map(
            lambda images: {"image": images[0] if images else None}, input_columns="images", remove_columns="images"
        )
        rows = rows.cast_column("image", Image())
    problems = list(rows["problem"])
    gold = [_gold_answer(answer) for answer in answers]
    standard = rows.select_columns(["image"])
    standard = standard.add_column(
        "prompt", [[{"role": "system", "content": system_prompt}, {"role": "user", "content": p}] for p in problems]
    )
    standard = standard.add_column("answer", gold).add_column("question", problems)
    standard = standard.add_column(label_column, list(labels))
    for name, values in (extra_columns or {}).items():
        standard = standard.add_column(name, list(values))
    unanswered = [index for index, answer in enumerate(gold) if not answer]
    if unanswered:
        logger.warning("Dropping %d rows without a gold answer (first indices: %s).", len(unanswered), unanswered[:5])
        keep = sorted(set(range(len(gold))) - set(unanswered))
        standard = standard.select(keep)
    return standard.select_columns(["prompt", "image", "answer", "question", label_column, *(extra_columns or {})])


def _stratified_split(dataset: Dataset, column: str, test_size: float, seed: int, name: str) -> DatasetDict:
    """`test_size` of every value of `column` to the test split, the rest to train; both shuffled by `seed`.

    Every label with at least two rows has at least one row in each split, so per-label test accuracy is defined.
    """
    if not 0 < test_size < 1:
        raise ValueError(f"test_size must be strictly between 0 and 1, got {test_size}.")
    rng = random.Random(seed)
    by_label: dict[str, list[int]] = defaultdict(list)
    for index, label in enumerate(dataset[column]):
        by_label[label].append(index)
    train, test = [], []
    for label in sorted(by_label):
        indices = by_label[label]
        rng.shuffle(indices)
        num_test = min(max(1, round(test_size * len(indices))), len(indices) - 1) if len(indices) > 1 else 0
        test += indices[:num_test]
        train += indices[num_test:]
    rng.shuffle(train)
    rng.shuffle(test)
    splits = DatasetDict(train=dataset.select(train), test=dataset.select(test))
    logger.info(
        "%s: %d train / %d test rows; %s per split: train %s, test %s",
        name, len(train), len(test), column,
        dict(sorted(Counter(splits["train"][column]).items())), dict(sorted(Counter(splits["test"][column]).items())),
    )  # fmt: skip
    return splits
