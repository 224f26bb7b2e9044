"""Answer extraction and the rewards used for federated GRPO.

The paper trains with a binary correctness reward: 1.0 when the answer the model puts inside
`<answer></answer>` matches the reference, else 0.0. Rows built by `trl_federated.data` carry their
reasoning-gym entry (column `rg_entry`), and are scored by that task's own scorer, so that "7" and "7.0", or
"1,000" and "1000", count the same way reasoning-gym counts them. Other rows (e.g. paper math datasets) go
through `answers_match`, which normalises LaTeX, unicode math, units and answer prefixes and then compares
complete expressions only (`trl_federated.scoring.answer_check`).

Every reward here follows TRL's reward-function signature (`completions` plus the dataset columns as keyword
lists), never raises on malformed model output, and declares the interval its values lie in as a
`reward_range` attribute, which the federated server uses to reject out-of-range client rewards.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..names import closest_key_hint, import_object
from .answer_check import answers_match

logger = logging.getLogger(__name__)

_OPEN_RE = re.compile("<answer>", re.IGNORECASE)
_CLOSE_RE = re.compile("</answer>", re.IGNORECASE)
# A pair with no other opening tag inside, so that nested tags yield the innermost content.
_PAIR_RE = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.IGNORECASE | re.DOTALL)

Completion = str | list[dict[str, Any]]


def extract_answer(text: str) -> str | None:
    """Return the stripped content of the last complete `<answer>...</answer>` pair in `text`, or `None`.

    The last pair wins: a model that corrects itself states its final answer last. Tags are matched
    case-insensitively; with nested tags (`<answer><answer>5</answer></answer>`) the innermost content is
    returned. An opening tag that is never closed is not an answer: the paper's format requires the pair,
    and a truncated generation should not be rewarded for what it had written so far.

    Args:
        text: a completion as plain text.

    Returns:
        The answer with surrounding whitespace removed (possibly the empty string for `<answer> </answer>`),
        or `None` when `text` holds no complete pair.
    """
    if not isinstance(text, str):
        return None
    answers = _PAIR_RE.findall(text)
    return answers[-1].strip() if answers else None


def completion_text(completion: Completion) -> str:
    """The text of one completion, whether TRL passes it as a string or as a list of chat messages.

    For conversational completions this is the content of the last message; multimodal content given as a
    list of parts is reduced to its text parts.
    """
    if isinstance(completion, str):
        return completion
    if not completion:
        return ""
    content = completion[-1].get("content", "")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


@functools.cache
def _reasoning_gym_scorer(task_name: str) -> Callable[[str | None, dict[str, Any]], float]:
    """The `score_answer` of a reasoning-gym task, built once per task (scorers do not depend on the seed)."""
    from reasoning_gym.factory import get_score_answer_fn

    return get_score_answer_fn(task_name)


def _is_correct(completion: Completion, gold: Any, rg_entry: str | dict[str, Any] | None) -> bool:
    """Whether the completion's tagged answer is right.

    Errors while scoring what the model wrote count as wrong answers; a malformed `rg_entry` (a bug in the
    dataset, not in the model's output) raises.
    """
    prediction = extract_answer(completion_text(completion))
    if prediction is None or gold is None:
        return False
    scorer = None
    if rg_entry:
        entry = json.loads(rg_entry) if isinstance(rg_entry, str) else rg_entry
        scorer = _reasoning_gym_scorer(entry["metadata"]["source_dataset"])
    try:
        if scorer is not None:
            # Binary, as in the paper: reasoning-gym's partial credit does not count as correct.
            return scorer(prediction, entry) >= 1.0
        return answers_match(prediction, str(gold))
    except Exception:  # a reward must never take a training step down because of what the model wrote
        logger.debug("Scoring failed for prediction %r against %r", prediction, gold, exc_info=True)
        return False


def answer_accuracy_reward(
    completions: Sequence[Completion], answer: Sequence[Any], rg_entry: Sequence[Any] | None = None, **kwargs: Any
) -> list[float]:
    """The paper's binary correctness reward: 1.0 when the tagged answer matches the reference, else 0.0.

    Args:
        completions: one completion per sample, as text or as a list of chat messages.
        answer: the reference answer of each sample (the dataset's `answer` column).
        rg_entry: the JSON reasoning-gym entry of each sample, when the dataset carries one; rows with it are
            scored by the task's own scorer, the others by `answers_match`.
        **kwargs: the other dataset columns and TRL's extra arguments, ignored.

    Returns:
        One reward in `answer_accuracy_reward.reward_range` per completion. A completion with no complete
        `<answer></answer>` pair scores 0.0.
    """
    entries = rg_entry if rg_entry is not None else [None] * len(completions)
    return [float(_is_correct(c, gold, entry)) for c, gold, entry in zip(completions, answer, entries, strict=True)]


def format_reward(completions: Sequence[Completion], **kwargs: Any) -> list[float]:
    """1.0 for a completion holding exactly one well-formed, non-empty `<answer>...</answer>` pair, else 0.0.

    An optional shaping reward: it rewards the answer format that the correctness reward depends on, which
    helps small models that have not yet learnt to close the tag.
    """
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        opens, closes = _OPEN_RE.findall(text), _CLOSE_RE.findall(text)
        well_formed = len(opens) == 1 and len(closes) == 1 and bool(extract_answer(text))
        rewards.append(float(well_formed))
    return rewards


answer_accuracy_reward.reward_range = (0.0, 1.0)  # type: ignore[attr-defined]
format_reward.reward_range = (0.0, 1.0)  # type: ignore[attr-defined]


def combined_reward_range(
    reward_funcs: Any, reward_weights: Sequence[float] | None = None
) -> tuple[float, float] | None:
    """The interval a client's R̄ must lie in, or `None` when it cannot be known.

    TRL scores a completion with Σ_j w_j r_j over the reward functions (weights `reward_weights`, 1 each by
    default), and R̄ is a mean of such scores, so it lies in the weighted sum of the functions' declared
    `reward_range`s (a negative weight swaps the ends). A function without `reward_range` (a reward model, a
    user function that declares none) has no known bound, and then neither has R̄.
    """
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    weights = [1.0] * len(funcs) if reward_weights is None else [float(weight) for weight in reward_weights]
    if len(weights) != len(funcs):
        raise ValueError(f"{len(weights)} reward weights for {len(funcs)} reward functions: give one weight each.")
    low = high = 0.0
    for func, weight in zip(funcs, weights):
        bounds = getattr(func, "reward_range", None)
        if bounds is None:
            return None
        ends = (weight * float(bounds[0]), weight * float(bounds[1]))
        low, high = low + min(ends), high + max(ends)
    return low, high


# Reward functions by name, as `trl grpo` reads its `reward_funcs` ------------------------------------------

REWARD_FUNCTIONS = ("accuracy", "format")


# TRL's `trl grpo` reward names (`trl/scripts/grpo.py`), with the values that script gives them: TRL's functions, which
# read the dataset's `solution` column, as in `trl grpo`.
TRL_REWARD_FUNCTIONS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward",
                        "get_soft_overlong_punishment")  # fmt: skip


def trl_reward_function(name: str):
    """TRL's reward function `name` (`TRL_REWARD_FUNCTIONS`), configured as `trl grpo` configures it."""
    from trl import rewards

    if name == "get_soft_overlong_punishment":
        return rewards.get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)
    return getattr(rewards, name)


def reward_functions(names: list[str], field_name: str = "reward_funcs") -> list:
    """The reward functions `names` gives, as `trl grpo` reads its `reward_funcs`: this package's `REWARD_FUNCTIONS`,
    TRL's (`TRL_REWARD_FUNCTIONS`), and any function by dotted import path (`my_lib.rewards.custom_reward`,
    importable from the working directory); an entry with a `/` or naming a folder is a reward model's Hub id or local
    folder, kept as such for `FederatedRunner` to load once (`client.load_reward_models`)."""
    from .rewards import answer_accuracy_reward, format_reward

    available = {"accuracy": answer_accuracy_reward, "format": format_reward}
    functions = []
    for name in names:
        if name in available:
            functions.append(available[name])
        elif name in TRL_REWARD_FUNCTIONS:
            functions.append(trl_reward_function(name))
        elif "/" in name or Path(name).is_dir():
            functions.append(name)
        elif "." in name:
            functions.append(import_object(name, field_name))
        else:
            raise ValueError(
                f"Unknown `{field_name}` {name!r}; choose among {list(REWARD_FUNCTIONS + TRL_REWARD_FUNCTIONS)}, a "
                "function's dotted import path (`my_lib.rewards.custom_reward`), or a reward model's Hub id "
                f"(`org/name`) or local folder.{closest_key_hint(name, REWARD_FUNCTIONS + TRL_REWARD_FUNCTIONS)}"
            )
    return functions


def training_rewards(data_args) -> list:
    """The training rewards `data_args` (`arguments.BenchmarkArguments`) name, as `trl grpo` assembles them:
    `reward_model_name_or_path` first, then `reward_funcs`;
    `reward_funcs` left unset is the paper's `accuracy` alone, or nothing beside a reward model."""
    names = [data_args.reward_model_name_or_path] if data_args.reward_model_name_or_path else []
    if data_args.reward_funcs is not None:
        names += data_args.reward_funcs
    elif not names:
        names = ["accuracy"]
    return reward_functions(names)


# What TRL's GRPOTrainer passes every reward function besides the dataset's columns (`_calculate_rewards`).
TRAINER_REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                            "environments")  # fmt: skip


