"""benchmarks/compare_vllm_cpu.py's table: each round of radixserve paired with the
other engine's run of the same round, the median of their ratios, and the radix
cache's on/off ratio. The results file is the one `radixserve bench --output-file`
and the vLLM replay append to."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _compare_module():
    spec = importlib.util.spec_from_file_location("compare_vllm_cpu", ROOT / "benchmarks" / "compare_vllm_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(engine: str, label: str, tok_s: float) -> dict:
    return {
        "engine": engine,
        "mode": "offline",
        "config": {"label": label},
        "output_throughput": tok_s,
        "duration_s": 1000.0 / tok_s,
    }


def test_rounds_pair_in_order_and_report_the_median_ratio(tmp_path, capsys):
    runs = [
        _run("radixserve", "qwen2 bfloat16 W1", 600.0),
        _run("vllm", "qwen2 bfloat16 W1", 500.0),  # 1.20x
        _run("radixserve", "qwen2 bfloat16 W2", 300.0),
        _run("vllm", "qwen2 bfloat16 W2", 200.0),  # 1.50x
        _run("radixserve", "qwen2 bfloat16 W1", 550.0),
        _run("vllm", "qwen2 bfloat16 W1", 500.0),  # 1.10x
        _run("radixserve", "qwen2 bfloat16 W2", 330.0),
        _run("vllm", "qwen2 bfloat16 W2", 300.0),  # 1.10x
        _run("radixserve", "qwen2 bfloat16 W1", 700.0),
        _run("vllm", "qwen2 bfloat16 W1", 500.0),  # 1.40x
        _run("radixserve", "qwen2 bfloat16 W2 radix-off", 30.0),
    ]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in runs))
    _compare_module().table(str(results))
    lines = capsys.readouterr().out.splitlines()
    w1 = next(i for i, line in enumerate(lines) if line.startswith("qwen2 bfloat16 W1"))
    assert [line.split()[-1] for line in lines[w1 : w1 + 4]] == ["1.20x", "1.10x", "1.40x", "1.20x"]
    assert "median of 3 rounds" in lines[w1 + 3]
    w2 = next(i for i, line in enumerate(lines) if line.startswith("qwen2 bfloat16 W2"))
    assert [line.split()[-1] for line in lines[w2 : w2 + 3]] == ["1.50x", "1.10x", "1.30x"]
    # Radix cache on (the median of radixserve's two W2 runs, 300 and 330 tok/s: the lower middle) / off.
    on_off = lines[-1]
    assert on_off.startswith("qwen2 bfloat16 W2") and on_off.split()[-1] == "10.00x"


def test_a_single_round_prints_no_median_and_a_missing_peer_is_na(tmp_path, capsys):
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(_run("radixserve", "llama float32 W1", 260.0)) + "\n")
    _compare_module().table(str(results))
    out = capsys.readouterr().out
    assert "median" not in out
    assert out.splitlines()[1].split()[-1] == "n/a"
