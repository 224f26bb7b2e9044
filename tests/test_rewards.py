import json
import threading
import time
from fractions import Fraction

import pytest
import reasoning_gym
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from trl_federated.scoring.rewards import answer_accuracy_reward, answers_match, extract_answer, format_reward


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


def test_the_answer_reward_logs_under_a_key_apart_from_trls_accuracy_reward():
    """GRPOTrainer logs each reward function as `rewards/<get_callable_name>/mean`: this package's reward on the
    `answer` column and TRL's `accuracy_reward` on `solution` must not share a key, nor a name."""
    from trl import rewards as trl_rewards
    from trl.trainer.utils import get_callable_name

    assert get_callable_name(answer_accuracy_reward) == "answer_accuracy_reward"
    assert get_callable_name(answer_accuracy_reward) != get_callable_name(trl_rewards.accuracy_reward)
    assert not hasattr(trl_rewards, "answer_accuracy_reward")


def test_answer_accuracy_reward_plain_strings():
    completions = ["3 + 4 = 7. <answer>7</answer>", "<answer>8</answer>", "7", "<answer>7"]
    assert answer_accuracy_reward(completions, answer=["7"] * 4) == [1.0, 0.0, 0.0, 0.0]


def test_answer_accuracy_reward_conversational_completions():
    completions = [
        [{"role": "assistant", "content": "<answer>12</answer>"}],
        [{"role": "assistant", "content": "<answer>13</answer>"}],
        [{"role": "assistant", "content": [{"type": "text", "text": "<answer>12</answer>"}]}],
        [],
    ]
    assert answer_accuracy_reward(completions, answer=["12"] * 4) == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("prediction", "gold"),
    [("7.0", "7"), ("7", "7.0"), ("1,000", "1000"), ("-3", "-3.00"), ("42.", "42"), ("$5$", "5")],
)
def test_numeric_equivalence(prediction, gold):
    assert answers_match(prediction, gold)
    assert answer_accuracy_reward([f"<answer>{prediction}</answer>"], answer=[gold]) == [1.0]


