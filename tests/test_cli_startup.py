"""Start-up errors through the CLI, as an operator sees them: a line naming the
problem and a hint, a non-zero exit, no traceback at the default log level, and
no "listening at" when the check could run before the server started.

Each kind of failure runs ``python -m radixserve.cli`` as a user does (a parser
error, a model directory check, a platform or plugin check, a port, a child that
fails to load); checks that only vary a name the registry rejects run
``cli.main`` in this process (conftest's ``cli_in_process``), which is the same
code without a second torch import."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from test_plugins import make_dist

from radixserve import __version__
from radixserve.checkpoints.random_eagle import build_random_eagle3_head

MAX_LINES = 5  # "at most a few lines"


def run_cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RADIXSERVE_PLUGINS")}
    out = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", *argv],
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out.returncode, out.stdout + out.stderr


def assert_short_failure(code: int, output: str, *expected: str) -> None:
    assert code != 0, output
    for text in expected:
        assert text in output, output
    assert "Traceback" not in output, output
    assert "listening at" not in output, output
    assert len(output.strip().splitlines()) <= MAX_LINES, output


def test_version():
    code, output = run_cli("--version")
    assert code == 0 and output.strip() == f"radixserve {__version__}"


def test_unknown_device():
    code, output = run_cli("serve", "--device", "nope")
    assert_short_failure(code, output, "--device 'nope' is not a registered platform", "cpu", "radixserve plugins")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine can run cuda")
def test_known_but_unusable_device_gives_the_platform_reason(cli_in_process):
    code, output = cli_in_process("serve", "--device", "cuda")
    assert_short_failure(code, output, "--device 'cuda'", "is not usable here", "not a CUDA build")


def test_missing_model_path(tmp_path):
    code, output = run_cli("serve", "--model", str(tmp_path / "nope"))
    assert_short_failure(code, output, "is not a directory", "--model takes")


def test_model_directory_without_config_json(tmp_path):
    code, output = run_cli("serve", "--model", str(tmp_path))
    assert_short_failure(code, output, "has no config.json")
    assert "sentencepiece" not in output


def test_model_directory_without_weights(tiny_llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    code, output = run_cli("serve", "--model", str(model))
    assert_short_failure(code, output, "no safetensors checkpoint")


def test_model_directory_without_tokenizer(tiny_llama_dir, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, model / name)
    code, output = run_cli("serve", "--model", str(model))
    assert_short_failure(code, output, "has no tokenizer files", "--tokenizer-path")


def test_unknown_backend_names(cli_in_process):
    code, output = cli_in_process("serve", "--attention-backend", "nope")
    assert_short_failure(
        code, output, "--attention-backend 'nope' is not a registered attention backend", "torch_native"
    )
    code, output = cli_in_process("serve", "--gemm-backend", "nope")
    assert_short_failure(code, output, "--gemm-backend 'nope'")


def test_unknown_grammar_backend(cli_in_process):
    code, output = cli_in_process("serve", "--grammar-backend", "nope")
    assert_short_failure(code, output, "unknown grammar backend 'nope'", "xgrammar", "llguidance")


def test_unknown_reasoning_parser(cli_in_process):
    code, output = cli_in_process("serve", "--reasoning-parser", "nope")
    assert_short_failure(
        code, output, "--reasoning-parser 'nope' is not a registered reasoning parser", "deepseek-r1, qwen3"
    )


def test_unknown_speculative_algorithm(cli_in_process):
    code, output = cli_in_process("serve", "--speculative-algorithm", "eagle9")
    assert_short_failure(
        code, output, "--speculative-algorithm 'eagle9' is not a registered speculative proposer", "ngram"
    )


def test_a_draft_or_eagle_proposer_without_its_model(cli_in_process, tmp_path):
    code, output = cli_in_process("serve", "--speculative-algorithm", "draft")
    assert_short_failure(code, output, "speculative_draft_model_path: --speculative-algorithm draft runs a draft model")
    code, output = cli_in_process(
        "serve", "--speculative-algorithm", "draft", "--speculative-draft-model-path", "/nope"
    )
    assert_short_failure(code, output, "speculative_draft_model_path:", "/nope")
    code, output = cli_in_process("serve", "--speculative-algorithm", "eagle")
    assert_short_failure(code, output, "speculative_eagle_path: --speculative-algorithm eagle runs an EAGLE head")
    code, output = cli_in_process("serve", "--speculative-algorithm", "eagle", "--speculative-eagle-path", "/nope")
    assert_short_failure(code, output, "speculative_eagle_path:", "/nope")


def test_an_eagle_head_as_the_model_stops_the_start(cli_in_process, tiny_llama_dir, tmp_path):
    """Before anything loads: an EAGLE head runs only attached to its target."""
    head = build_random_eagle3_head(tiny_llama_dir, tmp_path / "head", draft_vocab_size=64, layer_ids=[0, 1, 1])
    code, output = cli_in_process("serve", "--model", str(head), "--tokenizer-path", str(tiny_llama_dir))
    assert_short_failure(
        code, output, "is an EAGLE head, which drafts for its target model", "--speculative-eagle-path"
    )


def test_an_adapter_that_cannot_be_served_stops_the_start(cli_in_process, tiny_llama_dir, tmp_path):
    from radixserve.checkpoints.random_adapter import build_random_adapter

    wide = build_random_adapter(tiny_llama_dir, tmp_path / "wide", rank=16, target_modules=("q_proj",))
    model = ("serve", "--model", str(tiny_llama_dir), "--enable-lora")
    code, output = cli_in_process(*model, "--lora-paths", f"wide={wide}", "--max-lora-rank", "8")
    assert_short_failure(code, output, "lora_paths: adapter 'wide' has rank 16, above --max-lora-rank 8", "PEFT")
    code, output = cli_in_process(*model, "--lora-paths", f"gone={tmp_path / 'gone'}")
    assert_short_failure(code, output, "lora_paths:", "has no adapter_config.json")
    code, output = cli_in_process("serve", "--lora-paths", f"wide={wide}")
    assert_short_failure(code, output, "lora_paths: needs --enable-lora")


def test_backend_that_cannot_serve_the_model(tiny_llama_dir):
    if torch.cuda.is_available():
        pytest.skip("triton can serve here")
    code, output = run_cli("serve", "--model", str(tiny_llama_dir), "--attention-backend", "triton")
    assert_short_failure(code, output, "attention backend 'triton'", "cannot serve", "TRITON_INTERPRET")


def test_broken_plugin(tmp_path):
    make_dist(
        tmp_path,
        "radixserve-broken",
        "broken",
        "broken_plugin",
        "raise ImportError('libfancy.so.3: cannot open shared object file')\n",
    )
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code, output = run_cli("serve", env=env)
    assert_short_failure(
        code, output, "plugin broken failed to load", "libfancy.so.3", "--device auto refuses to guess"
    )


def test_port_in_use_names_it_and_hints_port_0():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, output = run_cli("serve", "--port", str(port))
    assert_short_failure(code, output, f"127.0.0.1:{port}", "already in use", "--port 0")


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--port", "70000"], "port: must be in [0, 65535]"),
        (["--page-size", "0"], "page_size: must be >= 1"),
        (["--shutdown-timeout", "-1"], "shutdown_timeout: must be >= 0"),
        (
            ["--speculative-algorithm", "ngram", "--no-disable-overlap-schedule"],
            "disable_overlap_schedule: speculative decoding runs its steps without overlap",
        ),
    ],
)
def test_bad_flag_values_are_argument_errors(argv, expected):
    code, output = run_cli("serve", *argv)
    assert code == 2
    assert_short_failure(code, output, expected)


def test_debug_level_shows_the_traceback():
    code, output = run_cli("serve", "--device", "nope", "--log-level", "debug")
    assert code == 1 and "Traceback" in output and "is not a registered platform" in output


def test_weights_that_fail_to_load_are_one_line_from_the_parent(tiny_llama_dir, tmp_path):
    """Only the scheduler can find this one (after "listening at"): the parent
    reports it in one line, and neither process prints a traceback."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    for weights in model.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    code, output = run_cli("serve", "--port", "0", "--model", str(model), timeout=300)
    assert code == 1, output
    assert "startup failed: the scheduler failed to start: SafetensorError: " in output
    assert "Traceback" not in output, output
    assert "ready at" not in output
