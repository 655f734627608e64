"""Attack class 18: ``judge --require`` over verdicts a policy shapes (they come from
sandboxes), with an expression a user types. Neither may run code, crash the check, or pass
it with an odd value."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from placement.errors import PlacementConfigError
from placement.requirements import parse_requirement

pytestmark = pytest.mark.attack(18)

HOSTILE_VERDICTS: list[Any] = [
    None,
    "passed",
    ["score", 1],
    {},
    {"score": "1"},  # a string where a number is compared
    {"score": True},  # bool is not a number here
    {"score": math.nan},
    {"score": math.inf},
    {"score": -math.inf},
    {"score": [0.9]},
    {"score": {"value": 0.9}},
    {"score": None},
    {"score": "x" * 1_000_000},
    {"checks": "not a mapping"},
]


def _deep(levels: int) -> dict[str, Any]:
    verdict: dict[str, Any] = {"score": 1}
    for _ in range(levels):
        verdict = {"checks": verdict}
    return verdict


@pytest.mark.parametrize("verdict", HOSTILE_VERDICTS, ids=repr)
@pytest.mark.parametrize("expr", ["score>=0.5", "score!=0", "score==1", "checks.score<2"])
def test_an_odd_verdict_fails_the_requirement_and_never_raises(verdict: Any, expr: str) -> None:
    why = parse_requirement(expr).failure(verdict)
    assert why is not None and len(why) < 200


def test_types_are_compared_strictly() -> None:
    assert parse_requirement("passed==true").failure({"passed": 1}) is not None
    assert parse_requirement("score==1").failure({"score": True}) is not None
    assert parse_requirement("score==1").failure({"score": 1.0}) is None
    assert parse_requirement("grade!=F").failure({"grade": "A"}) is None
    assert parse_requirement('grade=="F"').failure({"grade": "F"}) is None
    assert parse_requirement("reason==null").failure({"reason": None}) is None
    assert parse_requirement("a.b.c>=3").failure({"a": {"b": {"c": 3}}}) is None
    assert parse_requirement("checks.score>0").failure(_deep(50)) is not None  # one level only
    # an int too large for a float compares exactly, and is quoted cut
    assert parse_requirement("score>=0.5").failure({"score": 10**400}) is None
    assert parse_requirement("score<0.5").failure({"score": 10**4000}) is not None
    assert parse_requirement("score<0.5").failure({"score": -(10**5000)}) is None


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('touch /tmp/pwned')==0",
        "score>=0.5 or True",
        "score>=NaN",
        "score>=Infinity",
        "score>=[1]",
        'score>="0.5"',  # an ordering needs a number
        "score>=true",
        "score",
        "==1",
        "score=>1",
        "sco re==1",
        "score==1;rm -rf /",
    ],
)
def test_a_malformed_expression_is_a_typed_error_never_evaluated(expr: str) -> None:
    with pytest.raises(PlacementConfigError, match="--require"):
        parse_requirement(expr)


def test_the_value_in_a_failure_message_is_bounded_and_json() -> None:
    why = parse_requirement("score==1").failure({"score": "\x1b]0;pwned\x07" + "x" * 500})
    assert why is not None and len(why) < 200 and "\x1b" not in why
    assert json.loads(why.split(" is ", 1)[1].split(", not", 1)[0].rstrip("…") + '"') != ""
