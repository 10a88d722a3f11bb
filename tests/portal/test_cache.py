"""The cache as settings.py configures it: django-redis on REDIS_URL, with one connection pool per
process however many cache objects Django makes (one per thread, one per request's context)."""

from __future__ import annotations

import json

from tests.conftest import python_run

SETTINGS_ENV = {
    "DJANGO_SETTINGS_MODULE": "portal.settings",
    "DEBUG": "0",
    "SECRET_KEY": "x" * 50,
    "CACHE_KEY_PREFIX": None,
}

TWO_THREADS = """
import json, os, threading
import django, redis
django.setup()
from django.core.cache import caches
from django_redis import get_redis_connection
from django_redis.cache import RedisCache

server = redis.Redis.from_url(os.environ["REDIS_URL"])
before = server.info("stats")["total_connections_received"]
backends, pools = [], []

def operate(n):
    cache = caches["default"]
    cache.set("k", n)
    assert cache.get("k") == n
    backends.append(cache)
    pools.append(get_redis_connection("default").connection_pool)

for n in (1, 2):
    thread = threading.Thread(target=operate, args=(n,))
    thread.start()
    thread.join()
print(json.dumps({
    "django_redis": [isinstance(b, RedisCache) for b in backends],
    "one_backend": backends[0] is backends[1],
    "one_pool": pools[0] is pools[1],
    "new_connections": server.info("stats")["total_connections_received"] - before,
    "keys": sorted(k.decode() for k in server.keys("*")),
}))
"""


def test_with_redis_url_the_cache_is_django_redis_with_one_pool_per_process(private_redis):
    url = private_redis[0]
    done = python_run(TWO_THREADS, **SETTINGS_ENV, REDIS_URL=url)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["django_redis"] == [True, True]
    assert not seen["one_backend"]  # Django's cache objects: one per thread
    assert seen["one_pool"]  # django-redis's connection pool: one per process
    assert seen["new_connections"] == 1  # the second thread's operations reused the first's connection
    assert seen["keys"] == ["gpupool:1:k"]  # KEY_PREFIX kept


def test_without_redis_url_the_cache_is_local_memory():
    code = "import django; django.setup(); from django.core.cache import caches; print(type(caches['default']).__name__)"
    done = python_run(code, **SETTINGS_ENV, REDIS_URL=None)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "LocMemCache"
