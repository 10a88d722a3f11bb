"""The agent's settings: built-in defaults < config file (TOML) < environment < command-line flags.

The config file is ``--config PATH`` or ``$GPUPOOL_AGENT_CONFIG``; its keys are the field names of
:class:`AgentConfig` (``labels`` a table, ``sim_gpus`` an array of tables ``{model, count}``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nodes.agent.collectors import COLLECTOR_KINDS
from nodes.agent.runtimes import DEFAULT_MPS_PIPE_DIR, GPU_SHARING_MODES, RUNTIME_KINDS, RuntimeFailure
from nodes.agent.runtimes.docker import DEFAULT_PIDS_LIMIT
from nodes.agent.runtimes.process import process_user

UPGRADE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# A network interface's name (Linux: at most 15 characters, no "/" or space).
GANG_PARENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,14}$")


class ConfigError(ValueError):
    """A setting is missing or wrong; the message names it."""


@dataclass
class AgentConfig:
    portal_url: str = ""
    # Plain http:// sends the bootstrap token, the node credential and tenants' start commands in
    # clear text: refused unless allowed here (a portal on loopback, a private test network).
    allow_insecure_http: bool = False
    bootstrap_token: str = ""
    state_dir: str = "/var/lib/gpupool-agent"
    collector: str = "auto"
    runtime: str = "docker"
    # How fractional (non-MIG) shares of a GPU are isolated: "time-slicing" (no daemon needed) or
    # "mps" (the host runs nvidia-cuda-mps-control; SM share and memory limit enforced).
    gpu_sharing: str = "time-slicing"
    mps_pipe_dir: str = DEFAULT_MPS_PIPE_DIR
    # The docker runtime: the Engine API's address (empty: $DOCKER_HOST, else the local socket) and
    # the most processes a workload's container may run.
    docker_host: str = ""
    docker_pids_limit: int = DEFAULT_PIDS_LIMIT
    # The subprocess runtime runs tenants' commands on the host: only on a node that serves one
    # tenant, said here explicitly, and never as root (process_user when the agent is root). Their
    # working directories go under process_work_dir (empty: "<state_dir>-workloads").
    single_tenant: bool = False
    process_user: str = ""
    process_work_dir: str = ""
    # Where the region's shared filesystem for tenant volumes is mounted (the portal's
    # VOLUME_STORAGE_ROOTS for the region); empty: no volume attaches on this node.
    volumes_root: str = ""
    region: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    hostname: str = ""
    # How tenants (SSH) and the portal (published ports) reach this node: a DNS name or IP address;
    # empty: the hostname.
    advertise_address: str = ""
    # The SSH endpoint into workloads (nodes/agent/ssh.py): "host:port" to listen on, e.g.
    # "0.0.0.0:2222" (port 0: any free port); empty: none.
    ssh_listen: str = ""
    # How often open SSH sessions are checked against the portal's keys again (seconds): a deleted
    # key or a removed member's session ends within about this long.
    ssh_recheck_s: float = 15.0
    # Where workloads' published ports listen (an IP address of this node): HTTP ports on
    # publish_address, the private network the portal's proxy reaches (advertise_address must lead
    # there); TCP ports on tcp_publish_address (empty: publish_address). A port published on every
    # interface (0.0.0.0) is reachable around the portal's access check: see docs/security.md.
    publish_address: str = "127.0.0.1"
    tcp_publish_address: str = ""
    # Docker runtime: the IP address of this node on the network between nodes, where a gang's
    # rank 0 publishes its rendezvous port (MASTER_PORT); empty: MASTER_ADDR, the address the
    # portal gives for this node (advertise_address), which must then be an IP address.
    gang_address: str = ""
    # Docker runtime: close a gang's rendezvous port to all but its members with iptables rules of
    # the agent's (nodes/agent/runtimes/gang_firewall.py). Off only where the operator isolates the
    # nodes' network between tenants by other means: docker forwards a published port from anywhere.
    gang_firewall: bool = True
    # Docker runtime: the interface on the region's gang network (the nodes' data network, whose
    # subnet and container range staff set on the Region), e.g. "eth1"; gang members then get
    # addresses of their own there (nodes/agent/runtimes/gang_network.py). Empty: none.
    gang_parent: str = ""
    # The image of the idle container that holds a gang member's network namespace (its command:
    # gang_sandbox_command, words split on spaces; empty: the image's own).
    gang_sandbox_image: str = "registry.k8s.io/pause:3.10"
    gang_sandbox_command: str = ""
    # How often the GPUs are read; every reading since the last batch goes in the next one.
    sample_interval_s: float = 1.0
    # Unset (None): the portal's answer to register decides.
    heartbeat_interval_s: float | None = None
    # Where in the interval (0-1) this agent's readings and batches fall: 0 starts at once. A
    # simulated fleet's agents all start together; their phases spread them over the interval as
    # the start times of a real fleet's machines do.
    heartbeat_phase: float = 0.0
    commands_wait_s: int | None = None
    request_timeout_s: float = 10.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    shutdown_flush_s: float = 5.0
    stop_grace_s: float = 30.0
    # Simulated node: its GPUs ([{model, count}]), machine size, interconnect, seed.
    sim_gpus: list[dict[str, Any]] = field(default_factory=list)
    cpu_cores: int | None = None
    ram_mib: int | None = None
    interconnect: str = ""
    seed: int = 0
    log_level: str = "INFO"
    # Workload output (nodes.agent.logship): how often it is read and shipped, each workload's
    # limit (lines and bytes per second, with bursts of workload_log_burst_s seconds of either;
    # what passes it is dropped, with a marker line), and the most lines the on-disk buffer holds
    # (when full, output is left at its source until the portal takes some).
    workload_log_interval_s: float = 0.5
    workload_log_lines_per_s: float = 1000.0
    workload_log_bytes_per_s: float = 1024 * 1024
    workload_log_burst_s: float = 5.0
    workload_log_buffer_lines: int = 200_000
    # Rolling upgrades: name -> the command (argv, an absolute program path first) the ``upgrade``
    # command runs. The portal names one; it never sends a command line.
    upgrades: dict[str, list[str]] = field(default_factory=dict)

    def validate(self) -> AgentConfig:
        if not self.portal_url:
            raise ConfigError("portal_url is required (--portal-url or GPUPOOL_PORTAL_URL)")
        parts = urlsplit(self.portal_url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"portal_url must start with http:// or https://, not {self.portal_url!r}")
        if self.collector not in COLLECTOR_KINDS:
            raise ConfigError(
                f"collector must be one of {', '.join(COLLECTOR_KINDS)}, not {self.collector!r}"
            )
        if self.runtime not in RUNTIME_KINDS:
            raise ConfigError(f"runtime must be one of {', '.join(RUNTIME_KINDS)}, not {self.runtime!r}")
        if self.gpu_sharing not in GPU_SHARING_MODES:
            raise ConfigError(
                f"gpu_sharing must be one of {', '.join(GPU_SHARING_MODES)}, not {self.gpu_sharing!r}"
            )
        if self.heartbeat_interval_s is not None and self.heartbeat_interval_s <= 0:
            raise ConfigError("heartbeat_interval_s must be positive")
        if not 0 <= self.heartbeat_phase < 1:
            raise ConfigError("heartbeat_phase must be at least 0 and below 1")
        if self.sample_interval_s <= 0:
            raise ConfigError("sample_interval_s must be positive")
        if self.docker_pids_limit < 1:
            raise ConfigError("docker_pids_limit must be positive")
        for name in (
            "workload_log_interval_s",
            "workload_log_lines_per_s",
            "workload_log_bytes_per_s",
            "workload_log_burst_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive")
        if self.workload_log_buffer_lines < 100:
            raise ConfigError("workload_log_buffer_lines must be at least 100")
        if scheme == "http" and not self.allow_insecure_http:
            raise ConfigError(
                f"portal_url {self.portal_url!r} is plain HTTP: the node credential and tenants' start "
                "commands would cross the network unencrypted. Use https://, or allow it explicitly "
                "(allow_insecure_http = true, --allow-insecure-http or GPUPOOL_ALLOW_INSECURE_HTTP=1)"
            )
        if not 0 < self.ssh_recheck_s <= 3600:
            raise ConfigError("ssh_recheck_s must be above 0 and at most 3600")
        if self.ssh_listen:
            from nodes.agent.ssh import parse_listen

            try:
                parse_listen(self.ssh_listen)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        for name in ("publish_address", "tcp_publish_address", "gang_address"):
            value = getattr(self, name)
            if value or name == "publish_address":
                try:
                    ipaddress.ip_address(value)
                except ValueError:
                    raise ConfigError(f"{name} must be an IP address of this node, not {value!r}") from None
        if self.gang_parent and not GANG_PARENT.match(self.gang_parent):
            raise ConfigError(f"gang_parent must be a network interface's name, not {self.gang_parent!r}")
        if self.gang_parent and self.runtime != "docker":
            raise ConfigError("gang_parent is a docker runtime setting (gang members as containers)")
        if self.runtime == "subprocess":
            try:
                process_user(single_tenant=self.single_tenant, user=self.process_user)
            except RuntimeFailure as exc:
                raise ConfigError(str(exc)) from None
        for name, argv in self.upgrades.items():
            if not UPGRADE_NAME.match(name):
                raise ConfigError(f"upgrades: {name!r} is not a name of letters, digits and ._- (at most 64)")
            if (
                not isinstance(argv, list)
                or not argv
                or not all(isinstance(a, str) and "\x00" not in a for a in argv)
                or not os.path.isabs(argv[0])
            ):
                raise ConfigError(f"upgrades.{name}: a list of strings, an absolute program path first")
        if not self.hostname:
            self.hostname = socket.gethostname()
        return self

    def runtime_options(self) -> dict[str, Any]:
        """The chosen runtime's own settings, as ``make_runtime`` takes them."""
        publish = {"publish_address": self.publish_address, "tcp_publish_address": self.tcp_publish_address}
        if self.runtime == "docker":
            return {
                "docker_host": self.docker_host,
                "pids_limit": self.docker_pids_limit,
                "gang_address": self.gang_address,
                "gang_firewall": self.gang_firewall,
                "gang_parent": self.gang_parent,
                "gang_sandbox_image": self.gang_sandbox_image,
                "gang_sandbox_command": self.gang_sandbox_command.split(),
                **publish,
            }
        if self.runtime == "subprocess":
            return {
                "single_tenant": self.single_tenant,
                "process_user": self.process_user,
                "process_work_dir": self.process_work_dir,
                **publish,
            }
        return {}

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)


