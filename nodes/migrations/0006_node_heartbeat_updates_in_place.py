from django.db import migrations


def _fillfactor(value: int):
    def set_fillfactor(apps, schema_editor):
        if schema_editor.connection.vendor != "postgresql":
            return
        table = schema_editor.quote_name(apps.get_model("nodes", "Node")._meta.db_table)
        schema_editor.execute(f"ALTER TABLE {table} SET (fillfactor = {value})")

    return set_fillfactor


class Migration(migrations.Migration):
    """Heartbeats update their node in place: the index on last_heartbeat_at made every heartbeat's
    update write a new entry in each of the table's indexes; pages keep 30 % free for the new row
    versions (it applies to pages written from now on)."""

    dependencies = [
        ("nodes", "0005_gpusample_gpu_without_db_constraint"),
    ]

    operations = [
        migrations.RemoveIndex(model_name="node", name="node_last_heartbeat"),
        migrations.RunPython(_fillfactor(70), _fillfactor(100)),
    ]
