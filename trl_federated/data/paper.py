"""The paper's benchmarks: Multimodal-Open-R1-8k-Verified (difficulty tiers) and GEOQA-8k (geometric primitives).

Both are image + question datasets with a verifiable final answer. The builders read the raw rows from the Hugging
Face Hub (the default) or from a local copy with the same columns, drop the rows without a gold answer (counted in the
log), optionally cap the image size (`max_pixels`), label every row with the column the Dirichlet partitioner splits
clients by, and make the paper's stratified 80/20 train/test split (Section 4.2, Appendix C).

Each output row has:

- `prompt`: a conversation, a system message asking for reasoning and a tagged final answer, then the problem as
  the user turn. TRL puts the `image` in front of the user text when it builds the model input.
- `image`: the problem's figure (a PIL image once decoded).
- `answer`: the gold final answer, scored by `scoring.rewards.answer_accuracy_reward` (`answers_match`: units,
  unicode and LaTeX normalised, then complete expressions compared).
- `question`: the problem text, without the `<image>` placeholder some copies carry (the processor places the image).
- the label column: `difficulty` (Open-R1) or `category` (GEOQA).

What could only be checked offline: the column schemas below are inferred from the code that reads these datasets
(TRL's `grpo_vlm.py` example for Open-R1; R1-V's `grpo.py` and EasyR1's `dataset.py` with its GEOQA example for
GEOQA), not read from the Hub, and the repository tests the builders on fixture datasets with those schemas
(`tests/fixtures/`), not on the Hub data itself.
"""

from __future__ import annotations

import io
import logging
import math
import numbers
import random
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from datasets import Dataset, DatasetDict, Image, List, concatenate_datasets, load_dataset, load_from_disk
from PIL import Image as PILImage

from ..scoring.rewards import extract_answer
from .reasoning_gym import DIFFICULTIES

logger = logging.getLogger(__name__)

OPEN_R1_DATASET = "lmms-lab/multimodal-open-r1-8k-verified"
"""Hub id of Multimodal-Open-R1-8k-Verified (7.69k rows, one `train` split)."""

