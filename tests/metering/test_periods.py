import itertools
from datetime import UTC, date, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from metering.periods import days_in_period, period_bounds, period_of, period_starts_between, split_interval

moments = st.datetimes(
    min_value=datetime(2023, 1, 1), max_value=datetime(2026, 12, 31), timezones=st.just(UTC)
)


def test_months_are_half_open_in_utc():
    assert period_bounds(date(2024, 2, 1)) == (
        datetime(2024, 2, 1, tzinfo=UTC),
        datetime(2024, 3, 1, tzinfo=UTC),
    )
    assert period_of(datetime(2024, 3, 1, tzinfo=UTC)) == date(2024, 3, 1)
    assert period_of(datetime(2024, 2, 29, 23, 59, 59, tzinfo=UTC)) == date(2024, 2, 1)
    assert days_in_period(date(2024, 2, 1)) == 29 and days_in_period(date(2023, 2, 1)) == 28
    assert period_bounds(date(2024, 12, 1))[1] == datetime(2025, 1, 1, tzinfo=UTC)


@given(moments, st.integers(min_value=1, max_value=200 * 86400), st.lists(moments, max_size=6))
def test_splitting_at_periods_and_price_changes_conserves_time(start, length_s, changes):
    end = start + timedelta(seconds=length_s)
    cuts = period_starts_between(start, end) + changes
    pieces = split_interval(start, end, cuts)
    assert pieces[0][0] == start and pieces[-1][1] == end
    assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
    assert sum(((e - s) for s, e in pieces), timedelta()) == end - start
    for s, e in pieces:
        assert period_of(s) == period_of(e - timedelta(microseconds=1)), "a piece crosses a month"
        assert not any(s < c < e for c in cuts), "a piece crosses a price change"