ENV = {
    "GPUPOOL_PORTAL_URL": "portal_url",
    "GPUPOOL_ALLOW_INSECURE_HTTP": "allow_insecure_http",
    "GPUPOOL_BOOTSTRAP_TOKEN": "bootstrap_token",
    "GPUPOOL_STATE_DIR": "state_dir",
    "GPUPOOL_COLLECTOR": "collector",
    "GPUPOOL_RUNTIME": "runtime",
    "GPUPOOL_GPU_SHARING": "gpu_sharing",
    "GPUPOOL_MPS_PIPE_DIR": "mps_pipe_dir",
    "GPUPOOL_DOCKER_HOST": "docker_host",
    "GPUPOOL_DOCKER_PIDS_LIMIT": "docker_pids_limit",
    "GPUPOOL_SINGLE_TENANT": "single_tenant",
    "GPUPOOL_PROCESS_USER": "process_user",
    "GPUPOOL_PROCESS_WORK_DIR": "process_work_dir",
    "GPUPOOL_VOLUMES_ROOT": "volumes_root",
    "GPUPOOL_REGION": "region",
    "GPUPOOL_LABELS": "labels",
    "GPUPOOL_HOSTNAME": "hostname",
    "GPUPOOL_ADVERTISE_ADDRESS": "advertise_address",
    "GPUPOOL_SSH_LISTEN": "ssh_listen",
    "GPUPOOL_SSH_RECHECK_S": "ssh_recheck_s",
    "GPUPOOL_PUBLISH_ADDRESS": "publish_address",
    "GPUPOOL_TCP_PUBLISH_ADDRESS": "tcp_publish_address",
    "GPUPOOL_GANG_ADDRESS": "gang_address",
    "GPUPOOL_GANG_FIREWALL": "gang_firewall",
    "GPUPOOL_GANG_PARENT": "gang_parent",
    "GPUPOOL_GANG_SANDBOX_IMAGE": "gang_sandbox_image",
    "GPUPOOL_GANG_SANDBOX_COMMAND": "gang_sandbox_command",
    "GPUPOOL_HEARTBEAT_INTERVAL_S": "heartbeat_interval_s",
    "GPUPOOL_SAMPLE_INTERVAL_S": "sample_interval_s",
    "GPUPOOL_COMMANDS_WAIT_S": "commands_wait_s",
    "GPUPOOL_LOG_LEVEL": "log_level",
    "GPUPOOL_WORKLOAD_LOG_INTERVAL_S": "workload_log_interval_s",
    "GPUPOOL_WORKLOAD_LOG_LINES_PER_S": "workload_log_lines_per_s",
    "GPUPOOL_WORKLOAD_LOG_BYTES_PER_S": "workload_log_bytes_per_s",
    "GPUPOOL_WORKLOAD_LOG_BURST_S": "workload_log_burst_s",
    "GPUPOOL_WORKLOAD_LOG_BUFFER_LINES": "workload_log_buffer_lines",
    "GPUPOOL_UPGRADES": "upgrades",
}


