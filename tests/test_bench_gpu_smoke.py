"""benchmarks/bench_gpu.py end to end on the CPU with a tiny model (``--shape
tiny --device cpu``): the same code path as the GPU run, at toy sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_gpu_runs_end_to_end_on_cpu():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_gpu.py"),
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--json",
            "--profile",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    table = "\n".join(lines[:-1])
    rows = {row["name"]: row for row in report["rows"]}
    assert list(rows) == [
        "batch 1, 16-token prompt -> 8",
        "batch 4, prompts 8-32 -> 8",
        "batch 8, prompts 8-32 -> 8",
        "shared prefix 2x4 (64 + 8 -> 4), radix on",
        "shared prefix 2x4 (64 + 8 -> 4), radix off",
        "radix on / off",
        "HF generate, batch 1, 16 -> 8, static cache",
    ]
    for name, row in rows.items():
        assert row["graphs"] is not None and row["graphs"] > 0, name
        assert name in table
    # The cpu platform captures no graphs, so the eager engine is not started twice.
    assert all(row["eager"] is None for row in rows.values())
    assert "graphs off (platform 'cpu' has no graph capture)" in rows["batch 1, 16-token prompt -> 8"]["note"]
    # Every shared-prefix request after the first of its group hits the radix cache.
    assert "cache hit rate" in rows["shared prefix 2x4 (64 + 8 -> 4), radix on"]["note"]
    assert report["device"].startswith("cpu") and report["backends"]["attention"]
    assert report["shape_config"]["vocab_size"] == 512
    # --profile: the batch-1 latency run and the first throughput batch, each on its own trace; the
    # cpu platform records host ops only, so there is no device-busy fraction.
    for size in (1, 4):
        prof = report[f"decode_bs{size}"]
        assert prof["steps"] >= 2 and prof["step_ms_median"] > 0 and prof["device_busy_fraction"] is None
        assert Path(prof["trace"]).is_file()
        assert f"profile, decode at batch {size} (" in table


def test_model_build_writes_a_loadable_sharded_checkpoint(tmp_path, monkeypatch):
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "SHARD_BYTES", 40_000)  # several shards even for the tiny model
    shape = bench.SHAPES["tiny"]
    model_dir = bench.build_model(tmp_path / "m", shape, torch.device("cpu"), torch.bfloat16)

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((model_dir / f).is_file() for f in files)
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    assert set(index["weight_map"]) == set(model.state_dict())
    weight = model.model.layers[0].mlp.up_proj.weight
    assert weight.dtype == torch.bfloat16 and 0.015 < float(weight.detach().float().std()) < 0.025
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tok) == shape.vocab_size and tok.eos_token_id == model.config.eos_token_id
    ids = tok.encode("w7 w300 w511", add_special_tokens=False)
    assert ids == [7, 300, 511] and tok.decode(ids) == "w7 w300 w511"
