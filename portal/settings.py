"""gpupool settings: one module, driven by environment variables.

Every setting an operator may change is read here from the environment (django-environ); the
defaults are the embedded ones that `make run` uses (SQLite under var/, no Redis server, an
in-memory channel layer). Production sets DATABASE_URL, REDIS_URL, SECRET_KEY, ALLOWED_HOSTS and
DEBUG=0; `python manage.py check --deploy` is then clean.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import environ
from celery.schedules import crontab
from django.core.exceptions import ImproperlyConfigured
from kombu import Queue

from portal.logging import logging_config
from portal.sentry import sentry_init

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

VAR_DIR = Path(env.str("GPUPOOL_VAR_DIR", default=str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = env.bool("DEBUG", default=False)

_DEV_SECRET_KEY = "dev-only-insecure-secret-key-never-use-in-production"
SECRET_KEY = env.str("SECRET_KEY", default="")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off.")
    SECRET_KEY = _DEV_SECRET_KEY

ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])
SITE_URL = env.str("SITE_URL", default="http://localhost:8000")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_htmx",
    "csp",  # Content-Security-Policy header (CONTENT_SECURITY_POLICY below)
    "channels",
    "django_celery_beat",  # beat's schedule in the database (portal/beat.py), edited in the admin
    "portal",
    "nodes",
    "scheduling",
    "metering",
    "webhooks",
]

MIDDLEWARE = [
    # Request ids for logs (X-Request-ID in and out); first, so that every request has one.
    "portal.middleware.RequestIdMiddleware",
    # Health probes and /metrics answer before host validation (probes come by IP address).
    "portal.middleware.ProbeMiddleware",
    "portal.middleware.ApiErrorMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "csp.middleware.CSPMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "portal.middleware.StaffIdleTimeoutMiddleware",
    "portal.middleware.SignInLimitMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "portal.middleware.TenantMiddleware",
    "portal.middleware.UserTimezoneMiddleware",
]

ROOT_URLCONF = "portal.urls"
WSGI_APPLICATION = "portal.wsgi.application"
ASGI_APPLICATION = "portal.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "portal.context_processors.tenancy",
            ],
        },
    },
]

# --- Database -----------------------------------------------------------------------------------
# Default: a SQLite file under var/ in WAL mode with a busy timeout, so that the web server, the
# Celery worker, beat and the simulated agents can share it on one laptop.
DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'gpupool.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "timeout": 20,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=20000;",
        }
    )
else:
    # Django's PostgreSQL backend, reading timestamptz in C (portal/postgresql/base.py says until when).
    DATABASES["default"]["ENGINE"] = "portal.postgresql"
    DATABASES["default"]["CONN_MAX_AGE"] = env.int("DB_CONN_MAX_AGE", default=60)
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
    # The name each connection gives PostgreSQL (pg_stat_activity, the server's log with %a): which
    # part of the deployment a query, a lock or a backend's CPU belongs to. compose.yaml and the
    # Kubernetes manifests name each service (gpupool-web, gpupool-agent-web, gpupool-worker-...);
    # an application_name in DATABASE_URL's query string wins.
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault(
        "application_name", env.str("DB_APPLICATION_NAME", default="gpupool")
    )
    # Queries bind their parameters on the server and each is prepared on a connection after 5 uses,
    # so PostgreSQL plans it once per connection (docs/performance.md). Off: client-side binding,
    # nothing prepared (for a PgBouncer in transaction mode older than 1.21).
    if env.bool("DB_PREPARED_STATEMENTS", default=True):
        DATABASES["default"].setdefault("OPTIONS", {}).update(server_side_binding=True, prepare_threshold=5)
    # A connection pool per process (psycopg_pool), shared by the WEB_THREADS threads and the
    # agent protocol's worker threads (and a Celery worker's threads): requests wait (up to 10 s)
    # for one of DB_POOL_MAX_SIZE connections. 0: no pool (a persistent connection per thread,
    # DB_CONN_MAX_AGE).
    DB_POOL_MAX_SIZE = env.int("DB_POOL_MAX_SIZE", default=0)
    if DB_POOL_MAX_SIZE:
        DATABASES["default"]["CONN_MAX_AGE"] = 0  # the pool keeps them
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            "min_size": 1,
            "max_size": DB_POOL_MAX_SIZE,
            "timeout": 10,
        }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Threads per web process that serve pages and the API (portal/asgi.py), each may hold a database
# connection; they share one GIL. Why 8: docs/performance.md.
WEB_THREADS = env.int("WEB_THREADS", default=8)
# How long (ms) a thread of the web and agent-web processes may hold the GIL while another waits for
# it (Python's default: 5), applied by portal/asgi.py. Why 1: docs/performance.md.
WEB_GIL_SWITCH_INTERVAL_MS = env.float("WEB_GIL_SWITCH_INTERVAL_MS", default=1.0)
if not 0 < WEB_GIL_SWITCH_INTERVAL_MS <= 1000:
    raise ImproperlyConfigured(
        f"WEB_GIL_SWITCH_INTERVAL_MS: more than 0 and at most 1000, not {WEB_GIL_SWITCH_INTERVAL_MS}"
    )
# portal/asgi.py: ASGI apps that claim requests before the pages' thread pool and Channels, tried in
# this order (each built with the default app as its fallback). Named, not imported, as MIDDLEWARE's
# classes are. The proxy first: on PROXY_ORIGIN's host it claims every request.
ASGI_ROUTES = [
    "scheduling.proxy.WorkloadProxy",  # /proxy/<workload>/<port>/, HTTP and websockets
    "nodes.agent_views.AgentProtocolHandler",  # /agent/
    "scheduling.log_follow.LogFollow",  # GET /api/v1/{jobs|instances}/<id>/logs/?follow=1
]
# The origin workloads' apps are served on, e.g. https://apps.gpupool.example (a host of its own,
# never a subdomain sharing the portal's cookies): an app's scripts then cannot act on the portal
# with its visitor's session. Empty: under the portal's own origin (development and tests only; see
# docs/security.md). Members' browsers reach it through a one-minute signed ticket.
PROXY_ORIGIN = env.str("PROXY_ORIGIN", default="").rstrip("/")
PROXY_MEMBER_COOKIE_MAX_AGE_S = env.int("PROXY_MEMBER_COOKIE_MAX_AGE_S", default=12 * 3600)
PROXY_CONNECT_TIMEOUT_S = env.float("PROXY_CONNECT_TIMEOUT_S", default=5.0)
# The longest wait for the next bytes either way (an HTTP request); websockets are pinged instead.
PROXY_IDLE_TIMEOUT_S = env.float("PROXY_IDLE_TIMEOUT_S", default=300.0)
PROXY_MAX_BODY_BYTES = env.int("PROXY_MAX_BODY_BYTES", default=100 * 1024 * 1024)
PROXY_MAX_WS_MESSAGE_BYTES = env.int("PROXY_MAX_WS_MESSAGE_BYTES", default=16 * 1024 * 1024)
# Open requests and websockets per workload, per web process; more get 503.
PROXY_MAX_CONNECTIONS_PER_WORKLOAD = env.int("PROXY_MAX_CONNECTIONS_PER_WORKLOAD", default=64)

# --- Redis: Celery broker, cache, channel layer -------------------------------------------------
REDIS_URL = env.str("REDIS_URL", default="")

# Task time limits (seconds, hard; the soft limit comes a minute before, or a quarter of the limit
# when that is shorter). Most tasks take the default; the two that walk every tenant (the invoice
# run, the payments sweep) take the long one (its margin over bench/invoices.py is in
# docs/performance.md). Enforced by the prefork pool; thread-pool workers run only short,
# single-flight tasks.
GPUPOOL_TASK_TIME_LIMIT_S = env.int("GPUPOOL_TASK_TIME_LIMIT_S", default=300)
GPUPOOL_LONG_TASK_TIME_LIMIT_S = env.int("GPUPOOL_LONG_TASK_TIME_LIMIT_S", default=900)
if min(GPUPOOL_TASK_TIME_LIMIT_S, GPUPOOL_LONG_TASK_TIME_LIMIT_S) < 4:
    raise ImproperlyConfigured("GPUPOOL_TASK_TIME_LIMIT_S and GPUPOOL_LONG_TASK_TIME_LIMIT_S: at least 4 s.")
GPUPOOL_TASK_SOFT_TIME_LIMIT_S = GPUPOOL_TASK_TIME_LIMIT_S - min(60, GPUPOOL_TASK_TIME_LIMIT_S // 4)
GPUPOOL_LONG_TASK_SOFT_TIME_LIMIT_S = GPUPOOL_LONG_TASK_TIME_LIMIT_S - min(
    60, GPUPOOL_LONG_TASK_TIME_LIMIT_S // 4
)
# The longest countdown a task is sent with (a webhook delivery's retry; longer waits are left to
# the webhooks sweeper).
GPUPOOL_TASK_LONGEST_COUNTDOWN_S = env.int("GPUPOOL_TASK_LONGEST_COUNTDOWN_S", default=300)
# The longest a task may be held by a worker before it acknowledges it: its countdown, then its
# run. tests/portal/test_beat.py holds the tasks to it.
GPUPOOL_TASK_LONGEST_RUN_S = (
    max(GPUPOOL_TASK_TIME_LIMIT_S, GPUPOOL_LONG_TASK_TIME_LIMIT_S) + GPUPOOL_TASK_LONGEST_COUNTDOWN_S
)
# Redis hands a message that was delivered and not acknowledged (acks late: a worker killed with
# it) to another worker after this long. It must outlast the longest hold, or a task still running
# would be started a second time; and it is how long a killed worker's task waits to run again, so
# it is not much longer (docs/reliability.md).
CELERY_VISIBILITY_TIMEOUT_S = env.int("CELERY_VISIBILITY_TIMEOUT_S", default=GPUPOOL_TASK_LONGEST_RUN_S + 60)
if CELERY_VISIBILITY_TIMEOUT_S <= GPUPOOL_TASK_LONGEST_RUN_S:
    raise ImproperlyConfigured(
        f"CELERY_VISIBILITY_TIMEOUT_S must be more than the longest time a worker holds a task "
        f"({GPUPOOL_TASK_LONGEST_RUN_S} s), not {CELERY_VISIBILITY_TIMEOUT_S}."
    )

CELERY_BROKER_KEY_PREFIX = env.str("CELERY_BROKER_KEY_PREFIX", default="")

if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    CELERY_RESULT_BACKEND = None
    # A killed worker's messages come back once the visibility timeout has passed: the workers look
    # for such messages every unacked_restore_interval seconds (kombu's default looks every 100 s:
    # every 10th of its 10 s sweeps), one sorted-set range read on Redis.
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "visibility_timeout": CELERY_VISIBILITY_TIMEOUT_S,
        "unacked_restore_interval": max(1, min(10, CELERY_VISIBILITY_TIMEOUT_S // 6)),
        "unacked_restore_throttle": 1,
        # Every broker key (queues, unacked set, bindings) under this prefix: deployments (or
        # test stacks) that share one Redis database never take each other's tasks.
        "global_keyprefix": CELERY_BROKER_KEY_PREFIX,
    }
    CACHES = {
        "default": {
            # django-redis keeps one connection pool per process; get_redis_connection("default")
            # gives its raw client to the code that needs one (wake-ups, queue lengths).
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": env.str("CACHE_KEY_PREFIX", default="gpupool"),
            # A request waits at most this long on Redis, then fails instead of holding its thread.
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 2},
        }
    }
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                # redis-py 8 reads with a 5 s timeout by default, and channels_redis waits for
                # messages with a blocking read about that long: idle websockets would drop every
                # few seconds (channels_redis#422). No read timeout; a bounded connect timeout.
                "hosts": [{"address": REDIS_URL, "socket_timeout": None, "socket_connect_timeout": 5}],
                "prefix": env.str("CHANNELS_PREFIX", default="gpupool"),
            },
        }
    }
else:
    # No Redis server: kombu's filesystem transport needs nothing but a directory, which web,
    # worker and beat share. The cache is per process, which is enough for one web process.
    _broker_dir = VAR_DIR / "broker"
    for _sub in ("queue", "processed"):
        (_broker_dir / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "processed_folder": str(_broker_dir / "processed"),
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
    }
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
            "LOCATION": "gpupool",
        }
    }
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

CELERY_TASK_ALWAYS_EAGER = env.bool("CELERY_TASK_ALWAYS_EAGER", default=False)
# A task is acknowledged when it ends, so a worker that dies mid-task leaves it to run again (tasks
# are safe to run twice). "Worker lost" (the child process died: OOM kill, segfault) exists only in
# the prefork pool, which the metering worker runs (deploy/): there the task is requeued, not failed.
# Thread-pool workers have no child to lose; a dead worker's unacknowledged tasks come back after
# the broker's visibility timeout instead.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# Time limits for every task (GPUPOOL_TASK_TIME_LIMIT_S above); the long ones set their own.
CELERY_TASK_SOFT_TIME_LIMIT = GPUPOOL_TASK_SOFT_TIME_LIMIT_S
CELERY_TASK_TIME_LIMIT = GPUPOOL_TASK_TIME_LIMIT_S
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = "UTC"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = "default"
# One queue per kind of work, so each can get its own workers (deploy/compose.yaml, deploy/k8s).
# A worker started without -Q consumes them all (make run).
CELERY_TASK_QUEUES = tuple(Queue(name) for name in ("default", "scheduling", "commands", "metering"))
CELERY_TASK_ROUTES = {
    "scheduling.tasks.*": {"queue": "scheduling"},
    # A read model for the API, kept off the queue whose worker runs the cycles.
    "scheduling.tasks.refresh_gpu_types": {"queue": "default"},
    "nodes.tasks.expire_commands": {"queue": "commands"},
    "nodes.tasks.reconcile_node_health": {"queue": "commands"},
    "nodes.tasks.advance_rollouts": {"queue": "commands"},
    "nodes.tasks.send_drained_mig": {"queue": "commands"},
    "metering.tasks.*": {"queue": "metering"},
}
# Periodic work is declared here and nowhere else. Apps add their entries below as they grow.
# Beat keeps the schedule in the database (django-celery-beat; portal/beat.py syncs these entries in
# at each start, and staff see and change them in the admin), so a restarted beat knows when each
# entry last ran and runs once what it missed while it was down. Work at a fixed time of day or
# month is a crontab, in UTC (CELERY_TIMEZONE); only work every few seconds or minutes is an interval.
CELERY_BEAT_SCHEDULER = "portal.beat:Scheduler"
CELERY_BEAT_SCHEDULE: dict[str, dict] = {
    "portal-purge-expired-invitations": {
        "task": "portal.tasks.purge_expired_invitations",
        "schedule": crontab(minute=7),
    },
    "portal-purge-expired-idempotency-keys": {
        "task": "portal.tasks.purge_expired_idempotency_keys",
        "schedule": timedelta(hours=1),
    },
}

# --- Auth -----------------------------------------------------------------------------------------
AUTH_USER_MODEL = "portal.User"
# Django's model backend behind the sign-in attempt limiter (portal/signin.py).
AUTHENTICATION_BACKENDS = ["portal.signin.LimitedModelBackend"]
LOGIN_URL = "portal:login"
LOGIN_REDIRECT_URL = "portal:dashboard"
LOGOUT_REDIRECT_URL = "portal:login"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
PASSWORD_HASHERS = env.list(
    "PASSWORD_HASHERS",
    default=[
        "django.contrib.auth.hashers.PBKDF2PasswordHasher",
        "django.contrib.auth.hashers.PBKDF2SHA1PasswordHasher",
    ],
)

# --- Email ------------------------------------------------------------------------------------------
EMAIL_CONFIG = env.email_url("EMAIL_URL", default="consolemail://")
vars().update(EMAIL_CONFIG)
DEFAULT_FROM_EMAIL = env.str("DEFAULT_FROM_EMAIL", default="gpupool <noreply@gpupool.localhost>")
SERVER_EMAIL = DEFAULT_FROM_EMAIL

# --- Internationalisation -------------------------------------------------------------------------
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# --- Static files -------------------------------------------------------------------------------
STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # collectstatic fills it; whitenoise wants it to exist
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": (
            "whitenoise.storage.CompressedManifestStaticFilesStorage"
            if not DEBUG
            else "django.contrib.staticfiles.storage.StaticFilesStorage"
        )
    },
}

# --- Security (production values when DEBUG is off) -----------------------------------------------
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=not DEBUG)
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
SESSION_COOKIE_SECURE = env.bool("SESSION_COOKIE_SECURE", default=not DEBUG)
CSRF_COOKIE_SECURE = env.bool("CSRF_COOKIE_SECURE", default=not DEBUG)
SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=0 if DEBUG else 31536000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = not DEBUG
# Asking browsers' preload lists to pin HTTPS for the domain and its subdomains is hard to undo:
# only when the operator asks for it.
SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=False)
# check --deploy warns while preload is off (W021): off is this setting's deliberate default.
SILENCED_SYSTEM_CHECKS = [] if SECURE_HSTS_PRELOAD else ["security.W021"]
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_HTTPONLY = True
# Content-Security-Policy on every response past the probes and the agent protocol's handler: only
# our own scripts, styles and connections (the live events' ws/wss are same-origin: 'self' covers
# them in CSP3 browsers), no inline script or style, no plugins, no framing. The API docs add what Swagger
# UI needs on their own view (portal/urls.py). docs/security.md has the policy's reasons.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'"],
        "img-src": ["'self'"],
        "font-src": ["'self'"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    },
}
DATA_UPLOAD_MAX_MEMORY_SIZE = env.int("DATA_UPLOAD_MAX_MEMORY_SIZE", default=2 * 1024 * 1024)

# --- REST framework ---------------------------------------------------------------------------------
API_RATE_LIMIT = env.str("API_RATE_LIMIT", default="600/min")
# Bearer token Prometheus must send for /metrics; unset, /metrics is open only with METRICS_PUBLIC
# (default: DEBUG) and refused otherwise.
METRICS_TOKEN = env.str("METRICS_TOKEN", default="")
METRICS_PUBLIC = env.bool("METRICS_PUBLIC", default=DEBUG)
# Per-GPU gauges (DCGM names, ~6 series per GPU) on /metrics besides the per-model/region aggregates
# that are always there. Default: on with DEBUG, off in production (large fleets).
METRICS_PER_GPU = env.bool("METRICS_PER_GPU", default=DEBUG)
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "portal.api.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["portal.api.permissions.TenantScopePermission"],
    "DEFAULT_PAGINATION_CLASS": "portal.api.pagination.CursorPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": ["portal.api.filters.FilterBackend"],
    "DEFAULT_PARSER_CLASSES": [
        "portal.api.parsers.JSONParser",  # orjson, nesting at most 1,024 levels deep
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_THROTTLE_CLASSES": ["portal.api.throttling.TokenRateThrottle"],
    "DEFAULT_THROTTLE_RATES": {"token": API_RATE_LIMIT},
    "EXCEPTION_HANDLER": "portal.api.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "portal.api.schema.AutoSchema",
    "DEFAULT_RENDERER_CLASSES": ["portal.api.renderers.JSONRenderer"]
    + (["rest_framework.renderers.BrowsableAPIRenderer"] if DEBUG else []),
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "gpupool API",
    "DESCRIPTION": "Ask for GPU instances and batch jobs, watch them, and see what they cost.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # Served from our own static files, never a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # The enum hook is drf-spectacular's default; ours links creates to their objects' operations.
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "portal.api.schema.add_create_links",
    ],
}

# --- Stripe -------------------------------------------------------------------------------------------
STRIPE_SECRET_KEY = env.str("STRIPE_SECRET_KEY", default="")
STRIPE_PUBLISHABLE_KEY = env.str("STRIPE_PUBLISHABLE_KEY", default="")
STRIPE_WEBHOOK_SECRET = env.str("STRIPE_WEBHOOK_SECRET", default="")
STRIPE_API_BASE = env.str("STRIPE_API_BASE", default="")

# --- gpupool ------------------------------------------------------------------------------------------
GPUPOOL_INVITATION_TTL = timedelta(days=env.int("GPUPOOL_INVITATION_TTL_DAYS", default=7))
# How long the API remembers a create's Idempotency-Key (portal/services/idempotency.py).
IDEMPOTENCY_KEY_TTL = timedelta(hours=env.int("IDEMPOTENCY_KEY_TTL_HOURS", default=24))
GPUPOOL_TOKEN_LAST_USED_RESOLUTION = timedelta(seconds=60)
GPUPOOL_LOGIN_FAILURE_LIMIT = env.int("GPUPOOL_LOGIN_FAILURE_LIMIT", default=10)
GPUPOOL_LOGIN_FAILURE_WINDOW_S = env.int("GPUPOOL_LOGIN_FAILURE_WINDOW_S", default=900)
GPUPOOL_PASSWORD_RESET_LIMIT = env.int("GPUPOOL_PASSWORD_RESET_LIMIT", default=5)
# Sign-in attempts per client address in the same window (successes count too: an address shared
# by an office must still sign its people in; an attacker spraying many accounts is slowed).
GPUPOOL_LOGIN_ADDRESS_LIMIT = env.int("GPUPOOL_LOGIN_ADDRESS_LIMIT", default=100)
# A staff person's session ends after this many seconds without a request (0: never).
STAFF_SESSION_IDLE_S = env.int("STAFF_SESSION_IDLE_S", default=1800)
# Proxies (addresses or CIDRs) whose X-Forwarded-For names the client; nobody else's is believed.
TRUSTED_PROXIES = env.list("TRUSTED_PROXIES", default=[])
# Where the rate limits count (portal.ratelimit): Redis when there is one, else per process.
RATELIMIT_STORAGE_URI = REDIS_URL or "memory://"
RATELIMIT_KEY_PREFIX = env.str("RATELIMIT_KEY_PREFIX", default="gpupool-limits")

# Tenant secrets (portal.crypto) are encrypted with these Fernet keys, newest first: the first
# encrypts, any of them decrypts. Rotation: put a new key first, run `manage.py rotate_secrets`,
# then drop the old key (docs/security.md). Unset with DEBUG on: a key derived from SECRET_KEY.
SECRETS_ENCRYPTION_KEYS = env.list("SECRETS_ENCRYPTION_KEYS", default=[])

# --- gpupool: nodes (the fleet) -------------------------------------------------------------------
NODE_HEARTBEAT_INTERVAL_S = env.int("NODE_HEARTBEAT_INTERVAL_S", default=10)
NODE_SUSPECT_AFTER_S = env.int("NODE_SUSPECT_AFTER_S", default=30)
NODE_DOWN_AFTER_S = env.int("NODE_DOWN_AFTER_S", default=120)
# More than this share of the (non-maintenance) fleet silent at once: alert, mark nobody DOWN.
NODE_MASS_SILENCE_FRACTION = env.float("NODE_MASS_SILENCE_FRACTION", default=0.3)
NODE_MASS_SILENCE_MIN_NODES = env.int("NODE_MASS_SILENCE_MIN_NODES", default=5)
NODE_MAX_DOWN_PER_RUN = env.int("NODE_MAX_DOWN_PER_RUN", default=10)
NODE_COMMANDS_MAX_WAIT_S = env.int("NODE_COMMANDS_MAX_WAIT_S", default=30)
NODE_COMMANDS_DEFAULT_WAIT_S = env.int("NODE_COMMANDS_DEFAULT_WAIT_S", default=25)
NODE_COMMANDS_POLL_INTERVAL_S = env.float("NODE_COMMANDS_POLL_INTERVAL_S", default=0.15)
NODE_COMMAND_RETRY_BASE_S = env.int("NODE_COMMAND_RETRY_BASE_S", default=10)
NODE_COMMAND_RETRY_MAX_S = env.int("NODE_COMMAND_RETRY_MAX_S", default=300)
NODE_COMMAND_DEFAULT_TTL_S = env.int("NODE_COMMAND_DEFAULT_TTL_S", default=900)
NODE_COMMAND_DEFAULT_MAX_ATTEMPTS = env.int("NODE_COMMAND_DEFAULT_MAX_ATTEMPTS", default=5)
NODE_HEARTBEAT_MAX_SAMPLES = env.int("NODE_HEARTBEAT_MAX_SAMPLES", default=2000)
NODE_HEARTBEAT_MAX_BYTES = env.int("NODE_HEARTBEAT_MAX_BYTES", default=1024 * 1024)
# Bootstrap tokens expire this many hours after they are made unless "never" is asked explicitly.
NODE_BOOTSTRAP_TOKEN_TTL_H = env.int("NODE_BOOTSTRAP_TOKEN_TTL_H", default=72)
TELEMETRY_RAW_RETENTION_DAYS = env.int("TELEMETRY_RAW_RETENTION_DAYS", default=14)
TELEMETRY_ROLLUP_RETENTION_DAYS = env.int("TELEMETRY_ROLLUP_RETENTION_DAYS", default=400)
FLEET_FILE = Path(env.str("FLEET_FILE", default=str(VAR_DIR / "fleet.json")))
# How often staff pages get a fleet snapshot (heat map, counts) over the events websocket.
FLEET_SNAPSHOT_INTERVAL_S = env.float("FLEET_SNAPSHOT_INTERVAL_S", default=5)
# Rolling upgrades (nodes.services.rollouts): how often campaigns move on, and how long work given
# its final notice at the drain deadline may take to leave a node before the step fails.
ROLLOUT_ADVANCE_INTERVAL_S = env.int("ROLLOUT_ADVANCE_INTERVAL_S", default=10)
ROLLOUT_DRAIN_GRACE_S = env.int("ROLLOUT_DRAIN_GRACE_S", default=600)
# A staff action or a new campaign queues an advance at once (else the beat entry's next run does it).
ROLLOUT_ADVANCE_ON_COMMIT = env.bool("ROLLOUT_ADVANCE_ON_COMMIT", default=True)
CELERY_BEAT_SCHEDULE.update(
    {
        "nodes-publish-fleet-snapshot": {
            "task": "nodes.tasks.publish_fleet_snapshot",
            "schedule": timedelta(seconds=FLEET_SNAPSHOT_INTERVAL_S),
            # A snapshot nobody ran in time is worthless: the next one replaces it.
            "options": {"expires": FLEET_SNAPSHOT_INTERVAL_S},
        },
        "nodes-reconcile-node-health": {
            "task": "nodes.tasks.reconcile_node_health",
            "schedule": timedelta(seconds=10),
        },
        "nodes-expire-commands": {"task": "nodes.tasks.expire_commands", "schedule": timedelta(seconds=5)},
        "nodes-purge-telemetry": {"task": "nodes.tasks.purge_telemetry", "schedule": crontab(minute=17)},
        "nodes-advance-rollouts": {
            "task": "nodes.tasks.advance_rollouts",
            "schedule": timedelta(seconds=ROLLOUT_ADVANCE_INTERVAL_S),
        },
        # Staff MIG changes waiting for their GPU to drain (scheduling sends most of them at once).
        "nodes-send-drained-mig": {
            "task": "nodes.tasks.send_drained_mig",
            "schedule": timedelta(seconds=10),
        },
    }
)
# --- end of the nodes block ------------------------------------------------------------------------

# --- Logging --------------------------------------------------------------------------------------
# json (one object per line, with request/task/workload/tenant/user ids: portal/logging.py) is the
# production default; plain reads better in a terminal (make run sets DEBUG, so plain).
LOG_FORMAT = env.str("LOG_FORMAT", default="plain" if DEBUG else "json")
LOGGING_CONFIG = "logging.config.dictConfig"
LOGGING = logging_config(fmt=LOG_FORMAT, level=env.str("LOG_LEVEL", default="INFO"))
# Workers log through the configuration above (with task ids) instead of Celery's own handler.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# --- Sentry (optional) -----------------------------------------------------------------------------
# Errors (and, with a sample rate above 0, traces) of web, workers and beat go to Sentry when
# SENTRY_DSN is set; nothing is initialised otherwise. No personal data is sent.
SENTRY_DSN = env.str("SENTRY_DSN", default="")
SENTRY_ENVIRONMENT = env.str("SENTRY_ENVIRONMENT", default="development" if DEBUG else "production")
SENTRY_RELEASE = env.str("SENTRY_RELEASE", default="")
SENTRY_TRACES_SAMPLE_RATE = env.float("SENTRY_TRACES_SAMPLE_RATE", default=0.0)
if SENTRY_DSN:
    sentry_init(
        dsn=SENTRY_DSN,
        environment=SENTRY_ENVIRONMENT,
        release=SENTRY_RELEASE or None,
        traces_sample_rate=SENTRY_TRACES_SAMPLE_RATE,
    )

# --- gpupool: scheduling ----------------------------------------------------------------------------
# The engine's placement policy for the live scheduler (scheduling.engine.policies.POLICIES).
SCHEDULING_POLICY = env.str("SCHEDULING_POLICY", default="gpupool")
# Ask for a cycle on submit, release and node change (debounced); beat runs one every few seconds.
SCHEDULING_TRIGGER_CYCLES = env.bool("SCHEDULING_TRIGGER_CYCLES", default=True)
SCHEDULING_CYCLE_DEBOUNCE_S = env.float("SCHEDULING_CYCLE_DEBOUNCE_S", default=0.5)
SCHEDULING_CYCLE_INTERVAL_S = env.float("SCHEDULING_CYCLE_INTERVAL_S", default=5)
SCHEDULING_RECONCILE_INTERVAL_S = env.float("SCHEDULING_RECONCILE_INTERVAL_S", default=15)
# SCHEDULED but not started within this: placed again (or failed after the last attempt).
SCHEDULING_START_TIMEOUT_S = env.int("SCHEDULING_START_TIMEOUT_S", default=300)
SCHEDULING_MAX_START_ATTEMPTS = env.int("SCHEDULING_MAX_START_ATTEMPTS", default=3)
# A workload across nodes (a gang) is RUNNING once every member started; a gang not complete
# within this is stopped on every node and placed again by its policy (scheduling.services.gangs).
SCHEDULING_GANG_START_TIMEOUT_S = env.int("SCHEDULING_GANG_START_TIMEOUT_S", default=300)
# Ports a gang's rank 0 listens on for its members (MASTER_PORT): one per gang, from this range.
# On docker nodes rank 0's node publishes it on its own address, so keep the range free there.
SCHEDULING_GANG_PORT_RANGE = (
    env.int("SCHEDULING_GANG_PORT_MIN", default=29500),
    env.int("SCHEDULING_GANG_PORT_MAX", default=29999),
)
SCHEDULING_STOP_GRACE_S = env.int("SCHEDULING_STOP_GRACE_S", default=30)
# How long past a stop's grace or a preemption's notice the node may take to report.
SCHEDULING_REPORT_GRACE_S = env.int("SCHEDULING_REPORT_GRACE_S", default=60)
# Notice a preempted workload gets, per plan (seconds).
SCHEDULING_PREEMPTION_NOTICE_S = {"spot": 30, "on_demand": 120, "reserved": 120, "default": 30}
# Lowest spot_max_price a request may name when no price provider (metering) gives a floor.
SCHEDULING_SPOT_PRICE_FLOOR = env.str("SCHEDULING_SPOT_PRICE_FLOOR", default="0")
# A new tenant's quota (None: no limit); staff change it in the admin.
SCHEDULING_DEFAULT_QUOTA = {
    "max_gpus_total": env.int("SCHEDULING_DEFAULT_MAX_GPUS", default=64),
    "max_concurrent_workloads": env.int("SCHEDULING_DEFAULT_MAX_WORKLOADS", default=100),
    "max_spot_gpus": None,
    "max_gpus_per_request": None,
}
SCHEDULING_LOG_TAIL_CHARS = 16_000
# Volumes: each region's storage root, a shared filesystem (NFS, CephFS, ...) that every node of the
# region mounts at that path, which is its agent's ``volumes_root``; "*" stands for every region not
# named. A region with no root offers no volumes. Sizes in GiB; at most this many per workload.
VOLUME_STORAGE_ROOTS = env.json("VOLUME_STORAGE_ROOTS", default={"*": "/srv/gpupool/volumes"})
VOLUME_MIN_SIZE_GIB = env.int("VOLUME_MIN_SIZE_GIB", default=1)
VOLUME_MAX_SIZE_GIB = env.int("VOLUME_MAX_SIZE_GIB", default=16384)
VOLUME_MAX_PER_WORKLOAD = 8
VOLUME_MAX_PER_TENANT = env.int("VOLUME_MAX_PER_TENANT", default=100)
# /api/v1/gpu-types/ (unfiltered) is the same for every tenant: answered from the cache, fresh for
# this many seconds; after that a worker computes the next answer (default queue) while requests get
# the previous one (its availability is then at most about twice that old, plus the queue's wait).
# 0: computed for each request.
SCHEDULING_GPU_TYPES_CACHE_S = env.int("SCHEDULING_GPU_TYPES_CACHE_S", default=2)
# A submission checks that some node could hold it against the fleet's node shapes per GPU model,
# kept this many seconds in each process (a request is refused only on a fresh read; one accepted
# on older shapes waits with its reason). 0: read for each submission.
SCHEDULING_FLEET_SHAPES_CACHE_S = env.int("SCHEDULING_FLEET_SHAPES_CACHE_S", default=10)
# Workload.gpu_vendor and GpuModel.vendor share one choice set: one name for it in the schema.
SPECTACULAR_SETTINGS.setdefault("ENUM_NAME_OVERRIDES", {})["GpuVendorEnum"] = "nodes.models.Vendor"
SPECTACULAR_SETTINGS["ENUM_NAME_OVERRIDES"].update(
    {
        "VolumeStateEnum": "scheduling.models.VolumeState",
        "RolloutStateEnum": "nodes.models.RolloutState",
        "RolloutStepStateEnum": "nodes.models.RolloutStepState",
        "WorkloadStateEnum": "scheduling.models.WorkloadState",
    }
)
# Warm pools: time constant of the demand estimate, and how often targets and slots are reconciled.
SCHEDULING_WARM_POOL_TAU_S = 900
SCHEDULING_WARM_POOL_INTERVAL_S = 30
CELERY_BEAT_SCHEDULE.update(
    {
        "scheduling-cycle": {
            "task": "scheduling.tasks.run_cycle",
            "schedule": timedelta(seconds=SCHEDULING_CYCLE_INTERVAL_S),
        },
        "scheduling-reconcile": {
            "task": "scheduling.tasks.reconcile",
            "schedule": timedelta(seconds=SCHEDULING_RECONCILE_INTERVAL_S),
        },
        "scheduling-warm-pools": {
            "task": "scheduling.tasks.warm_pools",
            "schedule": timedelta(seconds=SCHEDULING_WARM_POOL_INTERVAL_S),
        },
    }
)
# Workload logs (scheduling.services.logs): days kept per tenant service plan (Tenant.service_plan),
# the longest line stored (characters; the agent cuts longer ones), and the most lines one agent
# batch may carry.
WORKLOAD_LOG_RETENTION_DAYS = {
    "standard": env.int("WORKLOAD_LOG_RETENTION_DAYS_STANDARD", default=7),
    "pro": env.int("WORKLOAD_LOG_RETENTION_DAYS_PRO", default=30),
    "enterprise": env.int("WORKLOAD_LOG_RETENTION_DAYS_ENTERPRISE", default=90),
}
WORKLOAD_LOG_LINE_MAX_CHARS = 4096
WORKLOAD_LOG_BATCH_MAX_LINES = 10_000
# A follow stream with nothing new sends a comment this often (proxies close idle streams).
WORKLOAD_LOG_FOLLOW_KEEPALIVE_S = env.float("WORKLOAD_LOG_FOLLOW_KEEPALIVE_S", default=15.0)
# Slurm regions (scheduling.services.slurm): how often their inventory, jobs, states and
# accounting are read from Slurm and their queued jobs submitted.
SLURM_SYNC_INTERVAL_S = env.int("SLURM_SYNC_INTERVAL_S", default=10)
CELERY_BEAT_SCHEDULE["scheduling-slurm-sync"] = {
    "task": "scheduling.tasks.slurm_sync",
    "schedule": timedelta(seconds=SLURM_SYNC_INTERVAL_S),
    "options": {"expires": SLURM_SYNC_INTERVAL_S},
}
CELERY_BEAT_SCHEDULE["scheduling-purge-logs"] = {
    "task": "scheduling.tasks.purge_logs",
    "schedule": crontab(minute=27),
}
# Reservations are commitments: who may cancel an active one ("staff", or "tenant": its owners and
# admins too), and the fee, a percent of what the rest of the term would have cost, billed with the
# month of the cancellation. A cancelled reservation is billed to the second up to its cancellation.
RESERVATION_CANCEL_ACTIVE_BY = env.str("RESERVATION_CANCEL_ACTIVE_BY", default="staff").strip().lower()
if RESERVATION_CANCEL_ACTIVE_BY not in ("staff", "tenant"):
    raise ImproperlyConfigured(
        f"RESERVATION_CANCEL_ACTIVE_BY must be staff or tenant, not {RESERVATION_CANCEL_ACTIVE_BY!r}."
    )
RESERVATION_CANCEL_FEE_PERCENT = Decimal(env.str("RESERVATION_CANCEL_FEE_PERCENT", default="0"))
if not 0 <= RESERVATION_CANCEL_FEE_PERCENT <= 100:
    raise ImproperlyConfigured("RESERVATION_CANCEL_FEE_PERCENT must be between 0 and 100.")
# --- end of the scheduling block -------------------------------------------------------------------

# --- gpupool: metering ------------------------------------------------------------------------------
# Per-second billing with a minimum per allocation (seconds).
METERING_MINIMUM_BILLABLE_S = env.int("METERING_MINIMUM_BILLABLE_S", default=60)
# Days after the month's end an invoice stays a draft (late usage still lands on it).
METERING_INVOICE_GRACE_DAYS = env.int("METERING_INVOICE_GRACE_DAYS", default=3)
# Reserved instances: discount (percent) of the monthly fee per term length in months.
METERING_RESERVED_TERM_DISCOUNTS = {1: 0, 3: 5, 6: 10, 12: 20}
# The invoice run (usage, last month's drafts, finalizing drafts past their grace) is idempotent:
# beat runs it shortly after midnight UTC on the 1st (the month's drafts), and at the same time on
# every other day (drafts rebuilt while late usage lands in their grace, then finalized).
CELERY_BEAT_SCHEDULE.update(
    {
        "metering-invoice-run": {
            "task": "metering.tasks.invoice_run",
            "schedule": crontab(minute=5, hour=0, day_of_month=1),
        },
        "metering-invoice-drafts": {
            "task": "metering.tasks.invoice_run",
            "schedule": crontab(minute=5, hour=0, day_of_month="2-31"),
        },
        # Finalized invoices the payment provider never received are sent again (or alerted).
        "metering-payments-sweep": {
            "task": "metering.tasks.invoice_payments_sweep",
            "schedule": timedelta(minutes=10),
        },
        "metering-usage": {
            "task": "metering.tasks.usage_build",
            "schedule": timedelta(minutes=1),
        },
        "metering-spot-prices": {
            "task": "metering.tasks.spot_prices_update",
            "schedule": timedelta(minutes=1),
        },
        "metering-costs-to-date": {
            "task": "metering.tasks.costs_to_date_update",
            "schedule": timedelta(minutes=1),
            # A figure nobody computed in time is replaced by the next one.
            "options": {"expires": 60},
        },
    }
)
# Payments: "manual" (finance marks invoices paid) or "stripe" (the STRIPE_* settings above).
METERING_PAYMENT_PROVIDER = env.str("METERING_PAYMENT_PROVIDER", default="manual")
# A finalized invoice is due this many days after finalization.
METERING_PAYMENT_TERMS_DAYS = env.int("METERING_PAYMENT_TERMS_DAYS", default=14)
# The seller printed on invoices (PDF): name, postal address (lines separated by "|"), e-mail, tax id.
METERING_SELLER = {
    "name": env.str("METERING_SELLER_NAME", default="gpupool"),
    "address": [
        line.strip()
        for line in env.str("METERING_SELLER_ADDRESS", default="GPU cloud services").split("|")
        if line.strip()
    ],
    "email": env.str("METERING_SELLER_EMAIL", default="billing@gpupool.invalid"),
    "tax_id": env.str("METERING_SELLER_TAX_ID", default=""),
}
# Dunning: days past the due date before the tenant is suspended (paying reactivates it).
METERING_DUNNING_GRACE_DAYS = env.int("METERING_DUNNING_GRACE_DAYS", default=7)
# What suspension (by dunning or by staff) does to the tenant's workloads: "keep" (running ones go on
# and are billed) or "stop" (running and queued ones are stopped, their events naming the suspension).
METERING_SUSPEND_RUNNING = env.str("METERING_SUSPEND_RUNNING", default="keep").strip().lower()
if METERING_SUSPEND_RUNNING not in ("keep", "stop"):
    raise ImproperlyConfigured(
        f"METERING_SUSPEND_RUNNING must be keep or stop, not {METERING_SUSPEND_RUNNING!r}."
    )
# A budget whose limit action is "stop": seconds of notice between passing the limit and stopping
# the tenant's running on-demand and spot work.
METERING_BUDGET_STOP_NOTICE_S = env.int("METERING_BUDGET_STOP_NOTICE_S", default=900)
# Dunning counts in days: once a day, after the invoice run, in European working hours.
CELERY_BEAT_SCHEDULE["metering-dunning"] = {
    "task": "metering.tasks.dunning_run",
    "schedule": crontab(minute=0, hour=6),
}
# The sweeper leaves an invoice this long to its own on-commit submission before sending it again,
# and alerts staff when transient errors keep one unsent for longer than the second.
METERING_PAYMENT_SWEEP_AFTER_S = env.int("METERING_PAYMENT_SWEEP_AFTER_S", default=600)
METERING_PAYMENT_SUBMIT_ALERT_AFTER_S = env.int("METERING_PAYMENT_SUBMIT_ALERT_AFTER_S", default=6 * 3600)
# Invoice line kinds and workload kinds are both fields named "kind": one schema name for each.
SPECTACULAR_SETTINGS.setdefault("ENUM_NAME_OVERRIDES", {}).update(
    {"InvoiceLineKindEnum": "metering.models.LineKind", "KindEnum": "scheduling.models.WorkloadKind"}
)
# --- end of the metering block ---------------------------------------------------------------------

# --- Webhooks (webhooks/) ----------------------------------------------------------------------------
# Deliveries go to public addresses only; this allows loopback (and plain http) for tests and demos.
WEBHOOK_ALLOW_LOOPBACK = env.bool("WEBHOOK_ALLOW_LOOPBACK", default=False)
# One attempt, connect to last byte read, and how much of an answer is read.
WEBHOOK_TIMEOUT_S = env.float("WEBHOOK_TIMEOUT_S", default=10.0)
WEBHOOK_CONNECT_TIMEOUT_S = env.float("WEBHOOK_CONNECT_TIMEOUT_S", default=5.0)
WEBHOOK_MAX_RESPONSE_BYTES = env.int("WEBHOOK_MAX_RESPONSE_BYTES", default=64 * 1024)
# Retries: base * 2^(n-1) seconds after the n-th failure, at most the max delay, until the window
# (three days from the event) closes.
WEBHOOK_RETRY_BASE_S = env.float("WEBHOOK_RETRY_BASE_S", default=30.0)
WEBHOOK_RETRY_MAX_DELAY_S = env.float("WEBHOOK_RETRY_MAX_DELAY_S", default=6 * 3600.0)
WEBHOOK_RETRY_WINDOW_S = env.float("WEBHOOK_RETRY_WINDOW_S", default=3 * 86400.0)
WEBHOOK_MAX_ENDPOINTS = env.int("WEBHOOK_MAX_ENDPOINTS", default=20)
# Events and their delivery logs are kept this long once no delivery of them is pending.
WEBHOOK_RETENTION_DAYS = env.int("WEBHOOK_RETENTION_DAYS", default=30)
# A delivery's state has a choice set of its own (another "state" field): its own schema name.
SPECTACULAR_SETTINGS["ENUM_NAME_OVERRIDES"]["WebhookDeliveryStateEnum"] = "webhooks.models.DeliveryState"
CELERY_BEAT_SCHEDULE.update(
    {
        # Retries due (and attempts a dead worker left claimed) are sent from the database's state.
        "webhooks-deliver-due": {
            "task": "webhooks.tasks.deliver_due",
            "schedule": timedelta(seconds=30),
            "options": {"expires": 30},
        },
        "webhooks-purge": {"task": "webhooks.tasks.purge", "schedule": timedelta(hours=1)},
    }
)
