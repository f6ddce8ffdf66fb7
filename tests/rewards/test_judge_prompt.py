"""The judge's group ranking: labels, the answer's schema, parsing (with and without the constraint) and the
normalisation within the group."""

import json

import pytest

from training.rewards.judge_prompt import (
    JudgeParseError,
    answer_schema,
    build_messages,
    member_label,
    normalise,
    parse_answer,
)


def test_labels_are_letters_then_pairs():
    assert [member_label(i) for i in (0, 1, 25, 26, 27, 51, 52)] == ["A", "B", "Z", "AA", "AB", "AZ", "BA"]
    assert len({member_label(i) for i in range(800)}) == 800


def test_prompt_shows_task_rubric_and_every_member_under_its_label():
    messages = build_messages("Add 2 and 3.", ["5", "it is 6", "x" * 50], "Correct answers win.", 0, 10, 20)
    system, user = messages[0]["content"], messages[1]["content"]
    assert "0" in system and "10" in system and "A, B, C" in system
    assert "Add 2 and 3." in user and "Correct answers win." in user
    assert user.index("Response A\n5") < user.index("Response B\nit is 6") < user.index("Response C")
    assert "x" * 20 + " [...cut]" in user and "x" * 21 not in user
    assert "Rubric" not in build_messages("t", ["a", "b"], None, 0, 10, 100)[1]["content"]


def test_schema_requires_every_label_and_bounds_score_and_reason():
    schema = answer_schema(3, 1, 5, 40)
    assert schema["required"] == ["A", "B", "C"] and schema["additionalProperties"] is False
    member = schema["properties"]["B"]
    assert member["properties"]["score"]["enum"] == [1, 2, 3, 4, 5]
    assert member["properties"]["reason"]["maxLength"] == 40
    assert "maxLength" not in answer_schema(2, 0, 1, None)["properties"]["A"]["properties"]["reason"]


def test_answers_parse_with_or_without_surrounding_prose():
    answer = {"A": {"reason": "right", "score": 9}, "B": {"reason": "wrong", "score": 2}}
    assert parse_answer(json.dumps(answer), 2, 0, 10) == ([9, 2], ["right", "wrong"])
    wrapped = "Here is my verdict:\n```json\n" + json.dumps(answer) + "\n```"
    assert parse_answer(wrapped, 2, 0, 10)[0] == [9, 2]
    assert parse_answer('{"A": {"reason": "", "score": 3.0}, "B": {"score": 4}}', 2, 0, 10)[0] == [3, 4]


@pytest.mark.parametrize(
    "text, needle",
    [
        ("no json at all", "no JSON object"),
        ("[1, 2]", "not a JSON object"),
        ('{"A": {"reason": "r", "score": 3}}', "'B'"),
        ('{"A": {"reason": "r", "score": 11}, "B": {"reason": "r", "score": 1}}', "[0, 10]"),
        ('{"A": {"reason": "r", "score": 2.5}, "B": {"reason": "r", "score": 1}}', "integer"),
        ('{"A": {"reason": "r", "score": true}, "B": {"reason": "r", "score": 1}}', "number"),
        ('{"A": {"reason": 3, "score": 1}, "B": {"reason": "r", "score": 1}}', "reason"),
    ],
)
def test_bad_answers_raise_naming_what_is_wrong(text, needle):
    with pytest.raises(JudgeParseError, match=None) as e:
        parse_answer(text, 2, 0, 10)
    assert needle in str(e.value)


def test_minmax_puts_the_best_at_one_and_the_worst_at_zero():
    assert normalise([2, 8, 5], "minmax", 0, 10) == [0.0, 1.0, 0.5]
    assert normalise([4, 4, 4], "minmax", 0, 10) == [0.5, 0.5, 0.5]


def test_rank_counts_only_the_order_and_ties_share_their_mean_rank():
    assert normalise([1, 9, 10], "rank", 0, 10) == [0.0, 0.5, 1.0]
    assert normalise([3, 7, 7, 0], "rank", 0, 10) == [
        pytest.approx(1 / 3),
        pytest.approx(5 / 6),
        pytest.approx(5 / 6),
        0.0,
    ]


def test_none_scales_the_absolute_score():
    assert normalise([0, 5, 10], "none", 0, 10) == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="normalise"):
        normalise([1, 2], "zscore", 0, 10)
