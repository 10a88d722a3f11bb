"""Bounds of what a request may send: JSON nesting, dates and months.

Every date, time or month that comes from a query string or a form goes through these, so that
nothing later (a month's end, a shift to UTC, a date printed on a report) leaves the calendar that
Python and the database share: outside the bounds the caller gets a ValidationError naming the
accepted form, which the API and pages answer with a 400.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime

import orjson
import yaml
from django.core.exceptions import ValidationError

# orjson's own fixed limit on nesting (json.loads would hit RecursionError near 1,000, a 500). The
# agent protocol (nodes.agent_views) parses its bodies with orjson under the same limit.
JSON_MAX_DEPTH = 1024
JSON_ERROR = f"Not valid JSON (or nested more than {JSON_MAX_DEPTH} levels deep)."
# YAML bodies (Kubernetes manifests, a few KiB): PyYAML's composer recurses per level, and an alias
# expands wherever it is walked, so depth is bounded well below Python's recursion limit and
# anchors and aliases are refused.
YAML_MAX_BYTES = 256 * 1024
YAML_MAX_DEPTH = 32

# [EARLIEST, LATEST): what the portal's dates and times may be.
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(2100, 1, 1, tzinfo=UTC)
MONTH_RE = re.compile(r"^(\d{4})-(\d{2})$")
MONTH_HELP = "Use a month as YYYY-MM from 1970-01 to 2099-12, e.g. 2024-03."
DATE_HELP = "Must be from 1970-01-01 to 2099-12-31 (UTC)."


def json_loads(body: bytes | str) -> object:
    """``body`` parsed as JSON; ValueError (``JSON_ERROR``) for bad JSON or nesting past the limit."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ValueError(JSON_ERROR) from None


def yaml_loads(body: bytes) -> object:
    """``body`` as one YAML document with PyYAML's safe loader, within the bounds above; ValueError
    naming what is wrong. The events are checked first, building nothing, so a refused body costs
    no memory."""
    if len(body) > YAML_MAX_BYTES:
        raise ValueError(f"A YAML body is at most {YAML_MAX_BYTES // 1024} KiB.")
    loader = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader
    try:
        text = body.decode("utf-8")
        depth = 0
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise ValueError("YAML anchors and aliases are not accepted.")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > YAML_MAX_DEPTH:
                    raise ValueError(f"YAML nested more than {YAML_MAX_DEPTH} levels deep.")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        return yaml.load(text, Loader=loader)
    except (yaml.YAMLError, UnicodeDecodeError, TypeError) as exc:
        # TypeError: an unhashable key ({[a]: b}); an integer past Python's digit limit is a ValueError.
        raise ValueError(f"Not valid YAML: {str(exc).splitlines()[0][:200]}") from None


def parse_month(value: str) -> date:
    """``YYYY-MM`` as the first day of that month, within the bounds."""
    m = MONTH_RE.match(value.strip())
    if not m or not 1 <= int(m.group(2)) <= 12 or not EARLIEST.year <= int(m.group(1)) < LATEST.year:
        raise ValidationError(MONTH_HELP, code="invalid_month")
    return date(int(m.group(1)), int(m.group(2)), 1)


def bounded_date(value: date) -> date:
    if not EARLIEST.date() <= value < LATEST.date():
        raise ValidationError(DATE_HELP, code="date_out_of_range")
    return value


def bounded_datetime(value: datetime) -> datetime:
    """An aware ``value`` in UTC (a naive one is taken as UTC), within the bounds."""
    try:
        value = value.astimezone(UTC) if value.tzinfo is not None else value.replace(tzinfo=UTC)
    except OverflowError:  # an offset that takes it before year 1 or past 9999
        raise ValidationError(DATE_HELP, code="date_out_of_range") from None
    if not EARLIEST <= value < LATEST:
        raise ValidationError(DATE_HELP, code="date_out_of_range")
    return value
