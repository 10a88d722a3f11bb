"""portal.rows: Statement (hand-written SQL written once per vendor and shape) and ModelColumns."""

from __future__ import annotations

import pytest
from django.utils import timezone

from nodes.models import Node, NodeCommand, Region

pytestmark = pytest.mark.django_db


@pytest.fixture
def rows(make_tenant):
    region = Region.objects.create(code="us-east-1", name="US East")
    node = Node.objects.create(hostname="n1", region=region, cpu_cores=64)
    now = timezone.now()
    NodeCommand.objects.create(
        node=node, kind="drain", payload={"why": "test"}, next_attempt_at=now, deadline=now
    )


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
