"""Held-out accuracy per label, and the paper's Table 1 layout to report it.

Evaluation is greedy, so numbers are reproducible and comparable across rounds and runs; it is batched with
left padding (generation appends on the right, so every prompt must end at the same position). `evaluate_accuracy`
scores with `answer_accuracy_reward` unless given `reward_funcs`; the federation's server (`FederatedRunner`,
`FederatedStrategy`) passes the training reward functions, weighted as in training, unless given
`eval_reward_funcs`, so what is reported is what is optimised; `trl-federated run` passes `eval_reward_funcs`
(default: accuracy). Vision-language models are evaluated through their processor, with each row's `image` (or `images`)
placed in its prompt as TRL does in training. The server evaluates in the training's mixed precision, and under
`accelerate launch` on every process, each generating its share of the batches.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import BatchEncoding, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin
from trl.data_utils import prepare_multimodal_messages

from ..adapters import AdapterState, set_adapter_state
from ..data.paper import GEOMETRY_PRIMITIVES
from ..data.reasoning_gym import DIFFICULTIES
from ..runtime.generation import fast_generation_engine
from ..runtime.memory import release_free_memory
from ..scoring.rewards import answer_accuracy_reward, extract_answer
from .admission import MIN_MEDIAN_CLIENTS, SAMPLES_MEDIAN_SPREAD, bounded_text, plain_number

if TYPE_CHECKING:
    from peft import PeftModel

    from ..config import FedGRPOConfig

logger = logging.getLogger(__name__)

TOTAL = "Total"
"""The key of the all-rows entry in evaluation results and the last column of accuracy tables."""

TASK_COLUMN = "category"
"""The column that names each row's task in the embedded benchmarks; `row_labels` records it where present."""

RewardFunc = Callable[..., Sequence[float | None]]


def check_eval_reward_funcs(reward_funcs: RewardFunc | Sequence[RewardFunc]) -> list[RewardFunc]:
    """`reward_funcs` as a list of the reward functions evaluation can call; a reward model (TRL also accepts a
    model or its id) raises, since evaluation scores with functions only."""
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    models = [func for func in funcs if isinstance(func, (str, torch.nn.Module)) or not callable(func)]
    if models:
        raise ValueError(
            f"Evaluation scores with reward functions, not reward models ({models}): pass `eval_reward_funcs`."
        )
    return funcs


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtype `accelerate` autocasts a `Trainer`'s forward passes to under each `TrainingArguments.mixed_precision`."""

ANSWER_STOP = ("</answer>",)
"""Where evaluation stops a completion by default: the closing tag of the paper's answer format."""


# Labels with a natural order, in the paper's column order: the difficulty tiers, then GEOQA's primitives.
_ORDERED_LABELS = (*DIFFICULTIES, *GEOMETRY_PRIMITIVES)


def _ordered_labels(labels: Iterable[str]) -> list[str]:
    """The difficulty tiers (simple, medium, hard) and GEOQA's primitives (points, lines, circles, polygons) in
    their natural order, then the rest sorted."""
    labels = set(labels) - {TOTAL}
    return [label for label in _ORDERED_LABELS if label in labels] + sorted(labels - set(_ORDERED_LABELS))


def _render_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[Any]) -> tuple[list[str], bool]:
    """Prompt texts ready to tokenize, and whether they came from conversations (TRL's two prompt formats)."""
    conversational = isinstance(prompts[0], list)
    if not conversational:
        return list(prompts), False
    texts = [tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) for prompt in prompts]
    return texts, True


def _model_inputs(
    processing_class: PreTrainedTokenizerBase | ProcessorMixin, batch: dict[str, list[Any]]
) -> tuple[BatchEncoding, bool]:
    """The left-padded model inputs of a batch of rows, and whether its prompts are conversations.

    A processor gets each row's images (`images`, else `image`) inserted into its conversation before the first
    user turn, as `GRPOTrainer` does, and returns the pixel inputs with the token ids.
    """
    if isinstance(processing_class, ProcessorMixin):
        prompts = batch["prompt"]
        if not isinstance(prompts[0], list):
            raise ValueError("Evaluating a vision-language model needs conversational prompts.")
        if "images" in batch:
            images = batch["images"]
        else:
            images = [[image] if image is not None else [] for image in batch.get("image", [None] * len(prompts))]
        conversations = [
            prepare_multimodal_messages(prompt, images=row_images) for prompt, row_images in zip(prompts, images)
        ]
        inputs = processing_class.apply_chat_template(
            conversations, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
            processor_kwargs={"padding": True},
        )  # fmt: skip
        return inputs, True
    texts, conversational = _render_prompts(processing_class, batch["prompt"])
    # A chat template writes its own special tokens; a plain prompt gets the tokenizer's usual ones.
    inputs = processing_class(texts, return_tensors="pt", padding=True, add_special_tokens=not conversational)
    return inputs, conversational


