"""Celery beat's schedule in the database (django-celery-beat), declared in settings.

``CELERY_BEAT_SCHEDULE`` declares every periodic entry. At each start beat syncs the declarations
into ``PeriodicTask`` rows (:func:`beat_schedule_sync`), which staff see and change in the admin:

- a missing row is created; a row still as the last sync wrote it follows the declaration;
- a row staff changed (schedule, arguments, enabled...) is kept as they left it: each synced row's
  description carries a fingerprint of what was written, and a row that no longer matches its
  fingerprint was edited by hand;
- a synced row whose declaration is gone is disabled.

Each row keeps ``last_run_at`` across restarts, so an entry whose time passed while beat was down
is due at once when it comes back (catch-up): the monthly invoice run missed at 00:05 on the 1st
runs when beat restarts at 03:00. :class:`Scheduler` loads every enabled row; the stock scheduler
leaves out crontab entries whose hour is more than two hours from now, which would lose that run.
"""

from __future__ import annotations

import hashlib
import logging
from numbers import Number

from django.conf import settings
from django.db import transaction
from django_celery_beat.models import PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler, ModelEntry

logger = logging.getLogger(__name__)
MARK = "gpupool-settings"


def _fingerprint(row: PeriodicTask) -> str:
    parts = [
        row.task,
        str(row.interval or ""),
        str(row.crontab or ""),
        str(row.crontab.timezone if row.crontab else ""),
        row.args or "",
        row.kwargs or "",
        str(row.queue or ""),
        str(row.expire_seconds or ""),
        str(row.enabled),
        str(row.one_off),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _stamp(row: PeriodicTask) -> str:
    return (
        f"{MARK} {_fingerprint(row)}: declared in CELERY_BEAT_SCHEDULE. A change made here is kept "
        "across restarts (the declaration no longer applies to this entry)."
    )


def _fields(entry: dict) -> dict:
    """A settings entry as django-celery-beat's model entry takes it: ``options.expires`` (seconds)
    becomes the row's ``expire_seconds``."""
    fields = dict(entry)
    options = dict(fields.get("options") or {})
    expires = options.pop("expires", None)
    if isinstance(expires, Number):
        options["expire_seconds"] = int(expires)
    fields["options"] = options
    return fields


def beat_schedule_sync(*, app=None, schedule: dict | None = None) -> dict[str, str]:
    """Bring the rows in line with the declarations; returns what happened to each entry:
    ``created``, ``updated``, ``kept`` (edited by staff) or ``disabled`` (declaration gone)."""
    schedule = settings.CELERY_BEAT_SCHEDULE if schedule is None else schedule
    done: dict[str, str] = {}
    with transaction.atomic():
        for name, entry in schedule.items():
            row = PeriodicTask.objects.filter(name=name).first()
            if row is not None and row.description and row.description != _stamp(row):
                done[name] = "kept"
                continue
            row_was = row
            ModelEntry.from_entry(name, app=app, **_fields(entry))
            row = PeriodicTask.objects.get(name=name)
            row.description = _stamp(row)
            row.save(update_fields=["description"])
            done[name] = "created" if row_was is None else "updated"
        for row in PeriodicTask.objects.filter(description__startswith=MARK, enabled=True).exclude(
            name__in=list(schedule)
        ):
            if row.description == _stamp(row):
                row.enabled = False
                row.save()
                row.description = _stamp(row)
                row.save(update_fields=["description"])
                done[row.name] = "disabled"
    kept = sorted(n for n, what in done.items() if what == "kept")
    if kept:
        logger.info("beat entries changed in the admin, kept as they are: %s", ", ".join(kept))
    return done


class Scheduler(DatabaseScheduler):
    """django-celery-beat's database scheduler, with the schedule synced from settings at start
    (instead of overwriting the rows with the settings) and every enabled row loaded."""

    def setup_schedule(self):
        beat_schedule_sync(app=self.app)

    def enabled_models(self):
        return list(self.Model.objects.enabled())
