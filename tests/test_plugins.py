"""The plugin contract: discovery through entry points, kept load errors,
selection with reasons, allow-list, and rejection of misspelt hooks."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest
import torch
from helpers_platform import plugins_json

from radixserve.hooks import hookimpl
from radixserve.kernels import KernelQuery
from radixserve.registry import PluginError, PluginRegistry
from radixserve_torch.attention import TorchNativeAttention

QUERY = KernelQuery(device="cpu", dtype=torch.float32, head_dim=64, num_heads=4, num_kv_heads=2)


class Fp16OnlyAttention(TorchNativeAttention):
    name = "fp16_only"
    priority = 50

    @classmethod
    def unsupported_reasons(cls, query: KernelQuery) -> list[str]:
        return [] if query.dtype == torch.float16 else [f"dtype {query.dtype} is not float16"]


class FirstChoiceAttention(TorchNativeAttention):
    name = "first_choice"
    priority = 10


class AttentionPlugin:
    @hookimpl
    def register_attention_backends(self, register):
        register(Fp16OnlyAttention)
        register(FirstChoiceAttention)


def make_dist(root: Path, dist: str, entry_name: str, module: str, source: str) -> None:
    """A minimal installed distribution on a path: dist-info with an entry point."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[radixserve]\n{entry_name} = {module}\n")


