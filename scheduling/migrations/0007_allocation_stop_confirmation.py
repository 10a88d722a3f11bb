from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0006_avoid_nodes_warm_slot_ready"),
    ]

    operations = [
        migrations.AddField(
            model_name="allocation",
            name="stop_forced_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="allocation",
            name="stop_confirmed_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name="allocation",
            index=models.Index(
                condition=models.Q(("stop_confirmed_at__isnull", True), ("stop_forced_at__isnull", False)),
                fields=["node", "gpu"],
                name="allocation_stop_unconfirmed",
            ),
        ),
    ]
