"""Money: ``Decimal`` everywhere, rounded once, in one function.

Rounding rule: ROUND_HALF_UP at the currency's minor units, as CLDR gives them (Babel's
``get_currency_precision``: USD, EUR, GBP 2 places; JPY, KRW 0; BHD, KWD 3; an unknown code 2).
Unit prices keep 10 places (``UNIT_PRICE_FIELD``); amounts on usage records keep 10 places
unrounded; an invoice line is rounded once, by :func:`quantize_money`, and an invoice's
total is the sum of its (rounded) lines, so it equals that sum exactly.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

from babel.numbers import get_currency_precision

UNIT_PRICE_MAX_DIGITS = 22
UNIT_PRICE_PLACES = 10
AMOUNT_MAX_DIGITS = 22
AMOUNT_PLACES = 10
# Rounded money (invoice lines and totals): the most minor units a currency in circulation has.
MONEY_MAX_DIGITS = 18
MONEY_PLACES = 3

ZERO = Decimal(0)
HOUR = Decimal(3600)


def minor_units(currency: str) -> int:
    """The currency's decimal places. More than the database keeps (CLF and UYW, units of account
    with 4) is refused rather than rounded away."""
    places = get_currency_precision(currency.upper())
    if places > MONEY_PLACES:
        raise ValueError(f"{currency.upper()} has {places} decimal places; amounts keep {MONEY_PLACES}.")
    return places


def quantize_money(amount: Decimal | int | str, currency: str) -> Decimal:
    """``amount`` rounded half-up (away from zero on a tie) to ``currency``'s minor units."""
    if isinstance(amount, float):
        raise TypeError("Money is never a float; pass a Decimal or a string.")
    value = Decimal(amount)
    if not value.is_finite():
        raise ValueError(f"Not a finite amount: {amount!r}")
    exponent = Decimal(1).scaleb(-minor_units(currency))
    return value.quantize(exponent, rounding=ROUND_HALF_UP)


def quantize_unit(amount: Decimal) -> Decimal:
    """An unrounded amount or unit price at the 10 places the database keeps (half-up)."""
    return Decimal(amount).quantize(Decimal(1).scaleb(-UNIT_PRICE_PLACES), rounding=ROUND_HALF_UP)


def percent_of(amount: Decimal, percent: Decimal) -> Decimal:
    return Decimal(amount) * Decimal(percent) / Decimal(100)


def to_minor_units(amount: Decimal | int | str, currency: str) -> int:
    """``amount`` (in currency units) as an integer of the currency's minor units, as payment
    providers take it: 12.34 USD -> 1234, 1234 JPY -> 1234, 1.234 BHD -> 1234. The amount must
    already be at the currency's places (invoice lines and totals are); anything finer is an error,
    never silently rounded."""
    if isinstance(amount, float):
        raise TypeError("Money is never a float; pass a Decimal or a string.")
    value = Decimal(amount)
    exact = quantize_money(value, currency)
    if exact != value:
        raise ValueError(f"{amount} has more places than {currency.upper()} has minor units.")
    return int(exact.scaleb(minor_units(currency)))


def from_minor_units(amount: int, currency: str) -> Decimal:
    """The inverse of :func:`to_minor_units`: 1234 minor units of USD -> Decimal("12.34")."""
    if not isinstance(amount, int) or isinstance(amount, bool):
        raise TypeError(f"Minor units are an integer, not {type(amount).__name__}.")
    return Decimal(amount).scaleb(-minor_units(currency))
