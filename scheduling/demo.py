"""Demo data of scheduling for ``make run`` (``manage.py seed_demo``), idempotent: the template
catalog (a few real public images a tenant can launch from at once; a template already there is left
as staff made it) and a volume or two of the demo tenant in the simulated regions (nodes' receiver,
which makes the regions, runs first: nodes is installed before scheduling). The simulated runtime
does not touch volumes, so they stay unmeasured."""

from __future__ import annotations

from portal.actors import Actor
from scheduling.models import Volume, VolumeState, WorkloadTemplate
from scheduling.services.templates import template_create
from scheduling.services.volumes import storage_root, volume_create

JUPYTER = (
    "mkdir -p /workspace && exec jupyter lab --ip=0.0.0.0 --port=8888 --no-browser --allow-root "
    "--ServerApp.root_dir=/workspace --ServerApp.base_url=/proxy/$GPUPOOL_WORKLOAD_ID/8888/"
)
DEMO_TEMPLATES = (
    {
        "name": "pytorch-jupyter",
        "description": "NVIDIA's PyTorch container with JupyterLab on port 8888 (its login token is "
        "in the output); notebooks in /workspace, on a volume if you attach one.",
        "image": "nvcr.io/nvidia/pytorch:24.08-py3",
        # Served under the portal's proxy path (the proxy passes the whole path).
        "command": ["sh", "-c", JUPYTER],
        "ports": [8888],
        "env": {"JUPYTER_ENABLE_LAB": "yes"},
        "min_gpu_memory_gib": 16,
        "volume_mount_path": "/workspace",
    },
    {
        "name": "vllm-openai",
        "description": "vLLM's OpenAI-compatible server on port 8000; set MODEL (and HF_TOKEN as a secret).",
        "image": "vllm/vllm-openai:v0.6.3",
        "command": [],
        "ports": [8000],
        "env": {},
        "min_gpu_memory_gib": 24,
    },
    {
        "name": "cuda-base",
        "description": "A bare CUDA 12.4 Ubuntu image that waits: bring your own command.",
        "image": "nvidia/cuda:12.4.1-base-ubuntu22.04",
        "command": ["sleep", "infinity"],
        "ports": [],
        "env": {},
        "min_gpu_memory_gib": 0,
    },
)


# The demo team's own template: the catalog's notebook, kept on a volume it must be given.
DEMO_TEAM_TEMPLATE = {
    **DEMO_TEMPLATES[0],
    "name": "lab-notebook",
    "description": "Our JupyterLab: notebooks on a volume at /workspace (launching asks for one).",
    "volume_required": True,
}


def templates_demo_seed(tenant=None) -> int:
    """Create the demo catalog templates that are missing (and the demo team's own, given the
    team); returns how many were made."""
    have = set(WorkloadTemplate.objects.catalog().values_list("name", flat=True))
    made = 0
    for data in DEMO_TEMPLATES:
        if data["name"] not in have:
            template_create(tenant=None, data=dict(data), actor=Actor.system())
            made += 1
    if (
        tenant is not None
        and not WorkloadTemplate.objects.filter(tenant=tenant, name="lab-notebook").exists()
    ):
        template_create(tenant=tenant, data=dict(DEMO_TEAM_TEMPLATE), actor=Actor.system())
        made += 1
    return made


DEMO_VOLUMES = (
    ("datasets", "us-east-1", 200),
    ("checkpoints", "us-east-1", 50),
    ("scratch", "eu-west-1", 100),
)


def on_seed_demo_requested(sender, tenant=None, stdout=None, **kwargs) -> None:
    from nodes.models import Region

    made = templates_demo_seed(tenant)
    if stdout is not None and made:
        stdout.write(f"Templates: {made} added.")
    if tenant is None:
        return
    made = 0
    for name, code, size in DEMO_VOLUMES:
        region = Region.objects.filter(code=code).first()
        if region is None or not storage_root(region):
            continue
        if (
            Volume.objects.for_tenant(tenant)
            .filter(name=name, region=region)
            .exclude(state=VolumeState.DELETED)
            .exists()
        ):
            continue
        volume_create(tenant=tenant, name=name, region=code, size_gib=size, actor=Actor.system())
        made += 1
    if stdout is not None and made:
        stdout.write(f"Demo volumes: {made} made.")
