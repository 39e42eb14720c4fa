"""Shared fixtures: tiny on-the-fly models (see radixserve.testing.tiny_models),
their tokenizer, an offline Engine, a plain server on the tiny Llama and the
servers that several modules share (helpers_shared_servers), an httpx client
of a module's own ``server``, and ``radixserve`` commands that fail before any
child starts, run in this process (``cli_in_process``)."""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers_server import ServerProcess, SharedServer, serving
from helpers_shared_servers import GUARDED_FLAGS, SINGLE_SLOT_FLAGS
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixserve import Engine, cli, registry
from radixserve.process_exit import exit_code
from radixserve.testing.tiny_models import build_tiny_model


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's own RADIXSERVE_CACHE_DIR (backend timings, the demo model), which
    every process it starts inherits: what ``auto`` chose in an earlier run on this
    machine (perhaps timed under another load) never decides a test, and a test
    run never leaves timings in the user's cache."""
    path = tmp_path_factory.mktemp("radixserve-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RADIXSERVE_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``build(**build_tiny_model_kwargs) -> model dir``, built once per session
    for each distinct set of arguments."""
    built: dict[str, Path] = {}

    def build(**kwargs: Any) -> Path:
        key = repr(sorted(kwargs.items()))
        if key not in built:
            built[key] = build_tiny_model(tmp_path_factory.mktemp(kwargs.get("arch", "llama")), **kwargs)
        return built[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    """The default tiny Llama with its tokenizer."""
    return tiny_model_factory(arch="llama")


@pytest.fixture(scope="session")
def long_llama_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    """The tiny Llama with a 32768-token context: room for requests that cannot finish while a test works."""
    return tiny_model_factory(arch="llama", max_position_embeddings=32768)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="session")
def engine(tiny_llama_dir: Path) -> Iterator[Engine]:
    """The offline Engine on the tiny Llama, shared by every module that only generates and profiles."""
    with Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, log_level="warning") as eng:
        yield eng


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    """A plain `radixserve serve` of the tiny Llama (served as "tiny"), for the
    modules that need no flag of their own. The pool holds dozens of requests
    of hundreds of tokens at once (test_structured_output's 60 at a time)."""
    with serving(tiny_llama_dir, "--max-total-tokens", "65536") as srv:
        yield srv


@pytest.fixture(scope="session")
def single_slot_servers(long_llama_dir: Path) -> Iterator[SharedServer]:
    """test_queue's and test_shutdown's server (helpers_shared_servers), on the long-context Llama."""
    shared = SharedServer(long_llama_dir, *SINGLE_SLOT_FLAGS)
    yield shared
    shared.close()


@pytest.fixture(scope="session")
def guarded_servers(tiny_llama_dir: Path) -> Iterator[SharedServer]:
    """test_server_api's and test_hostile_inputs' server (helpers_shared_servers)."""
    shared = SharedServer(tiny_llama_dir, *GUARDED_FLAGS)
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    """An httpx client of the module's ``server`` fixture, with its API key if it has one."""
    with httpx.Client(base_url=server.url, headers=server.auth_headers, timeout=120) as client:
        yield client


# -- the CPU kernels (plugins/radixserve_torch/cpu_kernels.py) ----------------


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built() -> None:
    """Build (first run on a machine) or load the CPU kernels once, before any test
    starts a server or scheduler that would pick them (they are the cpu defaults)."""
    from radixserve_torch import cpu_kernels

    if not cpu_kernels.unavailable_reasons():
        cpu_kernels.load()


@pytest.fixture
def without_installed_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as in an installation that holds no compiled CPU kernels (installed
    without torch in its build, or the sources edited since): they are built on first use."""
    from radixserve_torch import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "installed_library", lambda name, cflags: None)


# -- the CLI in this process ------------------------------------------------------


@pytest.fixture
def cli_in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> Callable[..., tuple[int, str]]:
    """``test_cli_startup.run_cli`` for a ``serve`` that fails in the parent
    before any child starts (a name the registry rejects, a platform that is not
    usable here), as ``radixserve.cli.main(argv)`` in this process: the same
    code without a second torch import. It gets the environment ``run_cli``
    gives (no allow-list, no interpreter opt-in), a registry of its own built
    from it, and an empty cache directory (no demo model at hand, so nothing is
    spawned); this process's logging is set back after each command."""
    for name in ("TRITON_INTERPRET", "RADIXSERVE_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(registry, "_registry", None)

    def run(*argv: str) -> tuple[int, str]:
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level  # the command configures logging (force=True)
        capsys.readouterr()
        children = set(multiprocessing.active_children())  # the session's Engine may have its own
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:
            code = exit_code(exc)
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
        out = capsys.readouterr()
        assert set(multiprocessing.active_children()) <= children, "the command left a child process"
        return code, out.out + out.err

    return run