@pytest.mark.parametrize(
    ("prediction", "gold"),
    [("0.5", "\\frac{1}{2}"), ("\\frac12", "\\frac{1}{2}"), ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"), ("1+x", "x+1")],
)
def test_latex_equivalence_via_math_verify(prediction, gold):
    assert answer_accuracy_reward([f"<answer>{prediction}</answer>"], answer=[gold]) == [1.0]


@pytest.mark.parametrize(("prediction", "gold"), [("8", "7"), ("\\frac{1}{3}", "\\frac{1}{2}"), ("", "7"), ("x", "7")])
def test_wrong_answers_score_zero(prediction, gold):
    assert answer_accuracy_reward([f"<answer>{prediction}</answer>"], answer=[gold]) == [0.0]


def test_malformed_outputs_never_raise():
    completions = ["", "<answer>", "<answer>\\frac{</answer>", "<answer>}}}{{{</answer>", "\x00<answer>\x00</answer>"]
    rewards = answer_accuracy_reward(completions, answer=["1", "1", "1", "1", None])
    assert rewards == [0.0] * len(completions)


# Answers in the formats of the paper's datasets (GEOQA, Multimodal-Open-R1, reasoning-gym) that state the gold.
REAL_FORMAT_MATCHES = [
    # from the issue: correct answers that a prefix-reading checker rejected
    ("\\sqrt{3}", "√{3}"),
    ("4\\pi", "4πcm"),
    ("27", "27cm^{2}"),
    ("\\frac{40}{7}", "\\frac{40}{7}米"),
    # GEOQA: unicode roots and π, degrees, lengths and areas with units, Chinese units
    ("2\\sqrt{3}", "2√{3}"),
    ("2√3", "2√{3}"),
    ("4√2", "4\\sqrt{2}"),
    ("√{12}", "2√{3}"),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{√{3}}{2}"),
    ("30°", "30°"),
    ("30", "30°"),
    ("30^\\circ", "30°"),
    ("30^{\\circ}", "30°"),
    ("30度", "30°"),
    ("30 degrees", "30°"),
    ("4cm", "4"),
    ("4 cm", "4cm"),
    ("4厘米", "4cm"),
    ("4\\text{ cm}", "4cm"),
    ("5米", "5m"),
    ("(4+2√{3})米", "4+2\\sqrt{3}"),
    ("27cm²", "27cm^{2}"),
    ("27\\text{cm}^2", "27cm^{2}"),
    ("27平方厘米", "27cm^{2}"),
    ("12π", "12\\pi"),
    ("\\frac{4}{3}π", "\\frac{4\\pi}{3}"),
    ("8πcm²", "8\\pi"),
    ("∠ABC = 30°", "30°"),
    ("AB = 4cm", "4"),
    ("x = 5", "5"),
    ("4\\pi", "4\\pi"),
    # Open-R1: LaTeX answers, compared symbolically when both parse completely
    ("$\\frac{1}{2}$", "0.5"),
    ("\\dfrac{1}{2}", "\\frac12"),
    ("\\boxed{\\frac{3}{4}}", "0.75"),
    ("\\sqrt{12}", "2\\sqrt{3}"),
    ("2\\frac{1}{2}", "\\frac{5}{2}"),  # a mixed number
    ("x+1", "1+x"),
    ("\\frac{\\pi}{6}", "\\frac{π}{6}"),
    ("3.141593", "\\pi"),
    ("\\{3, 2\\}", "2, 3"),
    ("(-\\infty, 3]", "(-\\infty,3]"),
    ("\\left(1, 2\\right)", "(1,2)"),
    ("(2, \\infty)", "x > 2"),
    ("y^2 + x^2 = 1", "x^2+y^2=1"),
    ("−3", "-3"),
    ("１２", "12"),
    ("3×4", "12"),
    ("12÷4", "3"),
    # percentages: the same percentage, with or without its sign, or its fraction
    ("25%", "25\\%"),
    ("25\\%", "25"),
    ("25%", "0.25"),
    ("12.5%", "\\frac{1}{8}"),
    # multiple choice and yes/no
    ("A", "A"),
    ("(A)", "A"),
    ("A.", "A"),
    ("A)", "A"),
    ("Choice A", "A"),
    ("Option (C)", "C"),
    ("\\text{(B)}", "B"),
    ("Yes", "yes"),
    ("NO.", "No"),
    ("\\text{yes}", "Yes"),
    # reasoning-gym style plain answers
    ("1,000", "1000"),
    ("-3", "-3.00"),
    ("7.", "7"),
    ("\\$12.50", "12.5"),
]

REAL_FORMAT_MISMATCHES = [
    # from the issue: a prefix read as the answer
    ("4\\sqrt{2}", "4"),
    ("12\\pi", "12"),
    ("5x", "5"),
    ("2 or 3", "3"),
    ("2", "2√{3}"),
    # other prefixes, hedges and junk
    ("4√2", "4"),
    ("12π", "12"),
    ("2\\sqrt{3}", "2"),
    ("2", "2\\sqrt{3}"),
    ("5 x", "5"),
    ("5\\text{ or }3", "3"),
    ("3 or 5", "3"),
    ("\\{2, 3\\}", "3"),
    ("2, 3", "3"),
    ("3 \\pm 1", "4"),
    ("2+2=5", "5"),
    ("x > 0", "5"),
    ("3 4", "7"),
    ("3 4", "34"),
    ("3(4)", "7"),  # latex2sympy2 reads juxtaposed integers as a mixed number
    ("{3}{4}", "7"),
    ("3\\frac{4}{2}", "5"),
    ("3.2.5", "1.6"),
    ("5_2", "5"),
    ("5'", "5"),
    ("\\phantom{3}5", "8"),
    ("5 \\approx 5.0", "5"),
    ("1e5", "100000"),
    ("\\frac{1}{2}0", "\\frac{1}{2}"),
    ("4\\pii", "4\\pi"),
    ("cat", "act"),  # not a product of variables
    ("no", "on"),
    # wrong units, numbers and choices
    ("4cm", "4m"),
    ("27cm", "27cm^{2}"),
    ("30°", "\\frac{\\pi}{6}"),
    ("30°", "30cm"),
    ("2500", "25%"),
    ("0.25", "25"),
    ("3.14", "\\pi"),
    ("\\frac{1}{3}", "\\frac{1}{2}"),
    ("B", "A"),
    ("a", "A"),
    ("e", "E"),  # a choice letter, not Euler's number
    ("2.718282", "E"),
    ("(A) 30°", "A"),
    ("Yes", "No"),
    ("", "7"),
    ("7", ""),
]


@pytest.mark.parametrize(("prediction", "gold"), REAL_FORMAT_MATCHES)
def test_real_format_answers_match(prediction, gold):
    assert answers_match(prediction, gold)
    assert answer_accuracy_reward([f"<answer>{prediction}</answer>"], answer=[gold]) == [1.0]


@pytest.mark.parametrize(("prediction", "gold"), REAL_FORMAT_MISMATCHES)
def test_real_format_answers_do_not_match(prediction, gold):
    assert not answers_match(prediction, gold)
    assert answer_accuracy_reward([f"<answer>{prediction}</answer>"], answer=[gold]) == [0.0]


_LETTERS = "ABCDE"
# Pairs of spellings of one unit: the answer carries one, the gold the other.
_UNIT_SPELLING_PAIRS = [
    ("cm", "厘米"), ("米", "m"), ("cm^{2}", "平方厘米"), ("m²", "m^2"), ("°", "^{\\circ}"), ("度", "°")
]


@st.composite
def _correct_answers(draw) -> tuple[str, str]:
    """(answer, gold): a correct answer and its reference, in two of the datasets' formats (never 0, ±1 or 2)."""
    number = draw(st.integers(3, 999)) * draw(st.sampled_from([1, -1]))
    kind = draw(st.sampled_from(["integer", "fraction", "root", "pi", "unit", "percent", "choice", "yes/no"]))
    if kind == "integer":
        return str(number), draw(st.sampled_from([str(number), f"{number}.0", f"${number}$", f"\\boxed{{{number}}}"]))
    if kind == "fraction":
        value = Fraction(number, draw(st.integers(2, 50)))
        assume(value.denominator > 1)
        latex = f"\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"
        sign = "-" if value < 0 else ""
        other_spellings = [sign + latex.replace("frac", "dfrac"), f"{value.numerator}/{value.denominator}"]
        return sign + latex, draw(st.sampled_from(other_spellings))
    if kind == "root":
        radicand = draw(st.sampled_from([2, 3, 5, 6, 7, 10, 11]))
        unicode_spellings = [f"{number}√{{{radicand}}}", f"{number}√{radicand}"]
        return f"{number}\\sqrt{{{radicand}}}", draw(st.sampled_from(unicode_spellings))
    if kind == "pi":
        return f"{number}\\pi", draw(st.sampled_from([f"{number}π", f"{number}πcm", f"{number}π米"]))
    if kind == "unit":
        spelling, other = draw(st.sampled_from(_UNIT_SPELLING_PAIRS))
        return f"{abs(number)}{spelling}", f"{abs(number)}{other}"
    if kind == "percent":
        return f"{abs(number)}\\%", f"{abs(number)}%"
    if kind == "choice":
        letter = draw(st.sampled_from(_LETTERS))
        return draw(st.sampled_from([f"({letter})", f"{letter}.", f"Choice {letter}"])), letter
    return draw(st.sampled_from([("Yes", "yes"), ("no", "No")]))


# Tokens that change a correct answer's value or make it a hedge. (A unit from the list would not: `5` + `cm`
# is still 5; nor would `0` after a decimal (`2.50`), `^2` after 1 or `!` after 2, which the answers above avoid.)
_APPENDED_TOKENS = ["x", "\\pi", "\\sqrt{2}", " or 3", "0", ".5", "^2", "i", "!", " 7", ",6", "+1", "\\cdot 2", "'"]

_PROPERTY_SETTINGS = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@_PROPERTY_SETTINGS
@given(_correct_answers())
def test_a_correct_answer_matches_and_appending_a_token_breaks_it(answer_and_gold):
    answer, gold = answer_and_gold
    assert answers_match(answer, gold)
    for token in _APPENDED_TOKENS:
        assert not answers_match(answer + token, gold), f"{answer + token!r} matched {gold!r}"


@_PROPERTY_SETTINGS
@given(st.integers(2, 999), st.sampled_from(["\\sqrt{3}", "√{3}", "\\pi", "π", "x", "\\frac{1}{7}", "cm^{3}"]))
def test_the_leading_number_of_a_gold_answer_is_not_the_answer(number, rest):
    # `cm^{3}`: a volume unit on the gold, and the bare number is the right answer
    assert answers_match(str(number), f"{number}{rest}") == (rest == "cm^{3}")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text(max_size=60), st.sampled_from(["5", "\\frac{1}{2}", "2√{3}", "A", "yes", "30°"]))
