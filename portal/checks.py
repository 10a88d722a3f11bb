from django.conf import settings
from django.core.checks import Error, Tags, register


@register(Tags.security, deploy=True)
def secret_key_not_dev_default(app_configs, **kwargs):
    from portal.settings import _DEV_SECRET_KEY

    if settings.SECRET_KEY == _DEV_SECRET_KEY:
        return [Error("SECRET_KEY is the development default.", hint="Set SECRET_KEY.", id="gpupool.E001")]
    return []


@register(Tags.security, deploy=True)
def secrets_encryption_keys_set(app_configs, **kwargs):
    if not [k for k in settings.SECRETS_ENCRYPTION_KEYS if k.strip()]:
        return [
            Error(
                "SECRETS_ENCRYPTION_KEYS is not set: tenant secrets would use a key derived from SECRET_KEY.",
                hint="Set SECRETS_ENCRYPTION_KEYS to one or more Fernet keys (deploy/.env.example).",
                id="gpupool.E002",
            )
        ]
    return []
