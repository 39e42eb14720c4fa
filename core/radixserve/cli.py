"""``radixserve serve | router | plugins | bench | --version``: one entry point, flags straight
from ServerArgs (serve) and RouterArgs (router)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import NoReturn

from radixserve.bench.args import add_bench_parser
from radixserve.checkpoints.source import open_gguf_model
from radixserve.config import ServerArgs
from radixserve.process_exit import exit_code, exit_now
from radixserve.router.args import RouterArgs
from radixserve.version import __version__


def _print_plugins(as_json: bool) -> int:
    from radixserve.backend_timing import cache_dir, report_cached
    from radixserve.registry import PluginRegistry

    registry = PluginRegistry()
    report = registry.report()
    device = report["device_checked"]
    report["timings"] = report_cached(registry.resolve_platform(device)()) if device else []
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print("Plugins:")
    for plugin in report["plugins"]:
        origin = f"{plugin['distribution']} {plugin['version']}" if plugin["distribution"] else "built in"
        status = "FAILED" if plugin["error"] else "ok"
        print(f"  {plugin['name']:<22} {status:<7} {origin}  ({plugin['module']})")
        if plugin["hooks"]:
            print(f"      hooks: {', '.join(plugin['hooks'])}")
        if plugin["error"]:
            for line in plugin["error"].splitlines():
                print(f"      ! {line}")
    print(
        f"\nBackends (usability checked for device {device!r}; auto times the usable ones on the model's "
        f"shapes and picks the fastest, priority breaking ties):"
    )
    for kind, rows in report["backends"].items():
        print(f"  {kind}:")
        for row in rows:
            usable = row.get("usable")
            mark = "" if usable is None else ("usable" if usable else "not usable: " + "; ".join(row["reasons"]))
            priority = f"priority {row['priority']:<4}" if "priority" in row else ""
            print(f"      {row['name']:<20} {priority:<13} [{row['plugin']}] {mark}")
    print(f"\nBackend timings measured on this machine (cached in {cache_dir()}):")
    for row in report["timings"]:
        print(f"  {row['kind']}: {row['chosen']} for {row['query']} ({row['measured_at']})\n      {row['figures']}")
    if not report["timings"]:
        print("  none yet: the first start of a model measures them")
    return 0


def _serve(args: ServerArgs) -> int:
    """Check what can be checked here, then serve (node 0) or run this node's
    ranks (``--node-rank`` > 0); a start-up error is a line and a hint on stderr
    (the traceback too with ``--log-level debug``).

    Node 0 checks the model and tokenizer directories first (stats only, so a
    mistyped path fails before torch is imported or a child starts), then spawns
    a lone scheduler (and the detokenizer), held until the other checks pass
    and the backends are built, and the HTTP server (FastAPI, uvicorn) is
    imported after: the scheduler imports torch and loads the model meanwhile.
    A runtime of several model processes is spawned once the checks pass (their
    environment comes from the platform). A failed check stops the runtime at
    once."""
    from radixserve.logging_utils import configure_logging
    from radixserve.server.listen import bind_socket
    from radixserve.startup_checks import (
        build_backends,
        check_args,
        check_model,
        check_sources,
        check_startup,
        needs_model_build,
        start_runtime,
    )
    from radixserve.startup_error import StartupError
    from radixserve.startup_gc import gc_paused

    configure_logging(args.log_level, prefix="server" if args.node_rank == 0 else f"node{args.node_rank}")
    try:
        if args.node_rank > 0:
            from radixserve.runtime.processes.worker_node import serve_worker_node

            build_backends(check_startup(args))
            return serve_worker_node(args)
        check_sources(args)  # before anything spawns or imports torch: a wrong path fails in a blink
        with gc_paused(freeze=True):
            started = start_runtime(args)
            try:
                platform = check_args(args)
                query, plan = check_model(args, platform)
                sock = bind_socket(args.host, args.port)
                build_backends(query)
                if started is not None and not needs_model_build(args):  # else the server's boot releases it
                    started.runtime.release(plan)
            except BaseException:
                if started is not None:
                    started.runtime.shutdown(grace_s=0)  # none of it has read the model
                raise
            if started is None:
                started = start_runtime(args, platform, plan)
            from radixserve.server.http import run_server
        return run_server(args, sock, started)
    except StartupError as exc:
        logging.getLogger("radixserve.cli").debug("start-up error", exc_info=True)
        print(f"radixserve: error: {exc}", file=sys.stderr)
        if exc.hint:
            print(f"radixserve: hint: {exc.hint}", file=sys.stderr)
        return 1


def _route(args: RouterArgs) -> int:
    from radixserve.logging_utils import configure_logging
    from radixserve.router.app import run_router
    from radixserve.startup_error import StartupError

    configure_logging(args.log_level, prefix="router")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health check otherwise
    try:
        return run_router(args)
    except StartupError as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        if exc.hint:
            print(f"radixserve: hint: {exc.hint}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixserve", description="A fast LLM inference server.")
    parser.add_argument("--version", action="version", version=f"radixserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # A short usage line, so that a bad flag value is reported in two lines, not forty.
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server", usage="radixserve serve [options]")
    ServerArgs.add_cli_args(serve)
    router = sub.add_parser(
        "router", help="one OpenAI endpoint in front of several workers", usage="radixserve router [options]"
    )
    RouterArgs.add_cli_args(router)
    plugins = sub.add_parser("plugins", help="list plugins, their backends, and what is usable here")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    add_bench_parser(sub)
    ns = parser.parse_args(argv)
    if ns.command == "plugins":
        return _print_plugins(ns.json)
    if ns.command == "bench":
        from radixserve.bench.cli import check_args, run_bench

        try:
            check_args(ns)
        except ValueError as exc:
            parser.error(str(exc))
        return run_bench(ns)
    if ns.command == "router":
        try:
            router_args = RouterArgs.from_cli_args(ns)
        except ValueError as exc:
            router.error(str(exc))
        return _route(router_args)
    if ns.command == "serve":
        from radixserve.multinode_env import apply_launcher_env

        try:
            args, placement = apply_launcher_env(ServerArgs.from_cli_args(ns), os.environ)
            args = open_gguf_model(args)
        except ValueError as exc:
            serve.error(str(exc))
        if placement is not None:
            print(f"radixserve: placed by the launcher's environment: {placement.describe()}", file=sys.stderr)
        return _serve(args)
    return 2


def run() -> NoReturn:
    """The ``radixserve`` command: ``main``, then the process ends without the
    interpreter's teardown (``process_exit``: half a second once torch is loaded)."""
    try:
        code = main()
    except SystemExit as exc:
        code = exit_code(exc)
    exit_now(code)


if __name__ == "__main__":
    run()
