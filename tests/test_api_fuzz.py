"""Property-based fuzzing of the whole tenant API from its own OpenAPI schema.

Schemathesis generates requests (valid and invalid bodies, query strings and path ids) for every
operation in ``/api/schema/``, so new endpoints are fuzzed without editing this file. Whatever a
client sends, the answer is never a 5xx, a success conforms to the documented response schema, and
an error keeps the JSON error shape.

Two tenants: A fuzzes with its full-scope token; B has jobs, an instance, tokens, a member and an
invitation of its own, and no answer to A ever names one of them. A's path ids are sometimes aimed
at A's own objects (the success paths) and sometimes at B's (which must answer 404). A seeded fleet
(nodes with GPUs of several catalog models) and a quota for A let valid submissions through the
quota, admission and save paths: the run must see at least one ``POST /api/v1/jobs/`` answer 201.

The stateful test chains the jobs' and instances' operations along the schema's OpenAPI links
(``portal.api.schema``): a create, then the calls on what it created.

CI replays fixed examples (``derandomize``); ``GPUPOOL_FUZZ_EXPLORE=1`` explores new random ones,
more of them.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections import Counter

import pytest
import schemathesis
from django.db import transaction
from django.utils import timezone
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance

from portal.actors import Actor
from portal.api.throttling import TokenRateThrottle
from portal.models import ApiToken, Invitation, Membership, Role, User
from portal.services.invitations import invitation_create
from portal.services.tokens import api_token_create
from portal.wsgi import application

schema = schemathesis.openapi.from_wsgi("/api/schema/", application)

pytestmark = pytest.mark.django_db

EXPLORE = os.environ.get("GPUPOOL_FUZZ_EXPLORE") == "1"
# Per operation; the stateful test runs SCENARIOS sequences of at most STEPS calls.
MAX_EXAMPLES = 100 if EXPLORE else 15
SCENARIOS, STEPS = (200, 10) if EXPLORE else (30, 8)
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
    ],
    derandomize=not EXPLORE,
)

# Everything of tenant B carries this marker in its names and addresses: no answer to A may hold it.
B_MARK = "bravo-hidden"
GPU_MODELS = ("NVIDIA H100 SXM 80GB", "NVIDIA A100 SXM 80GB", "NVIDIA L4", "AMD Instinct MI300X")
JOB = {"gpu_models": ["H100"], "image": "ghcr.io/acme/train:1", "command": ["python", "train.py"]}
INSTANCE = {"gpu_models": ["H100"], "image": "ghcr.io/acme/notebook:1"}
VALID_SPECS = {"/api/v1/jobs/": JOB, "/api/v1/instances/": INSTANCE}
DETAIL_PATH = re.compile(r"^/api/v1/(?P<collection>[a-z-]+)/\{id\}/")


def _fleet() -> None:
    """One ready node of eight GPUs for each model of GPU_MODELS, in two regions."""
    from nodes.models import Gpu, GpuModel, Node, NodeState, Region

    regions = [
        Region.objects.get_or_create(code="us-east-1", defaults={"name": "US East"})[0],
        Region.objects.get_or_create(code="eu-west-1", defaults={"name": "EU West"})[0],
    ]
    for n, name in enumerate(GPU_MODELS):
        model = GpuModel.objects.get(name=name)
        node = Node.objects.create(
            hostname=f"fuzz-{n}",
            region=regions[n % 2],
            cpu_cores=96,
            ram_mib=1024 * 1024,
            state=NodeState.READY,
            last_heartbeat_at=timezone.now(),
        )
        Gpu.objects.bulk_create(
            Gpu(
                node=node,
                index=i,
                uuid=f"GPU-{uuid.uuid4()}",
                model=model,
                reported_name=model.name,
                memory_mib=model.memory_gib * 1024,
            )
            for i in range(8)
        )


def _objects(tenant, prefix: str) -> dict[str, list[int]]:
    """A job, an instance, a second token, a member and an invitation of ``tenant``, by the API
    collection that serves them (jobs and instances are both workloads: one id space)."""
    from scheduling.services.submission import workload_submit

    owner = Membership.objects.filter(tenant=tenant, role=Role.OWNER).get().user
    actor = Actor(user=owner)
    job = workload_submit(tenant=tenant, kind="job", spec={**JOB, "name": f"{prefix}-job"}, actor=actor)
    instance = workload_submit(
        tenant=tenant, kind="instance", spec={**INSTANCE, "name": f"{prefix}-box"}, actor=actor
    )
    # Made by the system (staff, a script): no user to name as their maker.
    token, _ = api_token_create(tenant=tenant, name=f"{prefix}-spare", scopes=["read"], actor=Actor.system())
    member = Membership.objects.create(
        tenant=tenant,
        user=User.objects.create_user(email=f"member@{prefix}.test", password="pw-for-tests-1"),
        role=Role.MEMBER,
    )
    invitation, _ = invitation_create(
        tenant=tenant, email=f"invitee@{prefix}.test", role=Role.MEMBER, actor=Actor.system()
    )
    workloads = [job.pk, instance.pk]
    return {
        "jobs": workloads,
        "instances": workloads,
        "tokens": [token.pk],
        "members": [member.pk],
        "invitations": [invitation.pk],
    }


class World:
    """What the fuzzing sees: A's token, A's and B's objects, and the statuses A got."""

    def __init__(self, token: str, own: dict[str, list[int]], other: dict[str, list[int]], other_all):
        self.token = token
        self.own = own
        self.other = other
        self.other_all = other_all  # every id of B's, by collection, including its owner and token
        self.statuses: Counter[tuple[str, str, int]] = Counter()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture
