from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0005_allocation_span"),
    ]

    operations = [
        migrations.AddField(
            model_name="workload",
            name="avoid_nodes",
            field=models.JSONField(
                blank=True,
                default=list,
                help_text="Ids of nodes that failed to start it (start failed or timed out); placed "
                "elsewhere unless no other node could ever take it.",
            ),
        ),
        migrations.AddField(
            model_name="warmslot",
            name="ready_at",
            field=models.DateTimeField(
                blank=True, help_text="When the prewarm command finished; empty while it runs.", null=True
            ),
        ),
    ]