def plugins_json_with(extra_path: Path, **env: str) -> dict:
    """`radixserve plugins --json` with ``extra_path`` on the import path."""
    return plugins_json(
        {**os.environ, "PYTHONPATH": f"{extra_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env}
    )


def test_torch_plugin_found_through_entry_point():
    report = PluginRegistry().report()
    torch_plugin = next(p for p in report["plugins"] if p["name"] == "torch")
    assert torch_plugin["distribution"] == "radixserve"
    assert torch_plugin["registered"]["attention"] == ["torch_native", "torch_varlen", "cpu_paged", "torch_mla"]
    assert {"none", "int8"} <= set(torch_plugin["registered"]["quantization"])
    cpu = next(row for row in report["backends"]["platform"] if row["name"] == "cpu")
    assert cpu == {"name": "cpu", "plugin": "torch", "priority": 0, "usable": True, "reasons": []}


def test_registered_plugin_backend_selected_by_name_and_by_priority():
    registry = PluginRegistry()
    registry.register_plugin(AttentionPlugin(), "test-attention")
    assert registry.select("attention", QUERY, "first_choice") is FirstChoiceAttention
    # auto: fp16_only has the highest priority but rejects float32, so first_choice wins
    assert registry.select("attention", QUERY) is FirstChoiceAttention
    fp16 = KernelQuery(device="cpu", dtype=torch.float16, head_dim=64, num_heads=4, num_kv_heads=2)
    assert registry.select("attention", fp16) is Fp16OnlyAttention
    registry.unregister_plugin("test-attention")
    assert registry.select("attention", QUERY).name == "cpu_paged"  # the torch plugin's fast path (priority 7)


def test_forcing_an_unsupported_backend_names_the_reason():
    registry = PluginRegistry()
    registry.register_plugin(AttentionPlugin(), "test-attention")
    with pytest.raises(PluginError, match=r"fp16_only.*dtype torch.float32 is not float16"):
        registry.select("attention", QUERY, "fp16_only")
    with pytest.raises(PluginError, match=r"unknown attention backend 'nope'.*torch_native"):
        registry.select("attention", QUERY, "nope")


def test_misspelt_hookimpl_is_rejected():
    class Misspelt:
        @hookimpl
        def register_attention_backend(self, register):  # missing "s"
            register(FirstChoiceAttention)

    registry = PluginRegistry()
    info = registry.register_plugin(Misspelt(), "misspelt")
    assert info.error is not None and "register_attention_backend" in info.error
    assert "first_choice" not in registry.candidates["attention"]


def test_registration_error_is_kept_not_swallowed():
    class Broken:
        @hookimpl
        def register_gemm_backends(self, register):
            raise RuntimeError("kernel library missing symbol")

    registry = PluginRegistry()
    registry.register_plugin(Broken(), "broken")
    assert "kernel library missing symbol" in registry.load_errors()["broken"]


def test_import_failure_is_reported_by_cli(tmp_path):
    make_dist(
        tmp_path,
        "radixserve-plugin-broken",
        "broken",
        "broken_plugin",
        "raise ImportError('libfancy.so: cannot open shared object file')\n",
    )
    report = plugins_json_with(tmp_path)
    broken = next(p for p in report["plugins"] if p["name"] == "broken")
    assert broken["distribution"] == "radixserve-plugin-broken"
    assert broken["version"] == "1.2.3"
    assert "libfancy.so" in broken["error"]
    # The healthy plugin is still there and usable.
    assert any(p["name"] == "torch" and p["error"] is None for p in report["plugins"])


def test_third_party_platform_and_backend_from_entry_point(tmp_path):
    make_dist(
        tmp_path,
        "radixserve-plugin-fakeaccel",
        "fakeaccel",
        "fakeaccel_plugin",
        """
        from radixserve.hooks import hookimpl
        from radixserve.platform import Platform

        class FakeAccel(Platform):
            name = "fakeaccel"
            priority = 100
            @classmethod
            def unavailable_reasons(cls):
                return ["no fakeaccel devices found (FAKEACCEL_VISIBLE_DEVICES is empty)"]

        @hookimpl
        def register_platforms(register):
            register(FakeAccel)
    """,
    )
    report = plugins_json_with(tmp_path)
    row = next(r for r in report["backends"]["platform"] if r["name"] == "fakeaccel")
    assert row == {
        "name": "fakeaccel",
        "plugin": "fakeaccel",
        "priority": 100,
        "usable": False,
        "reasons": ["no fakeaccel devices found (FAKEACCEL_VISIBLE_DEVICES is empty)"],
    }
    # The allow-list hides it.
    report = plugins_json_with(tmp_path, RADIXSERVE_PLUGINS="torch")
    builtin = (
        "radixserve-models",
        "radixserve-grammar",
        "radixserve-kv-transfer",
        "radixserve-speculative",
        "radixserve-tool-parsers",
        "radixserve-reasoning-parsers",
    )
    assert [p["name"] for p in report["plugins"] if p["name"] not in builtin] == ["torch"]


def test_device_resolution_is_loud(monkeypatch):
    registry = PluginRegistry()
    assert registry.resolve_platform("cpu").name == "cpu"
    # With the CUDA plugin installed and usable, auto rightly picks it; pin the
    # check to the reference plugin so it holds on any machine.
    monkeypatch.setenv("RADIXSERVE_PLUGINS", "torch")
    assert PluginRegistry().resolve_platform("auto").name == "cpu"
    monkeypatch.delenv("RADIXSERVE_PLUGINS")
    with pytest.raises(PluginError, match=r"--device 'tpu' is not a registered platform; available: .*cpu"):
        registry.resolve_platform("tpu")


def test_device_auto_refuses_to_guess_when_a_plugin_failed():
    class Broken:
        @hookimpl
        def register_platforms(self, register):
            raise ImportError("libcudart.so.13 not found")

    registry = PluginRegistry()
    registry.register_plugin(Broken(), "radixserve-cuda")
    with pytest.raises(PluginError, match=r"(?s)refuses to guess.*radixserve-cuda.*libcudart"):
        registry.resolve_platform("auto")
    # Naming the device explicitly still works.
    assert registry.resolve_platform("cpu").name == "cpu"


def test_cuda_plugin_is_listed_with_why_it_is_unusable_here():
    """hardware/cuda is installed by the test command; on a CPU-only machine it
    must say why it cannot run, and never be picked silently or fallen back from."""
    registry = PluginRegistry()
    cuda = registry.plugins["cuda"]
    assert cuda.error is None and cuda.distribution == "radixserve-plugin-cuda"
    reasons = registry.candidates["platform"]["cuda"].cls.unavailable_reasons()
    if torch.cuda.is_available():
        pytest.skip("this machine has a usable CUDA device")
    assert reasons, "a CPU-only machine must give a reason"
    with pytest.raises(
        PluginError, match=re.escape(f"--device 'cuda' (plugin 'cuda') is not usable here: {reasons[0]}")
    ):
        registry.resolve_platform("cuda")
    assert registry.resolve_platform("auto").name == "cpu"


def test_quantization_is_never_auto_selected():
    from radixserve.config import ServerArgs

    with pytest.raises(ValueError, match="quantization: is never chosen automatically"):
        ServerArgs(quantization="auto")