def test_arbitrary_predictions_never_raise(prediction, gold):
    assert answers_match(prediction, gold) in (True, False)


@pytest.mark.parametrize(
    "prediction",
    [
        "10^{10^{10}}",
        "9^{9^{9^{9}}}",
        "(10^{500})^{3}",
        "1000!",
        "9!!!!",
        "(" * 3000 + "1" + ")" * 3000,
        "\\frac{" * 60 + "1" + "}{2}" * 60,
        "1+" * 5000 + "1",
        "x" * 100_000,
        "\\sqrt{" * 40 + "2" + "}" * 40,
    ],
)
def test_hostile_predictions_score_zero_quickly(prediction):
    start = time.perf_counter()
    assert not answers_match(prediction, "1")
    assert time.perf_counter() - start < 5  # seconds on a loaded 2-core machine; typically a few ms


def test_answers_match_works_outside_the_main_thread():
    # math_verify's signal-based timeout only works in the main thread (Flower and Ray run rewards elsewhere), so
    # there only the static bounds keep a hostile prediction cheap.
    pairs = [("\\frac{7}{8}", "0.875"), ("2^{10^{10}}", "2^{10^{10}}+1"), ("(x+1)^{9999999}", "(1+x)^{9999999}")]
    results = []
    worker = threading.Thread(target=lambda: results.extend(answers_match(p, g) for p, g in pairs))
    start = time.perf_counter()
    worker.start()
    worker.join()
    assert results == [True, False, False]
    assert time.perf_counter() - start < 5


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
    assert answer_accuracy_reward(completions, answer=[gold] * 4, rg_entry=rg_entry) == [1.0, 1.0, 0.0, 0.0]


def test_rows_without_reasoning_gym_entry_fall_back_to_matching():
    entry = _chain_sum_entry()
    rg_entry = [None, json.dumps(entry)]
    rewards = answer_accuracy_reward(["<answer>0.5</answer>"] * 2, answer=["\\frac{1}{2}", "1"], rg_entry=rg_entry)
    assert rewards == [1.0, 0.0]


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


@pytest.mark.parametrize("reward_func", [answer_accuracy_reward, format_reward])
def test_rewards_declare_their_range(reward_func):
    low, high = reward_func.reward_range
    completions = ["<answer>1</answer>", "junk", "<answer>2</answer>"]
    rewards = reward_func(completions, answer=["1", "1", "1"])
    assert all(low <= reward <= high for reward in rewards)


def test_malformed_dataset_entry_raises():
    with pytest.raises(ValueError):  # a dataset bug must not silently score every answer 0
        answer_accuracy_reward(["<answer>1</answer>"], answer=["1"], rg_entry=["{not json"])
