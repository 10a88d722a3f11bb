"""Database guards for billing (see metering.models).

1. A finalized, paid or void invoice is immutable: an UPDATE that changes its money fields (or its
   tenant, period or currency, or sets it back to draft) is refused, and so is any INSERT, UPDATE or
   DELETE of its lines and deleting it. Status may still move on (finalized -> paid / void).
2. Versions of one rate card never overlap: on PostgreSQL an exclusion constraint over
   ``tstzrange(effective_from, effective_to, '[)')`` (btree_gist for the ``rate_card_id WITH =``
   part); on SQLite triggers that abort an overlapping insert or update.

PostgreSQL raises SQLSTATE 23514 (check_violation), SQLite RAISE(ABORT): both reach Django as
``IntegrityError``.
"""

from django.db import migrations

MONEY = [
    "subtotal",
    "credits",
    "tax",
    "total",
    "tax_rate_percent",
    "currency",
    "tenant_id",
    "period_start",
    "period_end",
]

PG_UP = [
    "CREATE EXTENSION IF NOT EXISTS btree_gist",
    """ALTER TABLE metering_ratecardversion ADD CONSTRAINT ratecardversion_no_overlap
       EXCLUDE USING gist (rate_card_id WITH =, tstzrange(effective_from, effective_to, '[)') WITH &&)""",
    """CREATE OR REPLACE FUNCTION metering_invoice_guard() RETURNS trigger AS $$
    BEGIN
      IF TG_OP = 'DELETE' THEN
        IF OLD.status <> 'draft' THEN
          RAISE EXCEPTION 'invoice_immutable: invoice % is %, it cannot be deleted', OLD.id, OLD.status
            USING ERRCODE = 'check_violation';
        END IF;
        RETURN OLD;
      END IF;
      IF OLD.status <> 'draft' AND (NEW.status = 'draft' OR """
    + " OR ".join(f"NEW.{f} IS DISTINCT FROM OLD.{f}" for f in MONEY)
    + """) THEN
        RAISE EXCEPTION 'invoice_immutable: invoice % is %, its money fields cannot change', OLD.id, OLD.status
          USING ERRCODE = 'check_violation';
      END IF;
      RETURN NEW;
    END $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER metering_invoice_guard BEFORE UPDATE OR DELETE ON metering_invoice
       FOR EACH ROW EXECUTE FUNCTION metering_invoice_guard()""",
    """CREATE OR REPLACE FUNCTION metering_invoiceline_guard() RETURNS trigger AS $$
    DECLARE inv_id bigint; inv_status text;
    BEGIN
      FOR inv_id IN SELECT unnest(ARRAY[
          CASE WHEN TG_OP <> 'INSERT' THEN OLD.invoice_id END,
          CASE WHEN TG_OP <> 'DELETE' THEN NEW.invoice_id END]) LOOP
        SELECT status INTO inv_status FROM metering_invoice WHERE id = inv_id;
        IF inv_status IS NOT NULL AND inv_status <> 'draft' THEN
          RAISE EXCEPTION 'invoice_immutable: invoice % is %, its lines cannot change', inv_id, inv_status
            USING ERRCODE = 'check_violation';
        END IF;
      END LOOP;
      IF TG_OP = 'DELETE' THEN RETURN OLD; END IF;
      RETURN NEW;
    END $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER metering_invoiceline_guard BEFORE INSERT OR UPDATE OR DELETE ON metering_invoiceline
       FOR EACH ROW EXECUTE FUNCTION metering_invoiceline_guard()""",
]
PG_DOWN = [
    "DROP TRIGGER IF EXISTS metering_invoiceline_guard ON metering_invoiceline",
    "DROP FUNCTION IF EXISTS metering_invoiceline_guard()",
    "DROP TRIGGER IF EXISTS metering_invoice_guard ON metering_invoice",
    "DROP FUNCTION IF EXISTS metering_invoice_guard()",
    "ALTER TABLE metering_ratecardversion DROP CONSTRAINT IF EXISTS ratecardversion_no_overlap",
]

_VERSION_OVERLAP = """
    SELECT RAISE(ABORT, 'ratecardversion_no_overlap: versions of a rate card may not overlap')
    WHERE EXISTS (
        SELECT 1 FROM metering_ratecardversion v
        WHERE v.rate_card_id = NEW.rate_card_id AND v.id IS NOT NEW.id
          AND (v.effective_to IS NULL OR v.effective_to > NEW.effective_from)
          AND (NEW.effective_to IS NULL OR NEW.effective_to > v.effective_from)
    );
"""
_LINE_GUARD = """
    SELECT RAISE(ABORT, 'invoice_immutable: the invoice is not a draft, its lines cannot change')
    WHERE EXISTS (SELECT 1 FROM metering_invoice i WHERE i.id = {ref}.invoice_id AND i.status <> 'draft');
"""
_changed = " OR ".join(f"NEW.{f} IS NOT OLD.{f}" for f in MONEY)
SQLITE_UP = [
    f"""CREATE TRIGGER ratecardversion_no_overlap_insert BEFORE INSERT ON metering_ratecardversion
        BEGIN {_VERSION_OVERLAP} END""",
    f"""CREATE TRIGGER ratecardversion_no_overlap_update
        BEFORE UPDATE OF rate_card_id, effective_from, effective_to ON metering_ratecardversion
        BEGIN {_VERSION_OVERLAP} END""",
    f"""CREATE TRIGGER metering_invoice_guard_update BEFORE UPDATE ON metering_invoice
        WHEN OLD.status <> 'draft' AND (NEW.status = 'draft' OR {_changed})
        BEGIN SELECT RAISE(ABORT, 'invoice_immutable: a finalized invoice''s money fields cannot change'); END""",
    """CREATE TRIGGER metering_invoice_guard_delete BEFORE DELETE ON metering_invoice
        WHEN OLD.status <> 'draft'
        BEGIN SELECT RAISE(ABORT, 'invoice_immutable: a finalized invoice cannot be deleted'); END""",
    f"CREATE TRIGGER metering_invoiceline_guard_insert BEFORE INSERT ON metering_invoiceline BEGIN {_LINE_GUARD.format(ref='NEW')} END",
    f"""CREATE TRIGGER metering_invoiceline_guard_update BEFORE UPDATE ON metering_invoiceline
        BEGIN {_LINE_GUARD.format(ref="OLD")} {_LINE_GUARD.format(ref="NEW")} END""",
    f"CREATE TRIGGER metering_invoiceline_guard_delete BEFORE DELETE ON metering_invoiceline BEGIN {_LINE_GUARD.format(ref='OLD')} END",
]
SQLITE_DOWN = [
    f"DROP TRIGGER IF EXISTS {name}"
    for name in (
        "ratecardversion_no_overlap_insert",
        "ratecardversion_no_overlap_update",
        "metering_invoice_guard_update",
        "metering_invoice_guard_delete",
        "metering_invoiceline_guard_insert",
        "metering_invoiceline_guard_update",
        "metering_invoiceline_guard_delete",
    )
]


def _run(statements_by_vendor):
    def run(apps, schema_editor):
        for sql in statements_by_vendor.get(schema_editor.connection.vendor, []):
            schema_editor.execute(sql, None)

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("metering", "0001_rate_cards_usage_invoices"),
        ("scheduling", "0002_allocation_no_overlap"),
    ]

    operations = [
        migrations.RunPython(
            _run({"postgresql": PG_UP, "sqlite": SQLITE_UP}),
            _run({"postgresql": PG_DOWN, "sqlite": SQLITE_DOWN}),
            elidable=False,
        )
    ]