def evaluate_accuracy(
    model: PreTrainedModel | PeftModel,
    processing_class: PreTrainedTokenizerBase | ProcessorMixin,
    dataset: Dataset,
    label_column: str | None = "difficulty",
    batch_size: int = 16,
    max_new_tokens: int = 64,
    reward_funcs: RewardFunc | Sequence[RewardFunc] = answer_accuracy_reward,
    reward_weights: Sequence[float] | None = None,
    stop_strings: Sequence[str] = ANSWER_STOP,
    mixed_precision: str = "no",
    distributed: bool = False,
    fast_generation: bool = False,
    generation_dtype: str = "auto",
    show_progress: bool = True,
    keep_completions: bool = False,
) -> dict[str, Any]:
    """Greedy-decode every prompt of `dataset` and report the mean reward, overall and per value of `label_column`.

    Prompts are generated in batches of similar length (sorted by token count), so little compute goes into
    padding, and a row stops at the first of `stop_strings` (by default the closing answer tag: with the paper's
    format nothing after it is scored), so a batch ends when its slowest row has answered instead of after
    `max_new_tokens` for every row.

    Args:
        model: a causal LM or a vision-language model, or a `PeftModel` wrapping one. Put in eval mode for the
            duration and returned to training mode afterwards if it was in it.
        processing_class: its tokenizer, or its processor for a vision-language model; the tokenizer's
            `padding_side` is set to `"left"` for the duration and then restored.
        dataset: rows with a `prompt` column (a conversation or a plain string), and for a vision-language model
            an `image` (or `images`) column. Its other columns (e.g. `answer`, `solution`, `rg_entry`) are passed to
            the reward functions as keyword lists, as TRL does.
        label_column: the column to break accuracy down by; without it in `dataset` (or None) only the Total is
            reported.
        batch_size: prompts generated together. Greedy decoding with left padding gives the same completions
            for any batch size, up to floating-point ties.
        max_new_tokens: the generation budget per prompt; a completion cut off before closing its answer tag
            scores 0 with the default reward.
        reward_funcs: a TRL-style reward function or a list of them. A row's reward is their sum weighted by
            `reward_weights` (default 1 each), as TRL's `reward`; a `None` reward (TRL's "not applicable") counts
            as 0 there. With the one binary `answer_accuracy_reward` the mean reward is the accuracy.
        reward_weights: one weight per reward function, as `GRPOConfig.reward_weights`.
        stop_strings: texts that end a completion (kept in it); empty to always generate `max_new_tokens`. With
            the default, the first complete answer is the one scored, also where `answer_accuracy_reward` on a longer
            completion would score a later one.
        mixed_precision: the training's `TrainingArguments.mixed_precision` ("no", "bf16" or "fp16"): generation
            runs under `torch.autocast` to its dtype on the model's device, as `accelerate` runs a `Trainer`'s
            forward passes (fp16 on an accelerator only, as there); the weights keep their dtype.
        distributed: under `accelerate launch`, every process calls this together, with the same model and data:
            process k of K generates and scores the batches k, k + K, ..., and the per-row scores are gathered, so
            each batch is computed as one process computes it and every process returns one process's result.
        fast_generation: generate from a plain copy of the model with its LoRA adapter merged, in
            `generation_dtype`, with eager attention on CPU (`fast_generation.MergedGenerationModel`): no adapter
            wrappers in the decode loop. A change of float rounding: in float32 the completions are the standard
            path's but at near-ties. A model it does not cover (a vision-language model, a non-LoRA adapter) is
            generated as without it, with a warning.
        generation_dtype: "float32", "bfloat16", or "auto" (bfloat16 where the device computes it natively), as
            `FedGRPOConfig.generation_dtype`; only with `fast_generation`.
        show_progress: a progress bar over the items ("Evaluating", on the main process); False for none.
        keep_completions: also return each row's completion text ("completions"), for a record of what was answered.

    Returns:
        `{"accuracy": {label: mean reward, ..., "Total": ...}, "count": {label: rows, ..., "Total": rows},
        "rewards": {function name: mean over the rows it scored}, "row_rewards": [each row's reward, in the order
        of `dataset`], "seconds": wall time}`, labels in the order simple, medium, hard, then the others sorted.
        `row_rewards` (1.0 or 0.0 per row with the binary accuracy) pairs two evaluations of the same split row by
        row, for a paired test of a gain (`benchmarks/gate.py`). Beside it, in the same order: "row_labels" (each
        row's task, the `category` column, else its `label_column` value; None without either), "row_gold" (the
        `answer` column as text; None without it) and "row_answers" (the text of the completion's answer as the reward
        reads it, `rewards.extract_answer`; None where it has no `<answer></answer>` pair), so that what a model
        answered is on record, not inferred from which rows scored.
    """
    reward_funcs = check_eval_reward_funcs(reward_funcs)
    weights = list(reward_weights) if reward_weights is not None else [1.0] * len(reward_funcs)
    if len(weights) != len(reward_funcs):
        raise ValueError(f"{len(weights)} reward_weights for {len(reward_funcs)} reward functions.")
    if "prompt" not in dataset.column_names:
        raise ValueError(f"The evaluation dataset has no column 'prompt' (columns: {dataset.column_names}).")
    if len(dataset) == 0:
        raise ValueError("The evaluation dataset is empty.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")

    started = time.perf_counter()
    reward_columns = [column for column in dataset.column_names if column != "prompt"]
    batches = _batches_by_length(dataset["prompt"], batch_size)
    if distributed:
        state = PartialState()
        own_batches = batches[state.process_index :: state.num_processes]
    else:
        own_batches = batches
    # Each row's value from each reward function (None: TRL's "not applicable") and its completion, for the rows
    # this process scores.
    row_values: list[tuple[int, list[float | None], str]] = []
    was_training = model.training
    tokenizer = processing_class.tokenizer if isinstance(processing_class, ProcessorMixin) else processing_class
    padding_side = tokenizer.padding_side
    autocast_dtype = AUTOCAST_DTYPES.get(mixed_precision)
    if mixed_precision == "fp16" and model.device.type == "cpu":
        autocast_dtype = None  # accelerate trains fp16 on a CPU without autocast
    model.eval()
    generator = model
    if fast_generation:
        fast = fast_generation_engine()  # the client side's (`local.fast_generation`)
        reason = "a vision-language model" if isinstance(processing_class, ProcessorMixin) else None
        reason = reason or fast.unsupported_reason(model)
        if reason is None:
            dtype = fast.resolve_generation_dtype(generation_dtype, model.device)
            generator = fast.merged_generator(model, dtype)
        else:
            logger.warning("Evaluation generates without fast_generation: %s.", reason)
    tokenizer.padding_side = "left"
    # Minutes of greedy decoding on CPU: a bar over the items, as `Trainer` shows one over its steps (main process).
    # Under a bar already open (the runner's "Federated rounds") it takes the line below, and tqdm moves the cursor
    # back up (ESC [A) as it clears it: where stderr is no terminal that lands in the log as text, so there it is none.
    nested_in_a_log = bool(tqdm._instances) and not sys.stderr.isatty()
    progress = tqdm(total=sum(map(len, own_batches)), desc="Evaluating", unit="item", leave=False,
                    disable=not show_progress or nested_in_a_log
                    or (distributed and not PartialState().is_main_process))
    try:
        for indices in own_batches:
            batch = dataset[indices]
            inputs, conversational = _model_inputs(processing_class, batch)
            inputs = inputs.to(model.device)
            autocast = torch.autocast(model.device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
            with torch.inference_mode(), autocast:
                output_ids = generator.generate(
                    **inputs,
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    stop_strings=list(stop_strings) or None,
                    tokenizer=tokenizer,
                )
            texts = tokenizer.batch_decode(output_ids[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            completions = [[{"role": "assistant", "content": text}] for text in texts] if conversational else texts
            columns = {column: batch[column] for column in reward_columns}
            per_function = [func(prompts=batch["prompt"], completions=completions, **columns) for func in reward_funcs]
            for index, text, *values in zip(indices, texts, *per_function, strict=True):
                row_values.append((index, [None if value is None else float(value) for value in values], text))
            progress.update(len(indices))
    finally:
        progress.close()
        tokenizer.padding_side = padding_side
        if was_training:
            model.train()
    if distributed:
        row_values = gather_object(row_values)

    # From here on, every sum runs in one process's order: rows in batch order, functions in their order.
    values_of = {index: values for index, values, _ in row_values}
    texts_of = {index: text for index, _, text in row_values}
    rewards: list[float] = [0.0] * len(dataset)
    # Each function's mean skips the rows it returned None for, as TRL's `rewards/<name>/mean` does; TRL names a
    # reward function by its `__name__`.
    scored: dict[str, list[float]] = {func.__name__: [] for func in reward_funcs}
    for index in (index for indices in batches for index in indices):
        for func, weight, value in zip(reward_funcs, weights, values_of[index]):
            if value is not None:
                rewards[index] += weight * value
                scored[func.__name__].append(value)

    per_label: dict[str, list[float]] = defaultdict(list)
    if label_column in dataset.column_names:
        for label, reward in zip(dataset[label_column], rewards, strict=True):
            per_label[str(label)].append(reward)
    labels = _ordered_labels(per_label)
    accuracy: dict[str, float | int] = {label: sum(per_label[label]) / len(per_label[label]) for label in labels}
    count: dict[str, float | int] = {label: len(per_label[label]) for label in labels}
    accuracy[TOTAL] = sum(rewards) / len(rewards)
    count[TOTAL] = len(rewards)
    function_means = {name: sum(values) / len(values) if values else None for name, values in scored.items()}
    seconds = time.perf_counter() - started
    logger.info(
        "Accuracy by %s: %s (%d rows in %.1f s)",
        label_column, {label: round(value, 4) for label, value in accuracy.items()}, len(rewards), seconds,
    )
    completions = [texts_of[index] for index in range(len(dataset))]
    label_of = TASK_COLUMN if TASK_COLUMN in dataset.column_names else label_column
    results = {
        "accuracy": accuracy, "count": count, "rewards": function_means, "row_rewards": rewards,
        "row_labels": [str(label) for label in dataset[label_of]] if label_of in dataset.column_names else None,
        "row_gold": [str(gold) for gold in dataset["answer"]] if "answer" in dataset.column_names else None,
        "row_answers": [extract_answer(text) for text in completions],
        "seconds": seconds,
    }  # fmt: skip
    if keep_completions:
        results["completions"] = completions
    return results


COMPLETIONS_FILE = "eval-completions.jsonl"
"""The latest server evaluation's completions, one JSON line per test item, beside `result.json`."""

COMPLETION_CHARACTERS = 400
"""A completion's first characters kept in `COMPLETIONS_FILE`: the evaluation's 64-token budget is ~250 of them."""


def write_completions(path: Path, round_idx: int, results: dict[str, Any]) -> None:
    """`COMPLETIONS_FILE`: per test item in order, its task, gold answer, parsed answer, reward and completion (cut to
    `COMPLETION_CHARACTERS`), from an `evaluate_accuracy` result with `keep_completions`; written whole, replacing the
    previous evaluation's, so that the file a run ends with is its final evaluation's."""
    columns = ("row_labels", "row_gold", "row_answers", "row_rewards")
    rows = zip(*(results[column] or [None] * len(results["completions"]) for column in columns), results["completions"])
    lines = [
        json.dumps({"round": round_idx, "item": item, "task": label, "gold": gold, "answer": answer, "reward": reward,
                    "completion": completion[:COMPLETION_CHARACTERS]}, ensure_ascii=False)
        for item, (label, gold, answer, reward, completion) in enumerate(rows)
    ]  # fmt: skip
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    temporary.replace(path)


def merge_evaluations(evaluations: Iterable[dict[str, Any]]) -> dict[str, dict[str, float | int]]:
    """Pool evaluations of disjoint rows (each with `evaluate_accuracy`'s "accuracy" and "count" per label, such as
    the clients' evaluations of their own held-out data) into the evaluation of all their rows: per label, the
    row-weighted mean reward and the rows, labels in `evaluate_accuracy`'s order; empty for no evaluation."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for evaluation in evaluations:
        for label, count in evaluation["count"].items():
            sums[label] += evaluation["accuracy"][label] * count
            counts[label] += count
    labels = [*_ordered_labels(label for label in counts if label != TOTAL), TOTAL] if counts else []
    return {
        "accuracy": {label: sums[label] / counts[label] for label in labels},
        "count": {label: counts[label] for label in labels},
    }


def _batches_by_length(prompts: list[Any], batch_size: int) -> list[list[int]]:
    """Row indices in batches of `batch_size`, longest prompts first: rows of similar length share a batch, so
    left padding wastes little, and a batch that does not fit in memory fails at the start, not at the end.
    Characters stand in for tokens: the order only needs to group similar lengths."""

    def length(prompt: Any) -> int:
        if isinstance(prompt, list):  # a conversation
            return sum(len(str(message.get("content", ""))) for message in prompt)
        return len(str(prompt))

    lengths = [length(prompt) for prompt in prompts]
    order = sorted(range(len(prompts)), key=lambda index: (-lengths[index], index))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def format_accuracy_table(results: dict[str, dict[str, Any]], labels: list[str] | None = None) -> str:
    """Render evaluation results as a Markdown table laid out like the paper's Table 1.

    Args:
        results: row name (e.g. `"Before training"`, `"Round 3"`) -> an `evaluate_accuracy` result, or
            directly its `"accuracy"` mapping. Rows keep the order of `results`.
        labels: the label columns to show, in order; by default every label found, tiers first. A `Total`
            column always comes last.

    Returns:
        The table as Markdown; accuracies in percent with two decimals, `-` where a row lacks a label.
    """
    accuracies = {name: result.get("accuracy", result) for name, result in results.items()}
    if labels is None:
        labels = _ordered_labels(label for accuracy in accuracies.values() for label in accuracy)
    columns = [label for label in labels if label != TOTAL] + [TOTAL]
    lines = [
        "| | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for name, accuracy in accuracies.items():
        cells = [f"{100 * accuracy[column]:.2f}" if column in accuracy else "-" for column in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def evaluate_adapter(
    model: PeftModel,
    adapter: AdapterState,
    processing_class: PreTrainedTokenizerBase | ProcessorMixin,
    dataset: Dataset,
    args: FedGRPOConfig,
    reward_funcs: RewardFunc | Sequence[RewardFunc],
    reward_weights: Sequence[float] | None = None,
    distributed: bool = False,
    keep_completions: bool = False,
) -> dict[str, Any]:
    """`evaluate_accuracy` of `model` with `adapter` as its federated adapter, as the federation evaluates: the
    server its `eval_dataset` (`FederatedServer.evaluate`), a Flower client its own held-out data (its evaluate
    round). The settings are `args`'s (accuracy per `partition_column` label, `per_device_eval_batch_size`,
    `max_completion_length` new tokens, the training's mixed precision and fast generation), on the device this
    process trains on; the generation's memory is released after."""
    set_adapter_state(model, adapter)
    to_training_device(model, args)
    results = evaluate_accuracy(
        model,
        processing_class,
        dataset,
        label_column=args.partition_column,
        batch_size=args.per_device_eval_batch_size,
        max_new_tokens=args.max_completion_length,
        reward_funcs=reward_funcs,
        reward_weights=reward_weights,
        mixed_precision=args.mixed_precision,
        distributed=distributed,
        fast_generation=args.fast_generation,
        generation_dtype=args.generation_dtype,
        keep_completions=keep_completions,
    )
    release_free_memory()  # evaluation's KV caches, before the next client or the server step
    return results


def to_training_device(model: PeftModel, args: FedGRPOConfig) -> None:
    """Move `model` to `args.device`, where this process trains (accelerate's `PartialState` for `args`), as a
    `Trainer` places its model when built, so that an evaluation before the first round runs there too; a model
    placed when loaded (a `device_map`, quantized weights) stays where it is, as `Trainer` leaves it."""
    if getattr(model, "hf_device_map", None) is None and getattr(model, "hf_quantizer", None) is None:
        model.to(args.device)


# The most rows one client's evaluation may count (a held-out split of that size takes hours to evaluate on the
# hardware this runs on): a reply claiming more is refused, its client failed. A count the server cannot check weighs
# at most `EVALUATION_WEIGHT_SPREAD` times the median count of its label, and a label is pooled only when
# `MIN_POOLED_CLIENTS` or more clients report it: with fewer there is no median one reply cannot move.
MAX_EVALUATION_ROWS = 1_000_000
EVALUATION_WEIGHT_SPREAD = SAMPLES_MEDIAN_SPREAD
MIN_POOLED_CLIENTS = MIN_MEDIAN_CLIENTS


def bound_client_evaluations(
    evaluations: dict[str, dict[str, Any]], reward_range: tuple[float, float] | None, failed: dict[str, str],
    known_counts: Mapping[str, int] | None = None,
) -> dict[str, dict[str, Any]]:
    """The clients' evaluations as they enter the pooled accuracy, which no one reply can own. A reply that is not an
    evaluation (`evaluation_fault`: values no finite numbers, counts no positive integers up to its Total), whose
    accuracy lies outside `reward_range`, or that counts more rows than is plausible (`MAX_EVALUATION_ROWS`, or the
    size of its evaluation split where the server knows it, `known_counts`) fails that client (named in `failed`).
    Of the others, a label enters only when `MIN_POOLED_CLIENTS` or more clients report it (the rest are shown per
    client), each count bounded by what the server knows of the client (its split's size) or, without that, by
    `EVALUATION_WEIGHT_SPREAD` times the median of that label's counts: a client claiming 2^63 rows weighs as a
    median client does. The clients' own figures stay in the record as sent."""
    known_counts = dict(known_counts or {})
    kept = {}
    for client_id, evaluation in evaluations.items():
        fault = evaluation_fault(evaluation, reward_range, known_counts.get(client_id))
        if fault is not None:
            failed[client_id] = f"invalid evaluation reply: {fault}"
            continue
        kept[client_id] = evaluation
    counts: dict[str, list[int]] = {}
    for evaluation in kept.values():
        for label, count in evaluation["count"].items():
            counts.setdefault(label, []).append(count)
    caps = {
        label: max(1, math.floor(EVALUATION_WEIGHT_SPREAD * statistics.median(values)))
        for label, values in counts.items() if len(values) >= MIN_POOLED_CLIENTS
    }
    bounded = {}
    for client_id, evaluation in kept.items():
        labels = [label for label in evaluation["count"] if label in caps]
        over = [label for label in labels if client_id not in known_counts and evaluation["count"][label] > caps[label]]
        if over:
            logger.warning("Client %r's evaluation counts more rows than the median client's (%s): counted as the "
                           "median.", client_id, ", ".join(f"{bounded_text(repr(label), 100)}: "
                                                            f"{evaluation['count'][label]:,} > {caps[label]:,}"
                                                            for label in over[:5]))
        bounded[client_id] = {
            "accuracy": {label: evaluation["accuracy"][label] for label in labels},
            "count": {
                label: evaluation["count"][label] if client_id in known_counts
                else min(evaluation["count"][label], caps[label])
                for label in labels
            },
        }
    return bounded


def evaluation_fault(
    evaluation: Any, reward_range: tuple[float, float] | None, known_count: int | None = None
) -> str | None:
    """Why a client's evaluation reply cannot be pooled, or None: it must hold "accuracy" and "count" for the same
    labels, `TOTAL` among them; every accuracy a finite number inside `reward_range` (when declared), every count a
    positive integer up to its Total, and the Total at most `MAX_EVALUATION_ROWS` and `known_count` (the rows of the
    client's evaluation split, where the server knows them)."""
    accuracy = evaluation.get("accuracy") if isinstance(evaluation, dict) else None
    count = evaluation.get("count") if isinstance(evaluation, dict) else None
    if not isinstance(accuracy, dict) or not isinstance(count, dict) or set(accuracy) != set(count) or (
        TOTAL not in count
    ):
        return f"it holds no accuracy and row count per label with {TOTAL!r}"
    total = count[TOTAL]
    for label, value in accuracy.items():
        number, rows = plain_number(value), count[label]
        name = bounded_text(repr(label), 100)
        if number is None or not math.isfinite(number):
            return f"its accuracy of {name} is no finite number"
        if reward_range is not None and not reward_range[0] <= number <= reward_range[1]:
            return (f"its accuracy of {name!s} lies outside the evaluation's reward range "
                    f"[{reward_range[0]}, {reward_range[1]}]")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1 or (
            isinstance(total, int) and rows > total
        ):
            return f"its row count of {name} is no positive integer up to its {TOTAL} ({bounded_text(repr(rows), 40)})"
    if total > MAX_EVALUATION_ROWS:
        return f"it counts {total:,} rows, more than any evaluation counts ({MAX_EVALUATION_ROWS:,})"
    if known_count is not None and total > known_count:
        return f"it counts {total:,} rows, more than the {known_count:,} of its evaluation split"
    return None


def pool_client_evaluations(
    bounded: dict[str, dict[str, Any]], reward_range: tuple[float, float] | None
) -> dict[str, dict[str, Any]]:
    """The pooled evaluation of the clients' bounded evaluations (`bound_client_evaluations`): per label, the
    row-weighted mean (`evaluation.merge_evaluations`), or, when the evaluation's rewards declare no range (nothing
    bounds what one client's value can be), the median of the clients' values, which no one client can move beyond
    the others'."""
    pooled = merge_evaluations(bounded.values())
    if reward_range is None:
        for label in pooled["accuracy"]:
            pooled["accuracy"][label] = statistics.median(
                evaluation["accuracy"][label] for evaluation in bounded.values() if label in evaluation["accuracy"]
            )
    return pooled


def client_evaluation_record(
    evaluations: dict[str, dict[str, Any]], failed: dict[str, str], reward_range: tuple[float, float] | None,
    known_counts: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The clients' evaluations of one global adapter, each on its own held-out data, as a round records them: the
    pooled result (`pool_client_evaluations`: per label reported by 3 or more clients, the row-weighted mean with every
    count bounded, `bound_client_evaluations`; the median without a declared reward range), the labels not pooled
    ("unpooled"), each client's as sent ("clients") and the clients that have none, with the reason ("failed")."""
    failed = dict(failed)
    bounded = bound_client_evaluations(evaluations, reward_range, failed, known_counts)
    pooled = pool_client_evaluations(bounded, reward_range)
    reported = {label for client_id, evaluation in evaluations.items() if client_id not in failed
                for label in evaluation["count"]}
    unpooled = sorted(reported - set(pooled["count"]))
    return {**pooled, "clients": evaluations, "failed": failed, "unpooled": unpooled}


def describe_client_evaluation(results: dict[str, Any]) -> str:
    """A `client_evaluation_record` in words, for the round's log line: the pooled accuracy (each client's own when
    too few pooled), the labels shown per client only, and the failures."""
    evaluations, failed, unpooled = results["clients"], results["failed"], results["unpooled"]
    total = results["accuracy"].get(TOTAL)
    if total is None:  # fewer than MIN_POOLED_CLIENTS replies: each client's own, not pooled
        summary = "not pooled (fewer than %d clients): %s" % (MIN_POOLED_CLIENTS, ", ".join(
            f"{client_id} {100 * evaluations[client_id]['accuracy'][TOTAL]:.2f}% over "
            f"{evaluations[client_id]['count'][TOTAL]} rows" for client_id in evaluations if client_id not in failed
        ) or "no evaluation")
    else:
        summary = f"accuracy {100 * total:.2f}% over {results['count'][TOTAL]} rows"
    if unpooled and total is not None:
        summary += (f"; labels reported by fewer than {MIN_POOLED_CLIENTS} clients, shown per client only: "
                    f"{', '.join(map(repr, unpooled[:10]))}")
    return summary + "".join(f"; {client_id}: {reason}" for client_id, reason in failed.items())
