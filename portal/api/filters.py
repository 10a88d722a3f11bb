"""Filters shared by every app's API."""

from __future__ import annotations

import django_filters
from django import forms
from django.db import models
from django_filters.fields import IsoDateTimeField
from django_filters.filters import QuerySetRequestMixin
from django_filters.rest_framework import DjangoFilterBackend, FilterSet

from portal.api.context import request_context
from portal.inputs import bounded_date, bounded_datetime
from portal.tenancy import TenantOwnedModel


class UTCDateTimeField(IsoDateTimeField):
    """An ISO 8601 time in UTC, within ``portal.inputs``' bounds: an offset Python accepts but the
    database does not (over ±15:59 on PostgreSQL) is normalised away, and one that takes the time
    off the calendar (``0001-01-01T00:00+23:59``) is a 400 naming the filter."""

    def to_python(self, value):
        value = super().to_python(value)
        return None if value is None else bounded_datetime(value)


class BoundedDateField(forms.DateField):
    def to_python(self, value):
        value = super().to_python(value)
        return None if value is None else bounded_date(value)


class UTCDateTimeFilter(django_filters.IsoDateTimeFilter):
    field_class = UTCDateTimeField


class BoundedDateFilter(django_filters.DateFilter):
    field_class = BoundedDateField


class TenantFilterSet(FilterSet):
    """The base of every filter set of the tenant API (declared, and those the backend makes from
    ``filterset_fields``): a filter whose choices are rows of a tenant-owned model (``?workload=``,
    ``?invoice=``) chooses among the request's tenant's rows only, so another tenant's id is refused
    exactly as an id that does not exist (400), instead of answering an empty 200. Filters made
    from date and time fields are bounded (``portal.inputs``), as the declared ones must be."""

    FILTER_DEFAULTS = {
        **FilterSet.FILTER_DEFAULTS,
        models.DateTimeField: {"filter_class": UTCDateTimeFilter},
        models.DateField: {"filter_class": BoundedDateFilter},
    }

    def __init__(self, data=None, queryset=None, *, request=None, prefix=None):
        super().__init__(data, queryset, request=request, prefix=prefix)
        tenant = request_context(request).tenant if request is not None else None
        for f in self.filters.values():
            choices = getattr(f, "queryset", None) if isinstance(f, QuerySetRequestMixin) else None
            if choices is not None and not callable(choices) and issubclass(choices.model, TenantOwnedModel):
                f.queryset = choices.filter(tenant=tenant) if tenant is not None else choices.none()


class FilterBackend(DjangoFilterBackend):
    """django-filter's backend, not run for a request that names none of the view's filters.

    A ``FilterSet`` deep-copies its filters and builds a form class for every request (about a
    millisecond of a list's time here), and filters given no value leave the queryset as it is
    (django-filter's ``Filter.filter`` returns it for an empty value), so a request without any of
    their parameters gets the queryset unchanged, as it would from the FilterSet. A parameter that
    begins with a filter's name (``submitted_after`` for a range's ``submitted``, say) takes the
    whole path. Filter sets made from ``filterset_fields`` are ``TenantFilterSet``s too."""

    filterset_base = TenantFilterSet

    def filter_queryset(self, request, queryset, view):
        filterset_class = self.get_filterset_class(view, queryset)
        if filterset_class is None:
            return queryset
        names = filterset_class.base_filters
        if not any(key.startswith(name) for key in request.query_params for name in names):
            return queryset
        return super().filter_queryset(request, queryset, view)