GEOQA_DATASET = "leonardPKU/GEOQA_R1V_Train_8K"
"""Hub id of GEOQA-8k as R1-V publishes it: the paper cites R1-V for GEOQA-8k, and this is the copy R1-V's README
names "GEOQA-8k" and its GEOQA scripts train on. EasyR1's copy, `leonardPKU/GEOQA_8K_R1V`, loads too (see
`build_geoqa_benchmark`)."""

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
# GEOQA writes a right triangle "Rttriangle" (from "Rt△") as one word, which `\btriangle` would miss.
_POLYGON_TERMS = re.compile(
    r"\b((rt)?triangles?|quadrilaterals?|parallelograms?|rectangles?|squares?|rhomb(us|i|uses)|trapezoids?"
    r"|trapezi(um|a)|polygons?|pentagons?|hexagons?|octagons?)\b"
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
_IMAGE_PLACEHOLDER_RE = re.compile(r"\s*<image>\s*", re.IGNORECASE)


def geometry_category(problem: str) -> str:
    """The GEOQA category of a problem, by the geometric primitives its text names.

    The paper partitions GEOQA "by topological complexity and geometric primitives (points, lines, circles,
    polygons)" without publishing the rule; this is ours. A problem gets the most complex primitive it mentions:

    1. `circles`: a circle or one of its parts (circle, radius, diameter, chord, arc, tangent, sector, ⊙, 圆, ...);
    2. else `polygons`: a named polygon (triangle, also as GEOQA's "Rttriangle", quadrilateral, parallelogram,
       rectangle, square, rhombus, trapezoid, polygon, △, 三角形, ...);
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


def _question_text(problem: str) -> str:
    """The problem as the user turn: without the `<image>` placeholder of EasyR1's GEOQA copy, which the processor
    would pass to the model as literal text, since it inserts the image itself."""
    return _IMAGE_PLACEHOLDER_RE.sub(" ", problem).strip()


def check_max_pixels(max_pixels: int | None) -> None:
    """Refuse a `max_pixels` that is not a positive whole number of pixels (None, no cap, is fine)."""
    if max_pixels is None:
        return
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, numbers.Integral) or max_pixels < 1:
        raise ValueError(f"`max_pixels` must be a positive whole number of pixels (None: no cap), got {max_pixels!r}.")


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
    max_pixels: int | None = None,
) -> DatasetDict:
    """Multimodal-Open-R1-8k-Verified with the paper's difficulty tiers and 80/20 split.

    Expected columns (those of `lmms-lab/multimodal-open-r1-8k-verified`, as TRL's `grpo_vlm.py` example reads
    them): `image` (the figure), `problem` (the question) and `solution`, GPT-4o's verified solution with the final
    answer in an `<answer>` pair (what open-r1-multimodal's reward reads), assumed to hold its reasoning in a
    `<think>` block or around that pair. Other columns (`original_question`, `original_answer`) are dropped. The
    gold answer is the content of the last `<answer>` pair; a row whose solution has none is dropped and counted in
    the log, since its gold answer would otherwise be the whole solution, which no completion matches.
    `difficulty` is the equal tertile, over the kept rows, of the length in characters of the reasoning
    (`reasoning_trace`), which the extra column `trace_length` keeps.

    Args:
        source: a Hub dataset id (default: the paper's), a local `save_to_disk` folder or parquet file, or a
            `Dataset` / `DatasetDict` (all splits are pooled before the split).
        test_size: fraction of every difficulty tier that goes to the test split (the paper's 0.2).
        seed: seeds the split and the row order.
        system_prompt: the system message of every prompt.
        max_pixels: the largest image area in pixels; a larger figure is scaled down to it, keeping its aspect
            ratio (None: figures as stored).

    Returns:
        `DatasetDict(train=..., test=...)` with columns `prompt`, `image`, `answer`, `question`, `difficulty`,
        `trace_length`.
    """
    check_max_pixels(max_pixels)
    name = "Multimodal-Open-R1"
    rows, answers = _answered_rows(_load_rows(source, required=("problem", "solution"), name=name), "solution", name)
    lengths = [len(reasoning_trace(solution)) for solution in rows["solution"]]
    untraced = sum(length == 0 for length in lengths)
    if untraced:
        logger.warning(
            "%d of %d solutions hold no reasoning trace (no <think> block, no text besides the <answer>): they rank "
            "as the shortest, so the difficulty tiers of this source are partly arbitrary.", untraced, len(lengths),
        )  # fmt: skip
    questions = [_question_text(problem) for problem in rows["problem"]]
    labelled = _standardise(
        rows, system_prompt, questions, answers, "difficulty", difficulty_tiers(lengths), max_pixels,
        extra_columns={"trace_length": lengths},
    )  # fmt: skip
    return _stratified_split(labelled, "difficulty", test_size, seed, name=name)


def build_geoqa_benchmark(
    source: Source = GEOQA_DATASET,
    test_size: float = 0.2,
    seed: int = 0,
    system_prompt: str = VISUAL_SYSTEM_PROMPT,
    categorise: Callable[[str], str] = geometry_category,
    max_pixels: int | None = None,
) -> DatasetDict:
    """GEOQA-8k with the paper's geometric-primitive categories and 80/20 split.

    Two copies of GEOQA-8k are public, both from R1-V's authors; the columns decide which layout is read, so
    either, or a local copy of either, works as `source`:

    - R1-V's own release, `leonardPKU/GEOQA_R1V_Train_8K` (the default): `image` (one figure), `problem`,
      `solution` with the answer in an `<answer>` pair, one `train` split. The default because the paper cites
      R1-V for GEOQA-8k and this is the copy R1-V's README calls "GEOQA-8k" and trains on.
    - EasyR1's copy, `leonardPKU/GEOQA_8K_R1V`: `images` (a list; its first figure is used), `problem` with an
      `<image>` placeholder where EasyR1 splices in the figure (stripped here: the processor adds the image),
      `answer` (the answer itself), `train` and `test` splits.

    These layouts are inferred from how R1-V's `grpo.py` and EasyR1's `dataset.py` and `qwen2_5_vl_3b_geoqa8k.sh`
    read the two ids (no Hub access here), not checked against the Hub data. A row whose `solution` has no
    `<answer>` pair, or whose answer is empty, is dropped and counted in the log.

    Args:
        source: a Hub dataset id (default: R1-V's copy), a local `save_to_disk` folder or parquet file, or a
            `Dataset` / `DatasetDict` (all splits, e.g. EasyR1's train and test, are pooled and re-split).
        test_size: fraction of every category that goes to the test split (the paper's 0.2).
        seed: seeds the split and the row order.
        system_prompt: the system message of every prompt.
        categorise: maps a problem text to its category; `geometry_category` (whose docstring states the rule)
            by default.
        max_pixels: the largest image area in pixels; a larger figure is scaled down to it, keeping its aspect
            ratio (None: figures as stored).

    Returns:
        `DatasetDict(train=..., test=...)` with columns `prompt`, `image`, `answer`, `question`, `category`.
    """
    check_max_pixels(max_pixels)
    rows = _load_rows(source, required=("problem",), name="GEOQA")
    answer_column = next((column for column in ("answer", "solution") if column in rows.column_names), None)
    if answer_column is None:
        raise ValueError(
            f"The GEOQA source has neither an `answer` nor a `solution` column (columns: {rows.column_names})."
        )
    rows, answers = _answered_rows(rows, answer_column, "GEOQA")
    questions = [_question_text(problem) for problem in rows["problem"]]
    labels = [categorise(question) for question in questions]
    labelled = _standardise(rows, system_prompt, questions, answers, "category", labels, max_pixels)
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


def _answered_rows(rows: Dataset, column: str, name: str) -> tuple[Dataset, list[str]]:
    """The rows of `rows` that have a gold answer in `column`, and those answers; the others are dropped.

    A `solution` column holds the answer in an `<answer>` pair (the last one wins); an `answer` column holds the
    answer itself. A solution without the pair is not its own gold answer: no completion matches a whole reasoning
    text, so such a row would only ever score 0. Every drop is counted in the log, with its reason.
    """
    if column == "solution":
        answers = [extract_answer(text) for text in rows[column]]
    else:
        answers = ["" if text is None else str(text).strip() for text in rows[column]]
    untagged = [index for index, answer in enumerate(answers) if answer is None]
    empty = [index for index, answer in enumerate(answers) if answer == ""]
    if untagged:
        logger.warning(
            "%s: dropping %d of %d rows whose `solution` has no <answer></answer> pair: the whole solution would "
            "become the gold answer, which no completion matches (first indices: %s).",
            name, len(untagged), len(answers), untagged[:5],
        )  # fmt: skip
    if empty:
        logger.warning(
            "%s: dropping %d of %d rows without a gold answer (an empty answer in `%s`; first indices: %s).",
            name, len(empty), len(answers), column, empty[:5],
        )  # fmt: skip
    if not (untagged or empty):
        return rows, answers
    keep = [index for index, answer in enumerate(answers) if answer]
    if not keep:
        raise ValueError(f"No row of the {name} source has a gold answer in its `{column}` column.")
    return rows.select(keep), [answers[index] for index in keep]


def _capped_image(image: dict, max_pixels: int | None) -> dict:
    """An encoded image (`{"bytes", "path"}`) as it is when at most `max_pixels` large, else scaled down to fit.

    As EasyR1's `process_image` does, the scaling keeps the aspect ratio and rounds each side down, so the area
    never exceeds `max_pixels` (a side never goes below 1 pixel). Only an image to scale is decoded; it is
    re-encoded as PNG, which is lossless.
    """
    if max_pixels is None:
        return image
    with PILImage.open(io.BytesIO(image["bytes"]) if image["bytes"] is not None else image["path"]) as figure:
        width, height = figure.size  # from the header: the pixels are read only when the figure is resized
        if width * height <= max_pixels:
            return image
        scale = math.sqrt(max_pixels / (width * height))
        resized = figure.resize((max(1, int(width * scale)), max(1, int(height * scale))))
    buffer = io.BytesIO()
    resized.save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def _figures(rows: Dataset, max_pixels: int | None) -> Dataset:
    """`rows` with each row's figure in an `image` column (the first of an `images` list), capped to `max_pixels`.

    Figures move as encoded bytes: none is decoded and re-encoded unless it has to be scaled down.
    """
    listed = "image" not in rows.column_names
    if not listed and max_pixels is None:
        return rows
    column = "images" if listed else "image"
    rows = rows.cast_column(column, List(Image(decode=False)) if listed else Image(decode=False))

    def figure(value):
        image = (value[0] if value else None) if listed else value
        return {"image": None if image is None else _capped_image(image, max_pixels)}

    rows = rows.map(figure, input_columns=column, remove_columns=column)
    return rows.cast_column("image", Image())


def _standardise(
    rows: Dataset,
    system_prompt: str,
    questions: Sequence[str],
    answers: Sequence[str],
    label_column: str,
    labels: Sequence[str],
    max_pixels: int | None,
    extra_columns: dict[str, Sequence] | None = None,
) -> Dataset:
    """Rows in the output layout: `prompt`, `image`, `answer`, `question`, the label column and `extra_columns`."""
    standard = _figures(rows, max_pixels).select_columns(["image"])
    standard = standard.add_column(
        "prompt", [[{"role": "system", "content": system_prompt}, {"role": "user", "content": q}] for q in questions]
    )
    standard = standard.add_column("answer", list(answers)).add_column("question", list(questions))
    standard = standard.add_column(label_column, list(labels))
    for name, values in (extra_columns or {}).items():
        standard = standard.add_column(name, list(values))
    return standard


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
