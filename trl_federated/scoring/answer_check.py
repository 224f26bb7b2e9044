"""Whether a short final answer states the same value as a reference answer (`answers_match`).

The paper's reward is binary, and an RL policy learns whatever a reward lets through: a checker that reads only
the leading number of `5x`, `4\\sqrt{2}` or `2 or 3` pays for hedges and junk. Here an answer counts only when
all of it was understood: both answers are normalised (LaTeX wrappers, unicode, a known unit, a percent sign),
then each is either read as one complete math expression, all of whose tokens the parser consumed, or kept as
text that can only equal text. `math_verify` compares two complete expressions; its own extraction, which takes
the first thing it recognises, is never used.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from dataclasses import dataclass
from decimal import Decimal

import sympy
from latex2sympy2_extended.latex2sympy2 import ConversionConfig, _Latex2Sympy
from math_verify import verify
from sympy.core.relational import Relational
from sympy.logic.boolalg import BooleanFunction

logger = logging.getLogger(__name__)

_CHARACTERS = str.maketrans(
    {
        **{chr(code): chr(code - 0xFEE0) for code in range(0xFF01, 0xFF5F)},  # full-width ASCII forms
        "\u3000": " ",  # ideographic space
        "。": ".",
        "−": "-",  # U+2212 minus sign
        "–": "-",  # en dash, often typed for a minus
        "×": "\\times ",
        "·": "\\cdot ",
        "⋅": "\\cdot ",
        "÷": "\\div ",
        "±": "\\pm ",
        "π": "\\pi ",
        "∞": "\\infty ",
        "≤": "\\le ",
        "≥": "\\ge ",
        "≠": "\\ne ",
        "∠": "\\angle ",
        "√": "\\sqrt",  # `√{3}`; a bare radicand is braced first (`_UNICODE_ROOT_RE`)
        "²": "^{2}",
        "³": "^{3}",
    }
)
# `√` binds the whole number after it (`√12` is √12), unlike TeX's `\sqrt12`, which is √1·2.
_UNICODE_ROOT_RE = re.compile(r"√\s*(\d+(?:\.\d+)?|[A-Za-z](?![A-Za-z])|π)")
_BARE_SQRT_RE = re.compile(r"\\sqrt\s*(\d|[A-Za-z]|\\pi(?![A-Za-z]))")
_BARE_FRAC_RE = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")
_FRAC_VARIANT_RE = re.compile(r"\\[dt]frac(?![A-Za-z])")
_DELIMITER_RE = re.compile(r"\$|\\\(|\\\)|\\\[|\\\]")
# Styling that keeps its argument (`\text{cm}`, `\mathbf{5}`): one level of nested braces is enough for answers.
_STYLE_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mathsf|boldsymbol|mbox)\s*"
    r"\{((?:[^{}]|\{[^{}]*\})*)\}"
)
_SPACING_RE = re.compile(
    r"\\[,;:! ]|\\q?quad(?![A-Za-z])|~|\\displaystyle(?![A-Za-z])|\\(?:left|right)(?:\.|(?![A-Za-z]))"
)
_CHOICE_RE = re.compile(r"(?:(?i:choice|option|answer)\s*:?\s*)?\(?([A-Z])\)?[.:)]?")
# `x = 5`, `AB = 4 cm`, `\angle ABC = 30°`: the name of what is asked for, before its value.
_NAME_PREFIX_RE = re.compile(r"(?:\\angle\s*[A-Za-z0-9]{1,4}|[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?|[A-Z]{2,4})\s*=\s*(?=\S)")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?")
_PLAIN_NUMBER_RE = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")


def _unit_spellings() -> tuple[tuple[str, str | None], ...]:
    """Every accepted spelling of a trailing unit with its canonical name, longest spelling first.

    A canonical name of `None` is a unit that names nothing ("units"); it matches an answer with any unit or none.
    Area and volume spellings are derived from the lengths: `cm^2`, `cm^{2}`, `cm²`, `平方厘米`, `square centimeters`.
    """
    lengths = {  # canonical symbol: its spellings (symbols, Chinese, English)
        "mm": ("mm", "毫米", "millimeter", "millimeters", "millimetre", "millimetres"),
        "cm": ("cm", "厘米", "centimeter", "centimeters", "centimetre", "centimetres"),
        "dm": ("dm", "分米", "decimeter", "decimeters", "decimetre", "decimetres"),
        "m": ("m", "米", "meter", "meters", "metre", "metres"),
        "km": ("km", "千米", "公里", "kilometer", "kilometers", "kilometre", "kilometres"),
        "in": ("inch", "inches"),  # not the symbol `in`, which is also an English word
        "ft": ("ft", "foot", "feet"),
        "yd": ("yd", "yard", "yards"),
        "mi": ("mile", "miles"),
    }
    spellings: dict[str, str | None] = {}
    for canonical, names in lengths.items():
        for name in names:
            spellings[name] = canonical
            if not name.isascii():
                spellings["平方" + name], spellings["立方" + name] = f"{canonical}^2", f"{canonical}^3"
            elif len(name) <= 2:
                for power in ("2", "3"):
                    spellings[f"{name}^{power}"] = spellings[f"{name}^{{{power}}}"] = f"{canonical}^{power}"
            else:
                spellings["square " + name], spellings["cubic " + name] = f"{canonical}^2", f"{canonical}^3"
    for name in ("°", "^\\circ", "^{\\circ}", "\\circ", "\\degree", "度", "degree", "degrees", "deg"):
        spellings[name] = "°"
    for name in ("unit", "units", "square units", "sq units", "cubic units"):
        spellings[name] = None
    return tuple(sorted(spellings.items(), key=lambda item: -len(item[0])))


_UNIT_SPELLINGS = _unit_spellings()

# What a math answer may be made of. Anything else (a word, a prime, `\approx`, `\phantom`) makes the answer
# text: latex2sympy2 drops or guesses at such tokens (`5_x` → 5, `\phantom{3}5` → 8) instead of failing.
_TOKEN_RE = re.compile(r"\s+|\d+(?:\.\d+)?|\.\d+|\\[A-Za-z]+|\\[{}|]|[A-Za-z]|[-+*/^_()\[\]{},;:=<>|!]")
_GREEK = (
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho sigma tau "
    "upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Pi Sigma Upsilon Phi Psi Omega"
)
_COMMANDS = frozenset(
    "\\" + name
    for name in (
        "frac sqrt pi times cdot div pm mp infty le leq ge geq lt gt ne neq cup cap in emptyset varnothing "
        "sin cos tan cot sec csc arcsin arccos arctan ln log exp lvert rvert lfloor rfloor lceil rceil { } | "
        + _GREEK
    ).split()
)
_SCIENTIFIC_RE = re.compile(r"\d[eE][+-]?\d")  # `1e5` would parse as 1·e·5
_MAX_MATH_LENGTH = 200  # latex2sympy2 takes ~1-2 ms per character, and answers are short
_MAX_NESTING = 10  # deeper nesting recurses for seconds before the parser gives up
_MAX_EXPONENT = 1000
_MAX_FACTORIAL = 100
_MAX_MAGNITUDE = sympy.Integer(10) ** 1000
# Mixed numbers are the one juxtaposition that is not a product (`2\frac{1}{2}` = 5/2).
_MIXED_NUMBER_RE = re.compile(r"\d+\\frac\{(\d+)\}\{(\d+)\}")


class _CompleteParser(_Latex2Sympy):
    """latex2sympy2's parser with juxtaposition read as multiplication, except in a mixed number.

    Upstream reads any integer followed by a positive rational as a mixed number, so `3(4)`, `{3}{4}` and
    `3\\frac{4}{2}` all parse as 7; here only an integer followed by a literal proper fraction is one.
    """

    def convert_postfix_list(self, arr, i=0):
        rest = arr[i:]
        mixed = _MIXED_NUMBER_RE.fullmatch("".join(item.getText() for item in rest))
        if len(rest) == 1 or (mixed and int(mixed.group(1)) < int(mixed.group(2))):
            return super().convert_postfix_list(arr, i)
        first = self.convert_postfix(arr[i])
        if not isinstance(first, sympy.Expr):  # a derivative operator (`\frac{d}{dx}`): upstream's reading
            return super().convert_postfix_list(arr, i)
        return self.mul_flat(first, self.convert_postfix_list(arr, i + 1))


_PARSER = _CompleteParser(config=ConversionConfig(lowercase_symbols=False))


@dataclass(frozen=True)
class _Answer:
    text: str  # normalised, without its unit or percent sign
    unit: str | None  # canonical unit name
    percent: bool
    value: sympy.Basic | None  # the complete parse of `text`; None when `text` is not a math expression


def _normalise(answer: str) -> str:
    """The answer with LaTeX wrappers, spacing, unicode math and answer prefixes rewritten (see `answers_match`)."""
    text = _UNICODE_ROOT_RE.sub(r"\\sqrt{\1}", answer).translate(_CHARACTERS)
    text = _DELIMITER_RE.sub(" ", text).strip()
    previous = None
    while text != previous:
        previous = text
        text = _unwrap_boxed(_STYLE_RE.sub(r"\1", text).strip())
    text = _SPACING_RE.sub(" ", text)
    text = _FRAC_VARIANT_RE.sub(r"\\frac", text)
    text = _BARE_FRAC_RE.sub(r"\\frac{\1}{\2}", text)
    text = _BARE_SQRT_RE.sub(r"\\sqrt{\1}", text)
    text = " ".join(text.split()).removesuffix(".").rstrip()
    if name := _NAME_PREFIX_RE.match(text):
        text = text[name.end() :]
    return text.replace(",", "") if _THOUSANDS_RE.fullmatch(text) else text


def _unwrap_boxed(text: str) -> str:
    """The argument of `\\boxed{...}` (or `\\fbox{...}`) when it spans the whole text, else the text."""
    for command in ("\\boxed{", "\\fbox{"):
        if text.startswith(command) and text.endswith("}") and _closing_brace(text, len(command) - 1) == len(text) - 1:
            return text[len(command) : -1].strip()
    return text


def _closing_brace(text: str, opening: int) -> int | None:
    depth = 0
    for index in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return index
    return None


def _is_math(text: str) -> bool:
    """Whether `text` is written only in the math alphabet that latex2sympy2 reads completely, and small enough."""
    if not text or len(text) > _MAX_MATH_LENGTH or _SCIENTIFIC_RE.search(text):
        return False
    tokens = _TOKEN_RE.findall(text)
    if "".join(tokens) != text:  # a character outside the alphabet: a word in another script, a prime, `%`, ...
        return False
    depth, previous, adjacent = 0, "", ""  # the last token that is not a space, and the last token
    for token in tokens:
        is_letter = len(token) == 1 and token.isalpha()
        if token.isspace():
            adjacent = token
            continue
        depth += (token in "([{") - (token in ")]}")
        if depth > _MAX_NESTING or (token.startswith("\\") and token not in _COMMANDS):
            return False
        if is_letter and len(adjacent) == 1 and adjacent.isalpha():  # a word, not a product of variables
            return False
        if _is_number(token) and _is_number(previous):  # `3 4`, `3.2.5`: no reading is safe
            return False
        if token == "_" and not (len(previous) == 1 and previous.isalpha() or previous.startswith("\\")):
            return False  # a subscript on a number is dropped by the parser (`5_2` → 5)
        previous = adjacent = token
    return True


def _is_number(token: str) -> bool:
    return bool(token) and (token[0].isdigit() or token[0] == ".")


def _is_tame(value: sympy.Basic) -> bool:
    """Whether comparing `value` stays cheap: no huge exponent, factorial or power (`10^{10^{10}}`).

    Checked bottom-up, so an inner tower is rejected before an outer one is ever evaluated. This bound holds in
    every thread, where `math_verify`'s signal-based timeout only works in the main one.
    """
    for node in sympy.postorder_traversal(value):
        if isinstance(node, sympy.factorial) and not _within(node.args[0], _MAX_FACTORIAL):
            return False
        if isinstance(node, sympy.Pow) and not (_within(node.exp, _MAX_EXPONENT) and _within(node, _MAX_MAGNITUDE)):
            return False
    return True


def _within(value: sympy.Basic, bound: sympy.Expr | int) -> bool:
    """Whether a numeric `value` is at most `bound` in absolute value (always true of a symbolic one)."""
    if not value.is_number:
        return True
    try:
        return bool(abs(value.evalf(5)) <= bound)
    except (TypeError, ValueError):  # nan, or a value that cannot be ordered
        return False


def _parse(text: str) -> sympy.Basic | None:
    """The complete parse of `text` as one math expression, or None."""
    if not _is_math(text):
        return None
    try:
        value = _PARSER.parse(text)
    except Exception:  # a syntax error, or too deep for the parser's recursion: not a math expression
        return None
    return value if _is_tame(value) else None


@functools.lru_cache(maxsize=4096)
def _read(answer: str) -> _Answer:
    """An answer normalised and, where it is a complete math expression, parsed (cached: gold answers repeat)."""
    text = _normalise(answer)
    if choice := _CHOICE_RE.fullmatch(text):  # a letter, not a variable: `E` is no 2.718282
        return _Answer(choice.group(1), None, False, None)
    percent = text.endswith("%")
    if percent:
        text = text.removesuffix("%").removesuffix("\\").rstrip()
    for spelling, unit in _UNIT_SPELLINGS:
        if not text.endswith(spelling) or len(text) == len(spelling):
            continue
        before = text[-len(spelling) - 1]
        if _is_ascii_letter(spelling[0]) and (_is_ascii_letter(before) or before == "\\"):
            continue  # `5cm` ends in the unit `m` no more than `\pm` does
        number = text[: -len(spelling)].rstrip()
        value = _parse(number)
        if value is not None:  # a unit only counts after a complete expression
            return _Answer(number, unit, percent, value)
    return _Answer(text, None, percent, _parse(text))


def _is_ascii_letter(char: str) -> bool:
    return char.isascii() and char.isalpha()


def _same_value(gold: sympy.Basic, prediction: sympy.Basic) -> bool:
    # A predicted statement (`2+2=5`, `x>0`) only equals a statement: math_verify would take the right side of
    # `2+2=5`. A gold statement may still equal a set (`x>2` and `(2, \infty)`).
    statements = (Relational, BooleanFunction)
    if isinstance(prediction, statements) and not isinstance(gold, statements):
        return False
    if gold.is_number and prediction.is_number and _far_apart(gold, prediction):
        return False  # most answers in RL are wrong: skip math_verify's symbolic simplification (~50 ms)
    # math_verify's timeout uses signal.alarm, which only works in the main thread; `_is_tame` bounds the rest.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    return verify(gold, prediction, timeout_seconds=timeout)


def _far_apart(gold: sympy.Basic, prediction: sympy.Basic) -> bool:
    """Whether two numbers differ by far more than math_verify's rounding to 6 decimal places could forgive."""
    try:
        return bool(abs((gold - prediction).evalf(15)) > 1e-3 * (1 + abs(gold.evalf(15))))
    except (TypeError, ValueError):  # nan, zoo: leave them to math_verify
        return False


