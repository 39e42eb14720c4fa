"""``radixserve serve | plugins``: one entry point, flags straight from ServerArgs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from radixserve.config import ServerArgs


def _print_plugins(as_json: bool) -> int:
    from radixserve.registry import PluginRegistry

    report = PluginRegistry().report()
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
    print(f"\nBackends (usability checked for device {report['device_checked']!r}):")
    for kind, rows in report["backends"].items():
        print(f"  {kind}:")
        for row in rows:
            usable = row.get("usable")
            mark = "" if usable is None else ("usable" if usable else "not usable: " + "; ".join(row["reasons"]))
            print(f"      {row['name']:<20} [{row['plugin']}] {mark}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="radixserve", description="A fast LLM inference server.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server")
    ServerArgs.add_cli_args(serve)
    plugins = sub.add_parser("plugins", help="list plugins, their backends, and what is usable here")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    ns = parser.parse_args(argv)
    if ns.command == "plugins":
        return _print_plugins(ns.json)
    if ns.command == "serve":
        from radixserve.server.http import run_server

        try:
            args = ServerArgs.from_cli_args(ns)
        except ValueError as exc:
            parser.error(str(exc))
        return run_server(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
