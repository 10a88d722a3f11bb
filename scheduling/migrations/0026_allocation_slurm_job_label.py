from django.db import migrations, models


def label_running_slurm_allocations(apps, schema_editor):
    """The allocations of Slurm jobs not accounted yet (their current attempt's: made since the
    workload was last queued) take their Slurm job's label, so sacct's end finds them and adds
    no second set. Their start is the RUNNING event they were made at, as billed until now."""
    SlurmJob = apps.get_model("scheduling", "SlurmJob")
    Allocation = apps.get_model("scheduling", "Allocation")
    for sj in SlurmJob.objects.filter(accounted_at__isnull=True).select_related("workload"):
        label = str(sj.job_id) if sj.array_task_id is None else f"{sj.job_id}_{sj.array_task_id}"
        rows = Allocation.objects.filter(workload_id=sj.workload_id, slurm_job_label="")
        if sj.workload.queued_at is not None:
            rows = rows.filter(started_at__gte=sj.workload.queued_at)
        rows.update(slurm_job_label=label)


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0025_gang_addresses"),
    ]

    operations = [
        migrations.AddField(
            model_name="allocation",
            name="slurm_job_label",
            field=models.CharField(blank=True, max_length=32),
        ),
        migrations.RunPython(label_running_slurm_allocations, migrations.RunPython.noop),
    ]
