"""``gpupool-agent``: run the node agent, a simulated fleet, or print the effective settings.

    gpupool-agent [run] --portal-url URL --bootstrap-token gpb_... --state-dir DIR ...
    gpupool-agent fleet --fleet-file var/fleet.json [--portal-url URL] [--state-root var/agents]
    gpupool-agent show-config [the flags of run]

Settings: flags override the environment (``GPUPOOL_*``), which overrides the config file
(``--config`` or ``$GPUPOOL_AGENT_CONFIG``, TOML). ``GPUPOOL_EVENT_LOOP``: ``uvloop`` (the default,
where it is installed) or ``asyncio``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from nodes.agent import __version__
from nodes.agent.collectors import COLLECTOR_KINDS, CollectorUnavailable
from nodes.agent.config import AgentConfig, ConfigError, load_config
from nodes.agent.runtimes import RUNTIME_KINDS

log = logging.getLogger("nodes.agent")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2

T = TypeVar("T")


def _agent_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (default: $GPUPOOL_AGENT_CONFIG)")
    parser.add_argument("--portal-url", dest="portal_url")
    parser.add_argument(
        "--allow-insecure-http",
        dest="allow_insecure_http",
        action="store_const",
        const=True,
        help="accept an http:// portal URL (clear text; for a portal on loopback or a test network)",
    )
    parser.add_argument("--bootstrap-token", dest="bootstrap_token")
    parser.add_argument("--state-dir", dest="state_dir")
    parser.add_argument("--collector", choices=COLLECTOR_KINDS)
    parser.add_argument("--runtime", choices=RUNTIME_KINDS)
    parser.add_argument("--docker-host", dest="docker_host", help="the Engine API (default: $DOCKER_HOST)")
    parser.add_argument("--docker-pids-limit", dest="docker_pids_limit", type=int)
    parser.add_argument(
        "--volumes-root", dest="volumes_root", help="where the region's shared volume filesystem is mounted"
    )
    parser.add_argument("--region")
    parser.add_argument("--label", dest="labels", action="append", metavar="KEY=VALUE")
    parser.add_argument("--hostname")
    parser.add_argument(
        "--advertise-address",
        dest="advertise_address",
        help="how tenants and the portal reach this node: a DNS name or IP address (default: the hostname)",
    )
    parser.add_argument(
        "--ssh-listen",
        dest="ssh_listen",
        help="serve SSH into workloads on HOST:PORT, e.g. 0.0.0.0:2222 (port 0: any free port)",
    )
    parser.add_argument(
        "--ssh-recheck",
        dest="ssh_recheck_s",
        type=float,
        help="seconds between checks of open SSH sessions against the portal's keys (default 15)",
    )
    parser.add_argument(
        "--publish-address",
        dest="publish_address",
        help="the IP address workloads' HTTP ports listen on: the private network the portal reaches "
        "(default: 127.0.0.1)",
    )
    parser.add_argument(
        "--tcp-publish-address",
        dest="tcp_publish_address",
        help="the IP address workloads' TCP ports listen on (default: the publish address)",
    )
    parser.add_argument(
        "--gang-address",
        dest="gang_address",
        help="docker: this node's IP address on the network between nodes, where a gang's rank 0 "
        "publishes MASTER_PORT (default: MASTER_ADDR, the advertised address)",
    )
    parser.add_argument(
        "--gang-parent",
        dest="gang_parent",
        help="docker: the interface on the region's gang network (gang members get addresses there)",
    )
    parser.add_argument(
        "--gang-sandbox-image",
        dest="gang_sandbox_image",
        help="docker: the image of the idle container holding a gang member's network namespace",
    )
    parser.add_argument(
        "--gang-sandbox-command",
        dest="gang_sandbox_command",
        help="docker: the sandbox's command, words split on spaces (default: the image's own)",
    )
    parser.add_argument("--heartbeat-interval", dest="heartbeat_interval_s", type=float)
    parser.add_argument("--sample-interval", dest="sample_interval_s", type=float)
    parser.add_argument("--commands-wait", dest="commands_wait_s", type=int)
    parser.add_argument(
        "--sim-gpus",
        dest="sim_gpus",
        help='simulated GPUs as JSON, e.g. \'[{"model": "NVIDIA H100 80GB HBM3", "count": 8}]\'',
    )
    parser.add_argument("--log-level", dest="log_level")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpupool-agent", description="The gpupool node agent.")
    parser.add_argument("--version", action="version", version=f"gpupool-agent {__version__}")
    commands = parser.add_subparsers(dest="command")
    _agent_flags(commands.add_parser("run", help="run the agent for this machine (the default)"))
    _agent_flags(commands.add_parser("show-config", help="print the effective settings as JSON"))
    fleet = commands.add_parser("fleet", help="run a simulated fleet from a fleet file")
    fleet.add_argument("--fleet-file", required=True)
    fleet.add_argument("--portal-url", dest="portal_url")
    fleet.add_argument(
        "--allow-insecure-http",
        dest="allow_insecure_http",
        action="store_true",
        help="accept an http:// portal URL that is not on loopback (GPUPOOL_ALLOW_INSECURE_HTTP=1)",
    )
    fleet.add_argument("--state-root", default="var/agents")
    fleet.add_argument("--heartbeat-interval", dest="heartbeat_interval_s", type=float)
    fleet.add_argument("--log-level", default="INFO")
    return parser


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(AgentConfig)}
    values = {name: value for name, value in vars(args).items() if name in names}
    if args.labels:
        values["labels"] = ",".join(args.labels)
    return values


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


async def _run_with_signals(target: Any) -> Any:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, target.request_stop)
    try:
        return await target.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


EVENT_LOOPS = ("uvloop", "asyncio")


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's (installed with the portal's uvicorn[standard]) unless ``GPUPOOL_EVENT_LOOP=asyncio``
    or uvloop is missing; None: asyncio's. The agent is timers, sockets and HTTP, and a fleet
    process of the simulated fleet runs a hundred agents' of them."""
    choice = os.environ.get("GPUPOOL_EVENT_LOOP", "uvloop")
    if choice not in EVENT_LOOPS:
        raise ConfigError(f"GPUPOOL_EVENT_LOOP: one of {', '.join(EVENT_LOOPS)}, not {choice!r}")
    if choice == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.info("uvloop is not installed: running on asyncio's event loop")
        else:
            return uvloop.new_event_loop
    return None


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the event loop of ``event_loop_factory``."""
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(main)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv.insert(0, "run")
    args = build_parser().parse_args(argv)
    try:
        event_loop_factory()
    except ConfigError as exc:
        print(f"gpupool-agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG

    if args.command == "fleet":
        from nodes.agent.fleet import Fleet

        _setup_logging(args.log_level)
        try:
            allow_insecure_http = (
                args.allow_insecure_http
                or load_config(
                    env={"GPUPOOL_ALLOW_INSECURE_HTTP": os.environ.get("GPUPOOL_ALLOW_INSECURE_HTTP", "")}
                ).allow_insecure_http
            )
        except ConfigError as exc:
            print(f"gpupool-agent: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        fleet = Fleet(
            args.fleet_file,
            portal_url=args.portal_url,
            allow_insecure_http=allow_insecure_http,
            state_root=args.state_root,
            heartbeat_interval_s=args.heartbeat_interval_s,
        )
        try:
            failed = run_event_loop(_run_with_signals(fleet))
        except ConfigError as exc:
            print(f"gpupool-agent: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        return EXIT_ERROR if failed else EXIT_OK

    try:
        config = load_config(cli=cli_values(args), config_file=args.config)
        if args.command == "show-config":
            shown = dataclasses.asdict(config.validate())
            if shown["bootstrap_token"]:
                shown["bootstrap_token"] = shown["bootstrap_token"][:8] + "..."
            print(json.dumps(shown, indent=2, sort_keys=True))
            return EXIT_OK
        _setup_logging(config.log_level)
        from nodes.agent.agent import Agent, FatalAgentError

        agent = Agent(config)
    except (ConfigError, CollectorUnavailable) as exc:
        print(f"gpupool-agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        run_event_loop(_run_with_signals(agent))
    except (FatalAgentError, CollectorUnavailable) as exc:
        print(f"gpupool-agent: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
