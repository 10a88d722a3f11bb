"""portal.api.renderers.JSONRenderer: DRF's bytes, encoded by orjson."""

from __future__ import annotations

import dataclasses
import json
import uuid
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

import pytest
from django.utils.translation import gettext_lazy
from rest_framework.renderers import JSONRenderer as DRFRenderer
from rest_framework.utils.serializer_helpers import ReturnDict, ReturnList

from portal.api.renderers import JSONRenderer
from scheduling.models import WorkloadState


@dataclasses.dataclass
class Point:
    x: int
    y: float


DATA = {
    "count": 3,
    "ratio": 0.1,
    "big": 2**63 - 1,
    "small": -(2**63),
    "float": 1234.5678,
    "none": None,
    "flags": [True, False],
    "text": 'GPU \u201cH100\u201d \u2013 ünïcode ✓ and \u2028 and \u2029 and \x00 \\ "',
    "at": datetime(2026, 12, 3, 22, 1, 33, 123456, tzinfo=UTC),
    "naive": datetime(2026, 12, 3, 22, 1, 33),
    "day": date(2026, 12, 3),
    "clock": time(22, 1, 33, 123456),
    "span": timedelta(hours=1, seconds=5),
    "price": Decimal("2.50"),
    "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "lazy": gettext_lazy("Not found."),
    "state": WorkloadState.RUNNING,
    "tuple": (1, "a"),
    "nested": ReturnDict(
        {"rows": ReturnList([{"a": 1}, {"b": [1, {"c": None}]}], serializer=None)}, serializer=None
    ),
    1: "an int key",
    None: "a null key",
}


def test_the_bytes_are_drfs():
    assert JSONRenderer().render(DATA, "application/json") == DRFRenderer().render(DATA, "application/json")


@pytest.mark.parametrize(
    "data",
    [
        {"wide": 10**30},  # wider than 64 bits: DRF's renderer
        [],
        "",
        {"deep": [[[[{"x": 1}]]]]},
    ],
)
def test_edge_values_render_as_drfs(data):
    assert JSONRenderer().render(data, "application/json") == DRFRenderer().render(data, "application/json")


def test_indented_and_empty_answers_are_drfs():
    for media in ("application/json; indent=4", "application/json; indent=0"):
        assert JSONRenderer().render(DATA, media) == DRFRenderer().render(DATA, media)
    assert JSONRenderer().render(DATA, None, {"indent": 2}) == DRFRenderer().render(DATA, None, {"indent": 2})
    assert JSONRenderer().render(None) == b""


def test_what_drf_cannot_encode_fails_the_same_way():
    with pytest.raises(TypeError):
        DRFRenderer().render({"x": object()})
    with pytest.raises(TypeError):
        JSONRenderer().render({"x": object()})
    with pytest.raises(TypeError):  # DRF's encoder takes no dataclass either
        DRFRenderer().render({"x": Point(1, 2.5)})
    with pytest.raises(TypeError):
        JSONRenderer().render({"x": Point(1, 2.5)})


def test_a_float_in_exponent_form_is_spelt_without_padding():
    """The same number: the standard library writes 1.5e-07, orjson 1.5e-7."""
    data = {"x": 1.5e-7, "y": 1e22, "z": 5e-324}
    ours = JSONRenderer().render(data)
    assert ours == b'{"x":1.5e-7,"y":1e+22,"z":5e-324}'
    assert json.loads(ours) == json.loads(DRFRenderer().render(data)) == data


def test_a_float_that_is_not_finite_renders_as_null():
    """Where DRF's strict encoder fails the request with a ValueError."""
    assert JSONRenderer().render({"x": float("nan"), "y": float("inf")}) == b'{"x":null,"y":null}'


@pytest.mark.django_db
def test_the_api_answers_through_it(api, tenant, make_token):
    response = api(make_token(tenant)).get("/api/v1/gpu-types/")
    assert response.status_code == 200
    assert isinstance(response.accepted_renderer, JSONRenderer)
    assert response.content == DRFRenderer().render(response.data, "application/json")
