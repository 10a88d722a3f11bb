"""A tenant's month of usage in id order (the API's cursor pages over the month walked a
whole table's id index backwards for a tenant whose records came first)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("metering", "0005_budgets_cost_to_date_platform_cost"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="usagerecord",
            name="usage_tenant_period",
        ),
        migrations.AddIndex(
            model_name="usagerecord",
            index=models.Index(fields=["tenant", "period_start", "id"], name="usage_tenant_period_id"),
        ),
    ]
