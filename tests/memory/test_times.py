"""``at=``, ``as_of=``, ``since=`` and ``until=`` accept datetimes and ISO 8601 strings; a time
without an offset is UTC."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta, timezone

import pytest

from torpor.errors import InvalidArgument
from torpor.memory import Memory
from torpor.memory import _validate as check
from torpor.memory.models import to_us


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2024-03-15T09:30:00Z", datetime(2024, 3, 15, 9, 30, tzinfo=UTC)),
        ("2024-03-15T09:30:00+02:00", datetime(2024, 3, 15, 7, 30, tzinfo=UTC)),
        ("2024-03-15T09:30:00.250000", datetime(2024, 3, 15, 9, 30, 0, 250_000, tzinfo=UTC)),
        ("2024-03-15 09:30", datetime(2024, 3, 15, 9, 30, tzinfo=UTC)),
        ("2024-03-15", datetime(2024, 3, 15, tzinfo=UTC)),
        (" 2024-03-15T09:30:00Z ", datetime(2024, 3, 15, 9, 30, tzinfo=UTC)),
        (datetime(2024, 3, 15, 9, 30), datetime(2024, 3, 15, 9, 30, tzinfo=UTC)),
        (
            datetime(2024, 3, 15, 9, 30, tzinfo=timezone(timedelta(hours=-5))),
            datetime(2024, 3, 15, 14, 30, tzinfo=UTC),
        ),
        (date(2024, 3, 15), datetime(2024, 3, 15, tzinfo=UTC)),
    ],
)
def test_time_accepts_datetimes_and_iso_strings_naive_is_utc(
    value: object, expected: datetime
) -> None:
    assert check.time(value, "at") == to_us(expected)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["yesterday", "2024-13-01", "", "15/03/2024", 1710495000, 3.5])
def test_time_refuses_what_is_not_a_time(value: object) -> None:
    with pytest.raises(InvalidArgument, match="at must be a datetime"):
        check.time(value, "at")  # type: ignore[arg-type]


def test_log_at_and_recall_as_of_take_iso_strings(mem: Memory) -> None:
    u = mem.scope(user="u1")
    ep = u.log("user", "I moved to Lisbon", at="2024-03-15T09:30:00+01:00")
    assert ep.valid_from == datetime(2024, 3, 15, 8, 30, tzinfo=UTC)
    naive = u.log("user", "I adopted a cat in Lisbon", at="2024-04-01 12:00")
    assert naive.valid_from == datetime(2024, 4, 1, 12, 0, tzinfo=UTC)
    ids = {h.id for h in u.recall("Lisbon", 5, since="2024-03-20", until="2024-05-01")}
    assert ids == {naive.id}
    fact = u.remember("lives in Lisbon", key="city")
    before = u.recall("Lisbon", 5, as_of="2000-01-01T00:00:00Z")
    assert before == []
    now = u.recall("Lisbon", 5, as_of=datetime.now(UTC).isoformat())
    assert fact.id in {h.id for h in now}


def test_a_bad_at_string_writes_nothing(mem: Memory) -> None:
    u = mem.scope(user="u1")
    with pytest.raises(InvalidArgument):
        u.log_many(
            [
                {"role": "user", "text": "first", "at": "2024-03-15"},
                {"role": "user", "text": "second", "at": "not a time"},
            ]
        )
    assert u.recall("first second", 5) == []


def test_a_turn_logged_at_the_unix_epoch_keeps_its_time(mem: Memory) -> None:
    """``at`` at 1970-01-01T00:00:00Z is 0 microseconds, which read as "no ``at``": the turn
    was dated now, by ``log`` and ``log_many`` alike."""
    u = mem.scope(app="a")
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    assert u.log("user", "the first turn", at="1970-01-01T00:00:00Z").at == epoch
    (turn,) = u.log_many([{"role": "user", "text": "another", "at": epoch}])
    assert turn.at == epoch
    assert {e.valid_from for e in u.get_all(kind="episode").items} == {epoch}