def world(make_tenant, make_token, monkeypatch, handlers_keep_the_test_connection, settings, request):
    from nodes.catalog import catalog_seed
    from scheduling.models import Quota

    settings.SCHEDULING_TRIGGER_CYCLES = False  # no Celery here: submissions stay pending
    monkeypatch.setattr(TokenRateThrottle, "THROTTLE_RATES", {"token": "1000000/min"})
    catalog_seed()
    _fleet()
    a = make_tenant("alpha-fuzz")
    # Room for the fixtures' workloads and what the fuzzing submits, but bounds it can reach.
    Quota.objects.update_or_create(
        tenant=a,
        defaults={"max_gpus_total": 32, "max_concurrent_workloads": 40, "max_gpus_per_request": 8},
    )
    b = make_tenant(B_MARK, name=f"Tenant {B_MARK}")
    token = make_token(a)
    own = _objects(a, "alpha-fuzz")
    other = _objects(b, B_MARK)
    b_token = make_token(b, name=f"{B_MARK}-token")
    other_all = {
        **other,
        "tokens": list(ApiToken.objects.filter(tenant=b).values_list("pk", flat=True)),
        "members": list(Membership.objects.filter(tenant=b).values_list("pk", flat=True)),
        "invitations": list(Invitation.objects.filter(tenant=b).values_list("pk", flat=True)),
    }
    w = World(token, own, other, other_all)
    w.other_token = b_token
    yield w
    # The positive control of the run of POST /api/v1/jobs/: some submissions went through quota,
    # admission and save (a run that only ever saw refusals would prove little).
    if request.node.name.endswith("[POST /api/v1/jobs/]"):
        created = w.statuses[("POST", "/api/v1/jobs/", 201)]
        assert created, f"no fuzzed job submission was accepted: {dict(w.statuses)}"


def error_shape(ctx, response, case):
    """Every 4xx/5xx from the API is ``{"error": {"code", "message", "fields"}}``."""
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        assert {"code", "message", "fields"} <= set(body["error"]), body
    return None


def _items(body) -> list[dict]:
    """The objects of a detail or list answer: the body, its ``results``, or its elements."""
    if isinstance(body, list):
        return [x for x in body if isinstance(x, dict)]
    if isinstance(body, dict):
        results = body.get("results")
        return [x for x in results if isinstance(x, dict)] if isinstance(results, list) else [body]
    return []


def no_leak_check(world: World):
    """A check that no answer to A names B: neither B's marker anywhere in the body, nor one of B's
    ids as the ``id`` of an object of the collection that served it."""

    def no_leak(ctx, response, case):
        text = response.text or ""
        assert B_MARK not in text.lower(), f"{case.method} {case.formatted_path} showed B's data: {text}"
        match = re.match(r"^/api/v1/([a-z-]+)/", case.formatted_path)
        if match and 200 <= response.status_code < 300 and text:
            try:
                body = json.loads(text)
            except ValueError:
                return None
            ids = set(world.other_all.get(match.group(1), []))
            leaked = [x for x in _items(body) if x.get("id") in ids]
            assert not leaked, f"{case.method} {case.formatted_path} showed B's objects: {leaked}"
        return None

    return no_leak


