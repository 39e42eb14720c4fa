"""What the server's start-up does in which order to get the demo model ready in
under 3 s on two cores (docs/benchmarks.md, "P15: server start"): the collector
frozen after a serving process's start-up, a held rank importing its model's
configuration class while the server checks, and a held runtime's detokenizer
spawned only at release."""

from __future__ import annotations

import gc
import pickle
import subprocess
import sys

import pytest

from radixserve.config import ServerArgs
from radixserve.runtime.processes.spawn import spawn_runtime, wait_until_ready
from radixserve.startup_gc import gc_paused


@pytest.fixture
def unfrozen():
    """The test process's collector as it was: nothing left frozen."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_collector_is_paused_inside_and_freezes_only_when_asked_and_the_block_succeeds(unfrozen):
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), gc_paused(freeze=True):
        raise RuntimeError("start-up failed")
    assert gc.isenabled() and gc.get_freeze_count() == 0  # a failed start freezes nothing
    with gc_paused(freeze=True):
        pass
    assert gc.isenabled() and gc.get_freeze_count() > 0  # what the process holds is frozen


def test_importing_the_config_class_leaves_unpickling_the_plans_config_nothing_to_import(tiny_llama_dir, tmp_path):
    from transformers import AutoConfig

    pickled = pickle.dumps(AutoConfig.from_pretrained(tiny_llama_dir))
    blob = tmp_path / "config.pickle"
    blob.write_bytes(pickled)
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text('{"model_type": "no-such-model-type"}')
    code = (
        "import pickle, sys\n"
        "from transformers import AutoTokenizer\n"  # what a rank has imported when it is held
        "from radixserve.checkpoints.loader import import_config_class\n"
        f"import_config_class({str(unknown)!r})\n"  # an unknown type: left to the plan's own load, no error
        f"import_config_class({str(tmp_path / 'missing')!r})\n"  # no config.json (a hub id not downloaded yet)
        f"import_config_class({str(tiny_llama_dir)!r})\n"
        "before = set(sys.modules)\n"
        f"config = pickle.loads(open({str(blob)!r}, 'rb').read())\n"
        "print(type(config).__name__, sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "LlamaConfig []", out.stdout + out.stderr


def test_a_held_runtime_spawns_its_detokenizer_at_release(tiny_llama_dir):
    args = ServerArgs(model_path=str(tiny_llama_dir), backend_selection="priority")
    started = spawn_runtime(args, str(tiny_llama_dir), held=True)
    runtime = started.runtime
    try:
        assert [p.name for p in runtime.processes] == ["scheduler"]
        runtime.release()
        assert [p.name for p in runtime.processes] == ["scheduler", "detokenizer"]
        wait_until_ready(runtime, started.ready)
        assert runtime.summary["architecture"] == "LlamaForCausalLM"
        assert all(p.is_alive() for p in runtime.processes)
    finally:
        runtime.shutdown()
    assert not any(p.is_alive() for p in runtime.processes)
