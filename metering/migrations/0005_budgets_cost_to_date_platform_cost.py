"""Budgets: cost to date per tenant, alerts once per month and threshold; warm-pool time as the
platform's cost; fewer indexes on usage records (the monthly run rewrites their invoice)."""

import django.core.validators
import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models

import metering.models


class Migration(migrations.Migration):
    dependencies = [
        ("metering", "0004_payments_dunning_stripe_events"),
        ("nodes", "0001_fleet"),
        ("portal", "0001_tenancy"),
        ("scheduling", "0003_warm_slots"),
    ]

    operations = [
        migrations.AlterField(
            model_name="budget",
            name="alert_thresholds",
            field=models.JSONField(
                blank=True,
                default=metering.models.default_alert_thresholds,
                help_text="Percent, e.g. [50, 80, 100].",
            ),
        ),
        migrations.AlterField(
            model_name="usagerecord",
            name="allocation",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="scheduling.allocation",
            ),
        ),
        migrations.AlterField(
            model_name="usagerecord",
            name="gpu_model",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="nodes.gpumodel",
            ),
        ),
        migrations.AlterField(
            model_name="usagerecord",
            name="invoice",
            field=models.ForeignKey(
                blank=True,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="usage_records",
                to="metering.invoice",
            ),
        ),
        migrations.AlterField(
            model_name="usagerecord",
            name="region",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="nodes.region",
            ),
        ),
        migrations.AlterField(
            model_name="usagerecord",
            name="tenant",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="+",
                to="portal.tenant",
            ),
        ),
        migrations.AlterField(
            model_name="usagerecord",
            name="version",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="metering.ratecardversion",
            ),
        ),
        migrations.CreateModel(
            name="CostToDate",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("period_start", models.DateField(help_text="The month the amount is for.")),
                ("amount", models.DecimalField(decimal_places=10, default=0, max_digits=22)),
                ("currency", models.CharField(default="USD", max_length=3)),
                ("as_of", models.DateTimeField()),
                (
                    "tenant",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="cost_to_date",
                        to="portal.tenant",
                    ),
                ),
            ],
            options={
                "ordering": ["tenant_id"],
            },
        ),
        migrations.CreateModel(
            name="BudgetAlert",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("period_start", models.DateField()),
                ("threshold", models.PositiveSmallIntegerField(help_text="Percent of the monthly limit.")),
                (
                    "amount",
                    models.DecimalField(
                        decimal_places=3, help_text="Cost to date when it fired.", max_digits=18
                    ),
                ),
                ("monthly_limit", models.DecimalField(decimal_places=3, max_digits=18)),
                ("currency", models.CharField(default="USD", max_length=3)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "tenant",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="+", to="portal.tenant"
                    ),
                ),
            ],
            options={
                "ordering": ["-period_start", "threshold"],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("tenant", "period_start", "threshold"), name="budgetalert_once_per_month"
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="PlatformCost",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "kind",
                    models.CharField(
                        choices=[("warm_pool", "Warm pool")], default="warm_pool", max_length=16
                    ),
                ),
                ("period_start", models.DateField()),
                ("start", models.DateTimeField()),
                ("end", models.DateTimeField()),
                ("gpu_seconds", models.DecimalField(decimal_places=9, max_digits=24)),
                (
                    "unit_price",
                    models.DecimalField(
                        blank=True,
                        decimal_places=10,
                        help_text="On-demand per GPU-hour; empty: no price.",
                        max_digits=22,
                        null=True,
                        validators=[django.core.validators.MinValueValidator(0)],
                    ),
                ),
                ("amount", models.DecimalField(decimal_places=10, default=0, max_digits=22)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "bound_to",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to="scheduling.workload",
                    ),
                ),
                (
                    "gpu_model",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name="+", to="nodes.gpumodel"
                    ),
                ),
                (
                    "region",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name="+", to="nodes.region"
                    ),
                ),
                (
                    "slot",
                    models.ForeignKey(
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to="scheduling.warmslot",
                    ),
                ),
            ],
            options={
                "ordering": ["start", "id"],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("slot", "period_start"), name="platformcost_once_per_slot_month"
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("end__gt", models.F("start"))),
                        name="platformcost_end_after_start",
                    ),
                ],
            },
        ),
    ]
