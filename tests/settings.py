"""Settings for the test suite: the development defaults plus fast hashing.

DATABASE_URL and REDIS_URL come from the environment (``.ci/run`` points them at the real
PostgreSQL and Redis); unset, the suite runs on SQLite and the filesystem broker.
"""

import os

os.environ.setdefault("DEBUG", "1")

from portal.settings import *  # noqa: F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# Several people (or agents) may share one PostgreSQL server: each can pick its own test database.
if os.environ.get("TEST_DB_NAME"):
    DATABASES["default"]["TEST"] = {"NAME": os.environ["TEST_DB_NAME"]}  # noqa: F405

# Threads (Channels' database_sync_to_async, live servers) must not keep connections open past
# their work, or they leak into later tests.
DATABASES["default"]["CONN_MAX_AGE"] = 0  # noqa: F405

# Each test starts from an empty cache (conftest.cache_empty). With REDIS_URL it is the deployment's
# django-redis cache, whose client also wakes long polls and reads queue lengths; without, memory.
if not REDIS_URL:  # noqa: F405
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "tests"}}
# Tests read /api/v1/gpu-types/ right after changing the fleet; the cached answer has a test of its own.
SCHEDULING_GPU_TYPES_CACHE_S = 0
# Likewise the fleet's node shapes a submission is checked against (scheduling.services.submission).
SCHEDULING_FLEET_SHAPES_CACHE_S = 0
# pytest-django runs with DEBUG off, where tenant secrets need a key of their own (portal.crypto).
SECRETS_ENCRYPTION_KEYS = ["dGVzdC1vbmx5LWtleS1mb3ItdGVuYW50LXNlY3JldHM="]
