"""Rows load from lists or jsonl; the cursor resumes exactly at the rows not yet trained."""

import json

import pytest

from training.utils.data import RowCursor, load_rows


def test_load_rows_from_jsonl(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text(json.dumps({"a": 1}) + "\n\n" + json.dumps({"a": 2}) + "\n")
    assert load_rows(p) == [{"a": 1}, {"a": 2}]
    assert load_rows(str(p)) == [{"a": 1}, {"a": 2}]


@pytest.mark.parametrize(
    "content, msg", [("{bad\n", "rows.jsonl:1 is not valid JSON"), ("[1]\n", "expected a JSON object")]
)
def test_bad_jsonl_names_the_line(tmp_path, content, msg):
    p = tmp_path / "rows.jsonl"
    p.write_text(content)
    with pytest.raises(ValueError, match=msg):
        load_rows(p)


def test_bad_rows():
    with pytest.raises(ValueError, match="empty"):
        load_rows([])
    with pytest.raises(TypeError, match=r"rows\[1\]"):
        load_rows([{}, 3])
    with pytest.raises(FileNotFoundError):
        load_rows("/nonexistent/rows.jsonl")


def test_cursor_shuffles_each_epoch_and_covers_every_row():
    c = RowCursor(num_rows=10, epochs=2, seed=3)
    positions = list(c.positions())
    assert positions == list(range(20))
    e0 = [c.row_index(p) for p in range(10)]
    e1 = [c.row_index(p) for p in range(10, 20)]
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1


def test_cursor_resume_reruns_only_rows_not_done():
    c = RowCursor(num_rows=8, seed=1)
    taken = [c.take() for _ in range(6)]
    for p in (0, 1, 2, 4):  # 3 and 5 were in flight when the run stopped
        c.mark_done(p)
    state = json.loads(json.dumps(c.state()))
    resumed = RowCursor(num_rows=8, seed=1)
    resumed.load_state(state)
    assert list(resumed.positions()) == [3, 5, 6, 7]
    assert taken == list(range(6))


def test_requeued_position_is_taken_again_first_and_survives_resume_as_not_done():
    c = RowCursor(num_rows=6, shuffle=False)
    taken = [c.take() for _ in range(4)]
    c.mark_done(0)
    c.mark_done(2)
    c.requeue(1)  # dropped as stale: given back, not done
    assert c.has_next() and c.take() == 1 and c.take() == 4
    resumed = RowCursor(num_rows=6, shuffle=False)
    resumed.load_state(c.state())  # killed now: 1, 3, 4 in flight, 5 never taken
    assert list(resumed.positions()) == [1, 3, 4, 5]
    assert taken == [0, 1, 2, 3] and not resumed.has_next()
