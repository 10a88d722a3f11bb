"""Filters shared by every app's API."""

from __future__ import annotations

from datetime import UTC

import django_filters
from django_filters.rest_framework import DjangoFilterBackend


class UTCDateTimeFilter(django_filters.IsoDateTimeFilter):
    """An ISO 8601 time, compared in UTC. Offsets Python accepts but the database does not (over
    ±15:59 on PostgreSQL) are normalised away instead of failing the query."""

    def filter(self, qs, value):
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC)
        return super().filter(qs, value)


class FilterBackend(DjangoFilterBackend):
    """django-filter's backend, not run for a request that names none of the view's filters.

    A ``FilterSet`` deep-copies its filters and builds a form class for every request (about a
    millisecond of a list's time here), and filters given no value leave the queryset as it is
    (django-filter's ``Filter.filter`` returns it for an empty value), so a request without any of
    their parameters gets the queryset unchanged, as it would from the FilterSet. A parameter that
    begins with a filter's name (``submitted_after`` for a range's ``submitted``, say) takes the
    whole path."""

    def filter_queryset(self, request, queryset, view):
        filterset_class = self.get_filterset_class(view, queryset)
        if filterset_class is None:
            return queryset
        names = filterset_class.base_filters
        if not any(key.startswith(name) for key in request.query_params for name in names):
            return queryset
        return super().filter_queryset(request, queryset, view)
