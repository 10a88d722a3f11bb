from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metering.money import minor_units, quantize_money

amounts = st.decimals(min_value=Decimal("-1e9"), max_value=Decimal("1e9"), allow_nan=False, places=10)


@pytest.mark.parametrize(
    ("amount", "currency", "expected"),
    [
        ("1.005", "USD", "1.01"),
        ("1.004999", "USD", "1.00"),
        ("-1.005", "EUR", "-1.01"),
        ("2.5", "JPY", "3"),
        ("2.5", "jpy", "3"),
        ("1.4999", "JPY", "1"),
        ("0.0005", "KWD", "0.001"),
        ("7", "XXX", "7.00"),  # ISO 4217 "no currency": unknown minor units fall back to 2
    ],
)
def test_half_up_at_the_currency_places(amount, currency, expected):
    got = quantize_money(Decimal(amount), currency)
    assert got == Decimal(expected) and str(got) == expected


def test_a_currency_with_more_places_than_amounts_keep_is_refused():
    assert minor_units("BHD") == 3
    with pytest.raises(ValueError, match="CLF has 4 decimal places"):
        quantize_money(Decimal("1.00005"), "CLF")


def test_floats_are_refused():
    with pytest.raises(TypeError):
        quantize_money(0.1, "USD")
    with pytest.raises(ValueError):
        quantize_money(Decimal("NaN"), "USD")


@given(amounts, st.sampled_from(["USD", "EUR", "JPY", "KWD"]))
def test_rounding_is_within_half_a_minor_unit_and_idempotent(amount, currency):
    q = quantize_money(amount, currency)
    unit = Decimal(1).scaleb(-minor_units(currency))
    assert abs(q - amount) <= unit / 2
    assert q.as_tuple().exponent == -minor_units(currency)
    assert quantize_money(q, currency) == q


@given(amounts, st.sampled_from(["USD", "JPY"]))
def test_rounding_is_symmetric_around_zero(amount, currency):
    assert quantize_money(-amount, currency) == -quantize_money(amount, currency)
