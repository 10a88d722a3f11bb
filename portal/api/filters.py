"""Filters shared by every app's API."""

from __future__ import annotations

from datetime import UTC

import django_filters


class UTCDateTimeFilter(django_filters.IsoDateTimeFilter):
    """An ISO 8601 time, compared in UTC. Offsets Python accepts but the database does not (over
    ±15:59 on PostgreSQL) are normalised away instead of failing the query."""

    def filter(self, qs, value):
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC)
        return super().filter(qs, value)
