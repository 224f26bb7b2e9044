import json

import pytest
import reasoning_gym

from trl_federated.rewards import accuracy_reward, answers_match, extract_answer, format_reward


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Reasoning. <answer>42</answer>", "42"),
        ("<answer>  7 \n</answer>", "7"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last pair wins
        ("<ANSWER>5</Answer>", "5"),
        ("<answer><answer>5</answer></answer>", "5"),  # nested: the innermost content
        ("<answer></answer>", ""),
        ("<answer>3</answer> and a truncated <answer>4", "3"),  # an unclosed tag is not an answer
        ("no tags at all: 42", None),
        ("", None),
        ("<answer>42", None),
        ("42</answer>", None),
        ("</answer>42<answer>", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_rejects_non_strings():
    assert extract_answer(None) is None  # type: ignore[arg-type]


def test_accuracy_reward_plain_strings():
    completions = ["3 + 4 = 7. <answer>7</answer>", "<answer>8</answer>", "7", "<answer>7"]
    assert accuracy_reward(completions, answer=["7"] * 4) == [1.0, 0.0, 0.0, 0.0]


def test_accuracy_reward_conversational_completions():
    completions = [
        [{"role": "assistant", "content": "<answer>12</answer>"}],
        [{"role": "assistant", "content": "<answer>13</answer>"}],
        [{"role": "assistant", "content": [{"type": "text", "text": "<answer>12</answer>"}]}],
        [],
    ]
    assert accuracy_reward(completions, answer=["12"] * 4) == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("prediction", "gold"),
    [("7.0", "7"), ("7", "7.0"), ("1,000", "1000"), ("-3", "-3.00"), ("42.", "42"), ("$5$", "5")],
)
def test_numeric_equivalence(prediction, gold):
    assert answers_match(prediction, gold)
    assert accuracy_reward([f"<answer>{prediction}</answer>"], answer=[gold]) == [1.0]


@pytest.mark.parametrize(
    ("prediction", "gold"),
    [("0.5", "\\frac{1}{2}"), ("\\frac12", "\\frac{1}{2}"), ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"), ("1+x", "x+1")],
)
def test_latex_equivalence_via_math_verify(prediction, gold):
    assert accuracy_reward([f"<answer>{prediction}</answer>"], answer=[gold]) == [1.0]


@pytest.mark.parametrize(("prediction", "gold"), [("8", "7"), ("\\frac{1}{3}", "\\frac{1}{2}"), ("", "7"), ("x", "7")])
def test_wrong_answers_score_zero(prediction, gold):
    assert accuracy_reward([f"<answer>{prediction}</answer>"], answer=[gold]) == [0.0]


def test_malformed_outputs_never_raise():
    completions = ["", "<answer>", "<answer>\\frac{</answer>", "<answer>}}}{{{</answer>", "\x00<answer>\x00</answer>"]
    rewards = accuracy_reward(completions, answer=["1", "1", "1", "1", None])
    assert rewards == [0.0] * len(completions)


def _chain_sum_entry() -> dict:
    return reasoning_gym.create_dataset("chain_sum", seed=3, size=1, min_terms=2, max_terms=2)[0]


def test_reasoning_gym_scorer_is_used_and_kept_binary():
    entry = _chain_sum_entry()
    gold = entry["answer"]
    rg_entry = [json.dumps(entry)] * 4
    completions = [
        f"<answer>{gold}</answer>",
        f"<answer>{gold}.00</answer>",  # reasoning-gym tolerates trailing decimals
        f"<answer>{gold} is the result</answer>",  # reasoning-gym gives partial credit: not correct
        f"<answer>{int(gold) + 1}</answer>",
    ]
    assert accuracy_reward(completions, answer=[gold] * 4, rg_entry=rg_entry) == [1.0, 1.0, 0.0, 0.0]


def test_rows_without_reasoning_gym_entry_fall_back_to_matching():
    entry = _chain_sum_entry()
    rg_entry = [None, json.dumps(entry)]
    assert accuracy_reward(["<answer>0.5</answer>"] * 2, answer=["\\frac{1}{2}", "1"], rg_entry=rg_entry) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("Because. <answer>4</answer>", 1.0),
        ("<answer>4</answer><answer>5</answer>", 0.0),
        ("<answer> </answer>", 0.0),
        ("<answer>4", 0.0),
        ("</answer>4<answer>", 0.0),
        ("4", 0.0),
        ([{"role": "assistant", "content": "<answer>4</answer>"}], 1.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward([completion]) == [expected]


@pytest.mark.parametrize("reward_func", [accuracy_reward, format_reward])
def test_rewards_declare_their_range(reward_func):
    low, high = reward_func.reward_range
    completions = ["<answer>1</answer>", "junk", "<answer>2</answer>"]
    rewards = reward_func(completions, answer=["1", "1", "1"])
    assert all(low <= reward <= high for reward in rewards)


def test_malformed_dataset_entry_raises():
    with pytest.raises(ValueError):  # a dataset bug must not silently score every answer 0
        accuracy_reward(["<answer>1</answer>"], answer=["1"], rg_entry=["{not json"])
