"""Active allocations of one GPU may not overlap (see scheduling.models for the design).

PostgreSQL: an exclusion constraint over (gpu, capacity range) for rows with ``ended_at IS NULL``
(needs btree_gist for the ``gpu_id WITH =`` part; it is a trusted extension, so a database owner
may create it). SQLite: triggers that abort an insert or update that would overlap an open range
of the same GPU. Other databases get nothing here (gpupool supports these two).
"""

from django.db import migrations

PG_UP = [
    "CREATE EXTENSION IF NOT EXISTS btree_gist",
    """ALTER TABLE scheduling_allocation ADD CONSTRAINT allocation_no_overlap
       EXCLUDE USING gist (gpu_id WITH =, int4range(milli_offset, milli_offset + fraction_milli) WITH &&)
       WHERE (ended_at IS NULL)""",
]
PG_DOWN = ["ALTER TABLE scheduling_allocation DROP CONSTRAINT IF EXISTS allocation_no_overlap"]

_OVERLAP = """
    SELECT RAISE(ABORT, 'allocation_no_overlap: GPU capacity already allocated')
    WHERE NEW.ended_at IS NULL AND EXISTS (
        SELECT 1 FROM scheduling_allocation a
        WHERE a.gpu_id = NEW.gpu_id AND a.ended_at IS NULL AND a.id IS NOT NEW.id
          AND a.milli_offset < NEW.milli_offset + NEW.fraction_milli
          AND NEW.milli_offset < a.milli_offset + a.fraction_milli
    );
"""
SQLITE_UP = [
    f"CREATE TRIGGER allocation_no_overlap_insert BEFORE INSERT ON scheduling_allocation BEGIN {_OVERLAP} END",
    f"""CREATE TRIGGER allocation_no_overlap_update
        BEFORE UPDATE OF gpu_id, milli_offset, fraction_milli, ended_at ON scheduling_allocation
        BEGIN {_OVERLAP} END""",
]
SQLITE_DOWN = [
    "DROP TRIGGER IF EXISTS allocation_no_overlap_insert",
    "DROP TRIGGER IF EXISTS allocation_no_overlap_update",
]


def _run(statements_by_vendor):
    def run(apps, schema_editor):
        for sql in statements_by_vendor.get(schema_editor.connection.vendor, []):
            schema_editor.execute(sql)

    return run


class Migration(migrations.Migration):
    dependencies = [("scheduling", "0001_workloads")]

    operations = [
        migrations.RunPython(
            _run({"postgresql": PG_UP, "sqlite": SQLITE_UP}),
            _run({"postgresql": PG_DOWN, "sqlite": SQLITE_DOWN}),
            elidable=False,
        )
    ]
