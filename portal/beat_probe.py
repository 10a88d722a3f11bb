"""Beat's liveness probe: ``python -m portal.beat_probe [max age s]`` exits 0 when beat wrote some
entry's ``last_run_at`` to the database within the max age (default 600 s). Beat saves the entries
it sent at least every 3 minutes, and several run every few seconds, so a live beat always has one."""

from __future__ import annotations

import os
import sys
from datetime import timedelta


def main(argv: list[str]) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from django.utils import timezone
    from django_celery_beat.models import PeriodicTask

    max_age = int(argv[0]) if argv else 600
    since = timezone.now() - timedelta(seconds=max_age)
    return 0 if PeriodicTask.objects.filter(enabled=True, last_run_at__gte=since).exists() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
