"""Allocation.span_milli: the capacity of its GPU a share holds when the GPU is over-subscribed
(``GpuModel.oversubscription``); null means ``fraction_milli``. The no-overlap rule of
``0002_allocation_no_overlap`` (PostgreSQL exclusion constraint, SQLite triggers) now compares the
ranges ``[milli_offset, milli_offset + coalesce(span_milli, fraction_milli))``."""

import django.db.models.expressions
import django.db.models.functions.comparison
from django.db import migrations, models

_PG_EXCLUDE = """ALTER TABLE scheduling_allocation ADD CONSTRAINT allocation_no_overlap
   EXCLUDE USING gist (gpu_id WITH =, int4range(milli_offset, milli_offset + {span}) WITH &&)
   WHERE (ended_at IS NULL)"""
PG_DROP = "ALTER TABLE scheduling_allocation DROP CONSTRAINT IF EXISTS allocation_no_overlap"
PG_UP = [PG_DROP, _PG_EXCLUDE.format(span="COALESCE(span_milli, fraction_milli)")]
PG_DOWN = [PG_DROP, _PG_EXCLUDE.format(span="fraction_milli")]

_OVERLAP = """
    SELECT RAISE(ABORT, 'allocation_no_overlap: GPU capacity already allocated')
    WHERE NEW.ended_at IS NULL AND EXISTS (
        SELECT 1 FROM scheduling_allocation a
        WHERE a.gpu_id = NEW.gpu_id AND a.ended_at IS NULL AND a.id IS NOT NEW.id
          AND a.milli_offset < NEW.milli_offset + {new}
          AND NEW.milli_offset < a.milli_offset + {old}
    );
"""
SQLITE_DROP = [
    "DROP TRIGGER IF EXISTS allocation_no_overlap_insert",
    "DROP TRIGGER IF EXISTS allocation_no_overlap_update",
]


def _sqlite(new: str, old: str, columns: str) -> list[str]:
    body = _OVERLAP.format(new=new, old=old)
    return [
        *SQLITE_DROP,
        f"CREATE TRIGGER allocation_no_overlap_insert BEFORE INSERT ON scheduling_allocation BEGIN {body} END",
        f"""CREATE TRIGGER allocation_no_overlap_update
            BEFORE UPDATE OF {columns} ON scheduling_allocation
            BEGIN {body} END""",
    ]


SQLITE_UP = _sqlite(
    "COALESCE(NEW.span_milli, NEW.fraction_milli)",
    "COALESCE(a.span_milli, a.fraction_milli)",
    "gpu_id, milli_offset, fraction_milli, span_milli, ended_at",
)
SQLITE_DOWN = _sqlite(
    "NEW.fraction_milli", "a.fraction_milli", "gpu_id, milli_offset, fraction_milli, ended_at"
)


def _run(statements_by_vendor):
    def run(apps, schema_editor):
        for sql in statements_by_vendor.get(schema_editor.connection.vendor, []):
            schema_editor.execute(sql)

    return run


class Migration(migrations.Migration):
    dependencies = [("scheduling", "0004_quota_fair_share_weight")]

    operations = [
        migrations.RemoveConstraint(model_name="allocation", name="allocation_range_inside_gpu"),
        migrations.AddField(
            model_name="allocation",
            name="span_milli",
            field=models.PositiveSmallIntegerField(
                blank=True,
                help_text="Capacity of the GPU held, when less than the fraction (an over-subscribed GPU).",
                null=True,
            ),
        ),
        migrations.AddConstraint(
            model_name="allocation",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("milli_offset__gte", 0),
                    (
                        "milli_offset__lte",
                        django.db.models.expressions.CombinedExpression(
                            models.Value(1000),
                            "-",
                            django.db.models.functions.comparison.Coalesce(
                                models.F("span_milli"), models.F("fraction_milli")
                            ),
                        ),
                    ),
                ),
                name="allocation_range_inside_gpu",
            ),
        ),
        migrations.AddConstraint(
            model_name="allocation",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("span_milli__isnull", True),
                    models.Q(
                        ("fraction_milli__lt", 1000),
                        ("span_milli__gte", 1),
                        ("span_milli__lte", models.F("fraction_milli")),
                    ),
                    _connector="OR",
                ),
                name="allocation_span_range",
            ),
        ),
        # After the column exists (SQLite rebuilds the table for the field and drops its triggers).
        migrations.RunPython(
            _run({"postgresql": PG_UP, "sqlite": SQLITE_UP}),
            _run({"postgresql": PG_DOWN, "sqlite": SQLITE_DOWN}),
            elidable=False,
        ),
    ]
