# Slurm array jobs: a task row per array task (<job_id>_<index>). Numbered 0023: the lead renumbers
# the migrations before it.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("nodes", "0014_region_backend_slurm"),
        ("scheduling", "0022_elastic_jobs"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="slurmjob",
            name="slurmjob_region_job_id",
        ),
        migrations.AddField(
            model_name="slurmjob",
            name="array_task_id",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="An array task's index in its Slurm array job (<job_id>_<index>).",
                null=True,
            ),
        ),
        migrations.AlterField(
            model_name="slurmjob",
            name="job_id",
            field=models.BigIntegerField(help_text="Slurm's job id; of an array task, its array job's."),
        ),
        migrations.AddConstraint(
            model_name="slurmjob",
            constraint=models.UniqueConstraint(
                condition=models.Q(("array_task_id__isnull", True)),
                fields=("region", "job_id"),
                name="slurmjob_region_job_id",
            ),
        ),
        migrations.AddConstraint(
            model_name="slurmjob",
            constraint=models.UniqueConstraint(
                condition=models.Q(("array_task_id__isnull", False)),
                fields=("region", "job_id", "array_task_id"),
                name="slurmjob_region_job_task",
            ),
        ),
    ]