def check_reward_columns(reward_funcs: list, dataset, field_name: str = "reward_funcs") -> None:
    """Refuse, naming the function and the column, a reward function whose required arguments are columns that
    `dataset` lacks (TRL passes every column to the reward functions by name, and a missing one fails only at the
    first training step)."""
    import inspect

    for function in reward_funcs:
        if not callable(function) or isinstance(function, torch.nn.Module):
            continue
        parameters = inspect.signature(function).parameters.values()
        required = [
            parameter.name for parameter in parameters
            if parameter.default is inspect.Parameter.empty
            and parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            and parameter.name not in TRAINER_REWARD_ARGUMENTS
        ]  # fmt: skip
        missing = [name for name in required if name not in dataset.column_names]
        if missing:
            name = getattr(function, "__name__", repr(function))
            advice = (
                " TRL's rewards score a `solution` column; `accuracy` is this package's binary reward on the "
                "`answer` column (`answer_accuracy_reward`; the embedded and paper benchmarks)."
                if getattr(function, "__module__", "").startswith("trl.")
                else ""
            )
            raise ValueError(
                f"`{field_name}`: {name} ({function.__module__}) reads the column(s) {missing}, which the data lacks "
                f"(columns: {dataset.column_names}): rename the column that holds them (`dataset.rename_column`), or "
                f"choose a reward function that reads the columns the data has.{advice}"
            )
