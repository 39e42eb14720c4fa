"""Skipping tests that need a device platform, with the platform's own reason;
`radixserve plugins --json` as a user runs it; greedy tokens on a device, to
compare with the CPU's."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from generation_utils import mixed_prompts

from radixserve import Engine
from radixserve.registry import PluginError, get_registry


def platform_unavailable(name: str) -> str | None:
    """Why the registered platform ``name`` cannot run on this machine (None: it can)."""
    try:
        get_registry().resolve_platform(name)
    except PluginError as exc:
        return str(exc).splitlines()[0]
    return None


def needs_platform(name: str) -> pytest.MarkDecorator:
    """Skips a test where platform ``name`` cannot run, saying why."""
    reason = platform_unavailable(name)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def plugins_json(env: dict[str, str] | None = None) -> dict:
    """What `radixserve plugins --json` reports, run in a fresh process (environment ``env``, default this one's)."""
    command = [sys.executable, "-m", "radixserve.cli", "plugins", "--json"]
    return json.loads(subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout)


@functools.cache
def installed_plugins_report() -> dict:
    """`radixserve plugins --json` as a user runs it here (no allow-list, no
    interpreter opt-in): the installed plugins, run once and shared by the
    hardware plugins' tests, which each read their own rows. Nothing a test
    does in this process can change it (it is another process); a test that
    installs or puts a plugin on the path asks ``plugins_json`` itself."""
    return plugins_json({k: v for k, v in os.environ.items() if k not in ("RADIXSERVE_PLUGINS", "TRITON_INTERPRET")})


def greedy_tokens_on(device: str, model_dir: Path) -> list[list[int]]:
    """Greedy tokens of three prompts (a shared prefix, page size 16, float32) on ``device``."""
    prompts = mixed_prompts(512, [5, 30, 17], seed=7, shared_prefix=8)
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    with Engine(
        model_path=str(model_dir),
        device=device,
        dtype="float32",
        max_total_tokens=4096,
        page_size=16,
        log_level="warning",
    ) as engine:
        assert engine.server_info()["platform"] == device
        return [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