def parse_labels(text: str) -> dict[str, str]:
    """``rack=r12,row=3`` or a JSON object."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"labels: not a JSON object: {exc}") from exc
        return {str(k): str(v) for k, v in value.items()}
    labels = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"labels: {part!r} is not key=value")
        labels[key.strip()] = value.strip()
    return labels


_FIELDS = {f.name: f for f in dataclasses.fields(AgentConfig)}


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}: {value!r} is not true or false (1/0, true/false, yes/no)")


def _coerce(name: str, value: Any) -> Any:
    if name not in _FIELDS:
        raise ConfigError(f"unknown setting {name!r}")
    if value is None:
        return None
    kind = _FIELDS[name].type
    if kind == "bool":
        return _bool(name, value)
    try:
        if name == "labels":
            return (
                parse_labels(value) if isinstance(value, str) else {str(k): str(v) for k, v in value.items()}
            )
        if name == "sim_gpus":
            return json.loads(value) if isinstance(value, str) else list(value)
        if name == "upgrades":
            value = json.loads(value) if isinstance(value, str) else value
            return {str(k): list(v) if isinstance(v, list) else v for k, v in dict(value).items()}
        if "float" in str(kind):
            return float(value)
        if "int" in str(kind):
            return int(value)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{name}: {value!r} is not valid ({exc})") from exc
    return str(value)


def load_config(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
) -> AgentConfig:
    """Merge the layers; ``cli`` holds only the flags that were given (``None`` means not given)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = config_file or env.get("GPUPOOL_AGENT_CONFIG")
    if path:
        try:
            with open(path, "rb") as handle:
                data = tomllib.load(handle)
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from exc
        data = data.get("agent", data)  # a [agent] table or top-level keys
        for name, value in data.items():
            values[name] = _coerce(name, value)
    for variable, name in ENV.items():
        if env.get(variable):
            values[name] = _coerce(name, env[variable])
    for name, value in (cli or {}).items():
        if value is not None:
            values[name] = _coerce(name, value)
    return AgentConfig(**values)
