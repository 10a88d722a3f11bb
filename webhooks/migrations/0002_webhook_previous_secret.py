from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("webhooks", "0001_webhooks")]

    operations = [
        migrations.AddField(
            model_name="webhookendpoint",
            name="previous_secret_ciphertext",
            field=models.TextField(blank=True, default=""),
        ),
        migrations.AddField(
            model_name="webhookendpoint",
            name="previous_secret_expires_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
