from django.db import migrations, models


class Migration(migrations.Migration):
    """A usage record may be empty: a Slurm run that sacct records as 0 s bills its minimum."""

    dependencies = [
        ("metering", "0009_money_regions_memory_budget_action"),
        ("scheduling", "0026_allocation_slurm_job_label"),
    ]

    operations = [
        migrations.RemoveConstraint(model_name="usagerecord", name="usagerecord_end_after_start"),
        migrations.AddConstraint(
            model_name="usagerecord",
            constraint=models.CheckConstraint(
                condition=models.Q(("end__gte", models.F("start"))), name="usagerecord_end_not_before_start"
            ),
        ),
    ]
