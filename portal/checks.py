from django.conf import settings
from django.core.checks import Error, Tags, register


@register(Tags.security, deploy=True)
def secret_key_not_dev_default(app_configs, **kwargs):
    from portal.settings import _DEV_SECRET_KEY

    if settings.SECRET_KEY == _DEV_SECRET_KEY:
        return [Error("SECRET_KEY is the development default.", hint="Set SECRET_KEY.", id="gpupool.E001")]
    return []