def answers_match(prediction: str, gold: str) -> bool:
    """Whether `prediction` states the same answer as `gold` (`answer_accuracy_reward`'s rule without reasoning-gym).

    Both answers are normalised the same way:

    - `$`, `\\(`, `\\)`, `\\[`, `\\]` are dropped; a `\\boxed{...}` or `\\fbox{...}` spanning the whole answer is
      unwrapped, as are `\\text{...}`, `\\mathrm{...}`, `\\mathbf{...}` and similar styling; `\\left`, `\\right`,
      `\\displaystyle` and LaTeX spacing (`\\,`, `\\quad`, `~`) become spaces; one trailing full stop is dropped.
    - Unicode math becomes LaTeX: `√{3}`, `√3` → `\\sqrt{3}` (`√12` is √12); `π` → `\\pi`; `×`, `·`, `÷`, `±`,
      `−`, `∞`, `≤`, `≥`, `²`, `³` likewise; full-width characters become ASCII. `\\dfrac`/`\\tfrac` are `\\frac`;
      `\\frac12` is `\\frac{1}{2}` and `\\sqrt3` is `\\sqrt{3}`.
    - A multiple-choice letter is that letter as text: `A`, `(A)`, `A.`, `A)`, `Choice A`, `Option (A)`,
      `Answer: A` (upper case only, so that `a` stays a variable; and `E` is not Euler's number).
    - A leading name of what was asked for is dropped: `x = 5`, `AB = 4cm`, `∠ABC = 30°` state `5`, `4cm`, `30°`.
    - Thousands separators in a plain number are dropped (`1,000` is 1000).
    - A trailing `%` or `\\%` is remembered and removed. A trailing unit from a fixed list is removed and
      remembered, but only as a whole suffix after a complete math expression: lengths mm, cm, dm, m, km, inch,
      ft, yd, mile and their Chinese (毫米, 厘米, 分米, 米, 千米, 公里) and English names; their areas and volumes
      (`cm^2`, `cm^{2}`, `cm²`, `平方厘米`, `square centimeters`, `cm^3`, `立方米`, ...); degrees (`°`, `^\\circ`,
      `^{\\circ}`, `度`, `degrees`, `deg`); and "units", "square units", which name nothing.

    What remains is either a math expression, read completely by latex2sympy2 (digits, single-letter variables,
    `+ - * / ^ _ ( ) [ ] { } , ; : = < > | !`, and `\\frac`, `\\sqrt`, `\\pi`, `\\times`, `\\cdot`, `\\div`, `\\pm`,
    `\\infty`, relations, `\\cup`, trigonometric functions, `\\ln`, `\\log`, `\\exp`, Greek letters), or text.
    Text is anything else: a word (two letters in a row, so `2 or 3`, `yes`, `AB`), a character outside that
    alphabet, two numbers side by side (`3 4`, `3.2.5`), `1e5`, a subscript on a number, an expression over 200
    characters, nested over 10 levels, or with an exponent over 1000, a factorial over 100! or a power over
    10^1000. Juxtaposition is multiplication (`4\\sqrt{2}`, `5x`), except a mixed number `2\\frac{1}{2}` = 5/2.

    The answers then match when their units agree (both the same canonical unit, or at most one of them has one,
    so `27cm^{2}` matches `27` and `27平方厘米` but not `27cm`; `30°` is not converted to radians) and:

    - their normalised texts are equal (case-insensitively when both are text, so `Yes` matches `yes`), with the
      same percent sign; or
    - both are plain decimals of equal value (`7` matches `7.0`); or
    - both are math expressions, the prediction a statement (`=`, `<`, ...) only if the gold is one, and
      `math_verify.verify` finds them equal: symbolically (`\\frac{1}{2}` and `0.5`, `2\\sqrt{3}` and `\\sqrt{12}`,
      `x+1` and `1+x`), a decimal against another expression to 6 decimal places (`3.141593` matches `\\pi`,
      `3.14` does not), sets and intervals as sets (`\\{2,3\\}` does not match `3`). With a percent sign on one
      side only, the bare number may be the percentage without its sign or the fraction: `25%` matches `25%`,
      `25` and `0.25`, but not `2500`.

    An expression that is not complete never falls back to a prefix: `5x`, `4\\sqrt{2}`, `2 or 3` do not match
    `5`, `4`, `3`, and a gold `2√{3}` is not matched by `2`. Never raises: any error is a mismatch.
    """
    try:
        return _match(prediction, gold)
    except Exception:  # a reward must never take a training step down because of what the model wrote
        logger.debug("Comparison failed for %r against %r", prediction, gold, exc_info=True)
        return False


@functools.lru_cache(maxsize=16384)
def _match(prediction: str, gold: str) -> bool:
    pred, ref = _read(prediction), _read(gold)
    if not pred.text or not ref.text:
        return False
    if pred.unit and ref.unit and pred.unit != ref.unit:
        return False
    if pred.percent == ref.percent:
        both_text = pred.value is None and ref.value is None
        if pred.text == ref.text or (both_text and pred.text.casefold() == ref.text.casefold()):
            return True
        if _PLAIN_NUMBER_RE.fullmatch(pred.text) and _PLAIN_NUMBER_RE.fullmatch(ref.text):
            return Decimal(pred.text) == Decimal(ref.text)
    if pred.value is None or ref.value is None:
        return False
    if _same_value(ref.value, pred.value):
        return True
    if pred.percent == ref.percent:
        return False
    hundredth = sympy.Rational(1, 100)  # with the sign on one side only, the other may state the fraction
    if pred.percent:
        return _same_value(ref.value, pred.value * hundredth)
    return _same_value(ref.value * hundredth, pred.value)
