import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    """Staff re-key tokens (a bootstrap token bound to one node), and fleet alerts with a subject so
    that each hostname claiming another node's GPUs has an open alert of its own."""

    dependencies = [
        ("nodes", "0006_node_heartbeat_updates_in_place"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="fleetalert",
            name="fleetalert_one_open_per_kind",
        ),
        migrations.AddField(
            model_name="fleetalert",
            name="subject",
            field=models.CharField(blank=True, max_length=253),
        ),
        migrations.AddField(
            model_name="nodebootstraptoken",
            name="rekey_node",
            field=models.ForeignKey(
                blank=True,
                help_text="A re-key token: it registers this node's hostname only, and replaces its credential.",
                null=True,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="+",
                to="nodes.node",
            ),
        ),
        migrations.AlterField(
            model_name="fleetalert",
            name="kind",
            field=models.CharField(
                choices=[
                    ("mass_silence", "A large share of the fleet went silent"),
                    ("gpu_uuid_conflict", "A registration claimed another node's GPUs"),
                ],
                max_length=32,
            ),
        ),
        migrations.AddConstraint(
            model_name="fleetalert",
            constraint=models.UniqueConstraint(
                condition=models.Q(("resolved_at__isnull", True)),
                fields=("kind", "subject"),
                name="fleetalert_one_open_per_subject",
            ),
        ),
    ]
