"""Gauges a GPU cannot report are stored as NULL, not 0; rollups count the readings of each gauge."""

from django.db import migrations, models
from django.db.models import F


def counts_from_sample_count(apps, schema_editor):
    # Before this migration every reading carried all four gauges.
    rollup = apps.get_model("nodes", "GpuMinuteRollup")
    rollup.objects.update(
        util_count=F("sample_count"), mem_used_count=F("sample_count"), power_count=F("sample_count")
    )


class Migration(migrations.Migration):
    dependencies = [("nodes", "0002_node_workloads_digest")]

    operations = [
        migrations.AlterField("gpusample", "util_pct", models.FloatField(blank=True, null=True)),
        migrations.AlterField("gpusample", "mem_used_mib", models.IntegerField(blank=True, null=True)),
        migrations.AlterField("gpusample", "power_w", models.FloatField(blank=True, null=True)),
        migrations.AlterField("gpusample", "temp_c", models.SmallIntegerField(blank=True, null=True)),
        migrations.AddField("gpuminuterollup", "util_count", models.PositiveIntegerField(default=0)),
        migrations.AddField("gpuminuterollup", "mem_used_count", models.PositiveIntegerField(default=0)),
        migrations.AddField("gpuminuterollup", "power_count", models.PositiveIntegerField(default=0)),
        migrations.AlterField("gpuminuterollup", "util_max", models.FloatField(blank=True, null=True)),
        migrations.AlterField("gpuminuterollup", "mem_used_max", models.IntegerField(blank=True, null=True)),
        migrations.AlterField("gpuminuterollup", "temp_max", models.SmallIntegerField(blank=True, null=True)),
        migrations.RunPython(counts_from_sample_count, migrations.RunPython.noop, elidable=True),
    ]
