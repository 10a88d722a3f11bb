"""portal.compiler: SELECT shapes kept between queries, on the test database's own backend."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.db.models import Count
from django.db.models.functions import Lower
from django.test import override_settings

from nodes.models import Node, NodeState, Region

pytestmark = pytest.mark.django_db


@pytest.fixture
def shapes(monkeypatch) -> dict:
    """This test's own kept shapes (the process keeps them across tests otherwise)."""
    compiler_class = connection.ops.compiler("SQLCompiler")
    monkeypatch.setattr(compiler_class, "_shapes", {})
    return compiler_class._shapes


@pytest.fixture
def fleet(db) -> tuple[Node, Node]:
    east = Region.objects.create(code="us-east-1", name="US East")
    west = Region.objects.create(code="eu-west-1", name="EU West")
    a = Node.objects.create(hostname="a", region=east, cpu_cores=8, status={"ok": 1})
    b = Node.objects.create(hostname="b", region=west, cpu_cores=16, state=NodeState.CORDONED)
    return a, b


def compiled(queryset):
    """(compiler, sql, params) as the queryset would run, and Django's own compiler's (sql, params)
    from a copy of the same query."""
    plain = connection.ops.compiler("SQLCompiler").plain(queryset.query.clone(), connection, queryset.db)
    compiler = queryset.query.get_compiler(using=queryset.db)
    sql, params = compiler.as_sql()
    return compiler, (sql, tuple(params)), _tuple(plain.as_sql())


def _tuple(sql_params):
    return sql_params[0], tuple(sql_params[1])


@override_settings(DB_COMPILE_CACHE="on")
def test_a_shape_compiled_once_serves_queries_with_other_values(shapes, fleet):
    def query(hostname):
        return Node.objects.select_related("region").defer("status").filter(hostname=hostname)

    first, first_sql, django_first = compiled(query("a"))
    assert not first._shape_hit and first_sql == django_first
    assert len(shapes) == 1

    second, second_sql, django_second = compiled(query("b"))
    assert second._shape_hit
    assert second_sql == django_second
    assert second_sql[1] != first_sql[1]  # the values differ, the statement does not
    assert second_sql[0] == first_sql[0]

    (node,) = query("b")  # rows become instances through the kept row mapping
    assert node.hostname == "b" and node.region.code == "eu-west-1" and node.cpu_cores == 16
    assert node.get_deferred_fields() == {"status"}
    assert len(shapes) == 1


@override_settings(DB_COMPILE_CACHE="on")
def test_queries_of_different_shapes_keep_shapes_of_their_own(shapes, fleet):
    variants = {
        "plain": lambda v: Node.objects.filter(cpu_cores__gte=v),
        "ordered": lambda v: Node.objects.filter(cpu_cores__gte=v).order_by("-cpu_cores", "pk"),
        "reverse": lambda v: Node.objects.filter(cpu_cores__gte=v).reverse(),
        "ordered through a join": lambda v: Node.objects.filter(cpu_cores__gte=v).order_by("region__code"),
        "with its region": lambda v: Node.objects.filter(cpu_cores__gte=v).select_related("region"),
        "joined by a filter": lambda v: Node.objects.filter(cpu_cores__gte=v, region__code__startswith="e"),
        "joined and with its region": lambda v: Node.objects.filter(
            cpu_cores__gte=v, region__code__startswith="e"
        ).select_related("region"),
        "some fields": lambda v: Node.objects.filter(cpu_cores__gte=v).only("hostname"),
        "deferred": lambda v: Node.objects.filter(cpu_cores__gte=v).defer("labels", "status"),
        "distinct": lambda v: Node.objects.filter(cpu_cores__gte=v).distinct(),
        "sliced": lambda v: Node.objects.filter(cpu_cores__gte=v)[1:5],
        "unordered": lambda v: Node.objects.filter(cpu_cores__gte=v).order_by(),
        "excluding": lambda v: Node.objects.exclude(cpu_cores__gte=v),
        "in a subquery": lambda v: Region.objects.filter(nodes__in=Node.objects.filter(cpu_cores__gte=v)),
        "values": lambda v: Node.objects.filter(cpu_cores__gte=v).values("id", "hostname"),
        "values through a join": lambda v: Node.objects.filter(cpu_cores__gte=v).values("id", "region__code"),
        "values_list": lambda v: Node.objects.filter(cpu_cores__gte=v).values_list("hostname", "id"),
    }
    off = {}
    with override_settings(DB_COMPILE_CACHE="off"):
        for name, make in variants.items():
            off[name] = rows(make(10))
    for name, make in variants.items():
        _, sql, django_sql = compiled(make(4))
        assert sql == django_sql, name
        compiler, sql, django_sql = compiled(make(10))
        assert compiler._shape_hit, name
        assert sql == django_sql, name
        assert rows(make(10)) == off[name], name
    # "sliced" and "excluding" share the plain query's shape (the LIMIT and the WHERE clause are
    # compiled every time); the subquery's inner query (its ids) has a shape of its own.
    assert len(shapes) == len(variants) - 2 + 1


def rows(queryset) -> list:
    return [r if isinstance(r, dict | tuple) else (r.pk, r.__dict__.get("hostname")) for r in queryset]


@override_settings(DB_COMPILE_CACHE="on")
def test_a_row_lock_and_its_tables_are_part_of_the_shape(shapes, fleet):
    with transaction.atomic():
        compiled(Node.objects.select_for_update().filter(hostname="a"))
        compiler, sql, django_sql = compiled(Node.objects.select_for_update().filter(hostname="b"))
        assert compiler._shape_hit and sql == django_sql
        compiler, sql, django_sql = compiled(
            Node.objects.select_related("region").select_for_update(of=("self",)).filter(hostname="b")
        )
        assert not compiler._shape_hit and sql == django_sql


@override_settings(DB_COMPILE_CACHE="on")
def test_queries_it_cannot_key_are_compiled_as_django_does(shapes, fleet):
    for queryset in (
        Node.objects.annotate(n=Count("gpus")),
        Region.objects.annotate(n=Count("nodes")).filter(n__gt=0),
        Node.objects.extra(select={"one": "1"}),
        Node.objects.order_by(Lower("hostname")),
        Node.objects.values("hostname").annotate(n=Count("gpus")),
        Node.objects.values_list(Lower("hostname")),
    ):
        for _ in range(2):
            compiler, sql, django_sql = compiled(queryset)
            assert compiler._shape is None and not compiler._shape_hit
            assert sql == django_sql
    assert Node.objects.filter(hostname="a").exists()
    assert Node.objects.count() == 2
    assert shapes == {}


@override_settings(DB_COMPILE_CACHE="off")
def test_off_keeps_nothing(shapes, fleet):
    for host in ("a", "b"):
        compiler, sql, django_sql = compiled(Node.objects.select_related("region").filter(hostname=host))
        assert compiler._shape is None and sql == django_sql
    assert shapes == {}


@override_settings(DB_COMPILE_CACHE="verify")
def test_verify_raises_when_a_kept_shape_differs_from_djangos_compilation(shapes, fleet):
    assert [n.hostname for n in Node.objects.select_related("region").filter(cpu_cores__gt=1)] == ["a", "b"]
    (shape,) = shapes.values()
    assert [n.hostname for n in Node.objects.select_related("region").filter(cpu_cores__gt=9)] == ["b"]
    shape.from_ = (shape.from_[0][:1], [])  # as if the region's join had been lost
    with pytest.raises(AssertionError, match="compiled differently"):
        list(Node.objects.select_related("region").filter(cpu_cores__gt=9))