def _aim(case, world: World) -> bool:
    """Point a generated numeric ``{id}`` at one of A's objects (a third of them) or B's (another
    third), by its last digit; True when it is now B's. (Schema examples rule out a strategy of
    our own through ``@schema.given``: the choice is drawn from the generated case itself.)"""
    match = DETAIL_PATH.match(case.path)
    generated = (case.path_parameters or {}).get("id")
    if match is None or not isinstance(generated, str) or not generated.isdigit():
        return False
    target = ("generated", "own", "other")[int(generated[-1]) % 3]
    ids = {"own": world.own, "other": world.other}.get(target, {}).get(match.group("collection"))
    if not ids:
        return False
    case.path_parameters["id"] = str(ids[0])
    return target == "other"


@schema.parametrize()
@FUZZ_SETTINGS
def test_no_request_makes_the_api_fail(case, world):
    at_other = _aim(case, world)
    response = case.call_and_validate(
        headers=world.headers,
        checks=[not_a_server_error, response_schema_conformance, error_shape, no_leak_check(world)],
    )
    world.statuses[(case.method, case.path, response.status_code)] += 1
    if at_other:
        assert response.status_code == 404, (case.method, case.formatted_path, response.status_code)


# --- stateful: create, then use what was created ---------------------------------------------------

# Jobs and instances with their actions: revoking tokens or removing members would end the fuzzing
# token's own access midway, and the other collections have no create that links onwards.
workloads_schema = schema.include(path_regex=r"^/api/v1/(jobs|instances)/")


def test_linked_job_and_instance_operations(world):
    from schemathesis.checks import ensure_resource_availability

    no_leak = no_leak_check(world)

    class Workflow(workloads_schema.as_state_machine()):
        def setup(self):
            # Each scenario starts from the same database (Hypothesis replays a scenario and must
            # see the same answers): its writes are rolled back in teardown.
            self.scenario = transaction.atomic()
            self.scenario.__enter__()
            self.creates = Counter()

        def teardown(self):
            transaction.set_rollback(True)
            self.scenario.__exit__(None, None, None)

        def before_call(self, case):
            case.headers = {**(case.headers or {}), **world.headers}
            # Every other create sends a spec the fleet and quota take, so that the links have
            # something to follow; the rest stay as generated (mostly refused: 400, 403, 409).
            if case.method == "POST" and case.path in VALID_SPECS:
                self.creates[case.path] += 1
                if self.creates[case.path] % 2:
                    case.body = dict(VALID_SPECS[case.path])

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            world.statuses[(case.method, case.path, response.status_code)] += 1
            case.validate_response(
                response,
                checks=[
                    not_a_server_error,
                    response_schema_conformance,
                    ensure_resource_availability,
                    error_shape,
                    no_leak,
                ],
                headers=world.headers,
            )

    Workflow.run(
        settings=settings(
            Workflow.TestCase.settings,
            max_examples=SCENARIOS,
            stateful_step_count=STEPS,
            derandomize=not EXPLORE,
        )
    )
    # The links were followed: some create answered 201 and some call used what it made.
    linked = {
        path for (method, path, status), n in world.statuses.items() if "{id}" in path and status == 200
    }
    assert any(status == 201 for (_, _, status) in world.statuses), dict(world.statuses)
    assert linked, dict(world.statuses)


def test_the_leak_check_sees_b_objects(world):
    """The leak check's positive control: B's own answers (its jobs, its tokens) fail it, and A's
    answers to the same operations pass it."""
    no_leak = no_leak_check(world)
    for path in ("/api/v1/jobs/", "/api/v1/tokens/", "/api/v1/members/"):
        case = schema[path]["GET"].Case()
        as_a = case.call(headers=world.headers)
        assert as_a.status_code == 200 and no_leak(None, as_a, case) is None
        as_b = case.call(headers={"Authorization": f"Bearer {world.other_token}"})
        assert as_b.status_code == 200
        with pytest.raises(AssertionError, match="showed B's"):
            no_leak(None, as_b, case)
    job = world.other["jobs"][0]
    case = schema["/api/v1/jobs/{id}/"]["GET"].Case(path_parameters={"id": str(job)})
    as_b = case.call(headers={"Authorization": f"Bearer {world.other_token}"})
    assert as_b.status_code == 200
    with pytest.raises(AssertionError, match="showed B's"):
        no_leak(None, as_b, case)
    assert case.call(headers=world.headers).status_code == 404
