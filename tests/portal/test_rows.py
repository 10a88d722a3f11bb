"""portal.rows: QuickLoad (instances read from the database are built without Model.__init__, and
are the instances Django builds) and Statement (hand-written SQL written once per vendor and shape)."""

from __future__ import annotations

import pytest
from django.db import models
from django.db.models.signals import post_init, pre_init
from django.test.utils import isolate_apps
from django.utils import timezone

from nodes.models import Node, NodeCommand, NodeState, Region
from portal.models import Tenant
from portal.rows import QuickLoad, _quick_attnames
from scheduling.models import Workload

pytestmark = pytest.mark.django_db


def _seen(instance) -> tuple:
    """What an instance is: its values under their attribute names, its state, what it defers and
    the related objects it holds."""
    values = {k: v for k, v in instance.__dict__.items() if k != "_state"}
    state = instance._state
    return values, state.adding, state.db, instance.get_deferred_fields(), dict(state.fields_cache)


def _django_built(model) -> tuple[list[object], object]:
    """A receiver of post_init for ``model`` makes QuickLoad take Django's own path."""
    calls = []

    def receiver(sender, instance, **kwargs):
        calls.append(instance)

    post_init.connect(receiver, sender=model, weak=False)
    return calls, receiver


@pytest.fixture
def rows(make_tenant):
    tenant = make_tenant()
    region = Region.objects.create(code="us-east-1", name="US East")
    node = Node.objects.create(
        hostname="n1", region=region, cpu_cores=64, status={"ok": True}, labels={"a": 1}
    )
    now = timezone.now()
    NodeCommand.objects.create(
        node=node, kind="drain", payload={"why": "test"}, next_attempt_at=now, deadline=now
    )
    Workload.objects.create(tenant=tenant, kind="job", name="w", region=region, env={"A": "b"}, command=["x"])
    return tenant


QUERIES = {
    "workloads with their regions": lambda: Workload.objects.select_related("region"),
    "workloads, deferred": lambda: Workload.objects.defer("log_tail", "env"),
    "workloads, some fields": lambda: Workload.objects.only("name", "state"),
    "nodes": lambda: Node.objects.all(),
    "nodes with their regions, deferred": lambda: Node.objects.select_related("region").defer("status"),
    "commands with their nodes": lambda: NodeCommand.objects.select_related("node__region"),
    "tenants": lambda: Tenant.objects.all(),
}


@pytest.mark.parametrize("name", QUERIES)
def test_instances_are_those_django_builds(rows, name):
    quick = list(QUERIES[name]())
    model = type(quick[0])
    assert issubclass(model, QuickLoad) and _quick_attnames(model) is not None
    calls, receiver = _django_built(model)
    try:
        django = list(QUERIES[name]())
    finally:
        post_init.disconnect(receiver, sender=model)
    assert len(calls) == len(django) > 0  # Django's path built these
    assert [_seen(i) for i in quick] == [_seen(i) for i in django]
    for instance in quick:  # deferred fields still load on access, and saving works
        for field in instance.get_deferred_fields():
            getattr(instance, field)
        instance.save()


def test_a_receiver_of_pre_init_gets_djangos_path(rows):
    calls = []

    def receiver(sender, **kwargs):
        calls.append(sender)

    pre_init.connect(receiver, sender=Region, weak=False)
    try:
        (region,) = Region.objects.all()
    finally:
        pre_init.disconnect(receiver, sender=Region)
    assert calls == [Region] and region.code == "us-east-1"


def test_a_loaded_instance_behaves_as_djangos(rows):
    node = Node.objects.select_related("region").get(hostname="n1")
    assert node.region.code == "us-east-1" and node.region_id == node.region.pk
    node.state = NodeState.CORDONED
    node.save(update_fields=["state"])
    assert Node.objects.get(pk=node.pk).state == NodeState.CORDONED
    other = Region.objects.create(code="eu-west-1", name="EU West")
    node.region_id = other.pk  # the id changes: the cached region goes, as with Django's instances
    assert node.region == other
    assert node == Node.objects.get(pk=node.pk) and hash(node) == hash(node.pk)


@isolate_apps("portal")
def test_models_it_cannot_build_the_same_way_are_left_to_django():
    class OwnInit(QuickLoad, models.Model):  # noqa: DJ008
        name = models.CharField(max_length=10)

        class Meta:
            app_label = "portal"

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seen = True

    class WithFile(QuickLoad, models.Model):  # noqa: DJ008
        upload = models.FileField()

        class Meta:
            app_label = "portal"

    class Plain(QuickLoad, models.Model):  # noqa: DJ008
        name = models.CharField(max_length=10)
        parent = models.ForeignKey("self", null=True, on_delete=models.CASCADE)

        class Meta:
            app_label = "portal"

    assert _quick_attnames(OwnInit) is None
    assert _quick_attnames(WithFile) is None
    assert _quick_attnames(Plain) == ("id", "name", "parent_id")
    built = Plain.from_db("default", ["id", "name", "parent_id"], [1, "a", None])
    assert built.__dict__ == {"_state": built._state, "id": 1, "name": "a", "parent_id": None}
    assert not built._state.adding and built._state.db == "default"
    own = OwnInit.from_db("default", ["id", "name"], [1, "a"])
    assert own.seen and own.name == "a"


def test_a_statement_is_written_once_per_vendor_and_shape():
    from django.db import connection

    from portal.rows import Statement

    written = []

    @Statement
    def statement(connection, n: int) -> str:
        written.append(n)
        return f"SELECT {', '.join(['%s'] * n)}"

    assert statement.sql(connection, 2) == "SELECT %s, %s"
    assert statement.sql(connection, 2) == "SELECT %s, %s"
    assert statement.sql(connection, 3) == "SELECT %s, %s, %s"
    assert written == [2, 3]
    for n in range(Statement.MAX_SHAPES + 10):  # past the bound the text is written, not kept
        statement.sql(connection, 100 + n)
    assert len(statement._sql) == Statement.MAX_SHAPES
    assert (
        statement.sql(connection, 100 + Statement.MAX_SHAPES + 5).count("%s")
        == 100 + Statement.MAX_SHAPES + 5
    )


def test_a_joined_select_reads_a_row_with_the_row_it_points_to(rows):
    from django.db import connection

    from portal.rows import ModelColumns

    commands = ModelColumns(NodeCommand, "c", ["kind"])
    nodes = ModelColumns(Node, "n", ["hostname"])
    head = commands.select_joined(connection, nodes, "node")
    with connection.cursor() as cursor:
        cursor.execute(f"{head} WHERE {commands.column(connection, 'kind')} = %s", ["drain"])
        assert cursor.fetchall() == [("drain", "n1")]
