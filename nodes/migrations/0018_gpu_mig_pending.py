from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("nodes", "0017_resize_workload_command"),
    ]

    operations = [
        migrations.AddField(
            model_name="gpu",
            name="mig_pending",
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="gpu",
            name="mig_requested_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="gpu",
            name="mig_sent_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
