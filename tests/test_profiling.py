"""Profiling the scheduler process: Engine.start_profile/stop_profile, the
/start_profile and /stop_profile endpoints, and the trace arithmetic of
radixserve.bench.profile (what bench_gpu.py --profile reports; its end-to-end run
on the CPU, profiles and traces included, is in test_bench_gpu_smoke.py)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from helpers_server import serving

from radixserve.bench.profile import busy_time, decode_profile
from radixserve.messages import PROFILE_DIR_ENV

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def step_names(path: str) -> list[str]:
    trace = json.loads(Path(path).read_text())
    return [
        e["name"]
        for e in trace["traceEvents"]
        if e.get("cat") == "user_annotation" and e["name"].startswith("radixserve.")
    ]


# ---- trace arithmetic (hand-made traces) -------------------------------------------------


def annotation(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def kernel(ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur}


def test_busy_time_is_the_union_clipped_to_the_window():
    window = (100.0, 200.0)
    assert busy_time([], window) == 0
    assert busy_time([(110, 130), (120, 140), (125, 135)], window) == 30  # nested and overlapping
    assert busy_time([(110, 120), (150, 160)], window) == 20  # a gap
    assert busy_time([(50, 90), (210, 230), (90, 105), (195, 260)], window) == 10  # outside, or half in
    assert busy_time([(0, 500)], window) == 100


def test_decode_profile_of_a_hand_made_trace():
    # Steps start every 10 us: extend, then decode bs=4 at 10, 20, 30, then a decode bs=3 at 40.
    events = [
        annotation("radixserve.extend[tokens=64]", 0, 6),
        *[annotation("radixserve.decode[bs=4]", t, 2) for t in (10, 20, 30)],
        annotation("radixserve.decode[bs=3]", 40, 2),
        # The GPU's own copy of an annotation is not a host step.
        {"ph": "X", "cat": "gpu_user_annotation", "name": "radixserve.decode[bs=4]", "ts": 11, "dur": 5},
        # Window [10, 30]: 12-18 and 16-20 overlap (8 us), 22-24 memcpy and 23-25 memset (3 us);
        # 5-11 is half in (1 us); 29-35 is partly in (1 us); 40-45 is outside.
        kernel(12, 6),
        kernel(16, 4),
        kernel(22, 2, "gpu_memcpy"),
        kernel(23, 2, "gpu_memset"),
        kernel(5, 6),
        kernel(29, 6),
        kernel(40, 5),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 15},
    ]
    prof = decode_profile({"traceEvents": events}, 4)
    assert prof.steps == 3
    assert prof.step_ms_median == pytest.approx(0.010)
    assert prof.host_ms_median == pytest.approx(0.002)
    assert prof.window_ms == pytest.approx(0.020)
    assert prof.device_busy_fraction == pytest.approx(13 / 20)
    assert decode_profile({"traceEvents": events}, 3) is None  # one step has no window
    assert decode_profile({"traceEvents": events}, 64) is None
    host_only = [e for e in events if e["cat"] == "user_annotation"]
    assert decode_profile({"traceEvents": host_only}, 4).device_busy_fraction is None


def test_platforms_choose_what_is_recorded():
    from torch.profiler import ProfilerActivity

    from radixserve.platform import Platform
    from radixserve_cuda.platform import CudaPlatform
    from radixserve_npu.platform import NpuPlatform
    from radixserve_rocm.platform import RocmPlatform

    assert Platform().profiler_activities() == [ProfilerActivity.CPU]
    assert NpuPlatform().profiler_activities() == [ProfilerActivity.CPU]  # the default: host ops only
    for platform in (CudaPlatform(), RocmPlatform()):  # HIP kernels come through the CUDA activity
        assert platform.profiler_activities() == [ProfilerActivity.CPU, ProfilerActivity.CUDA]


# ---- the Engine ---------------------------------------------------------------------------------


def test_engine_profile_records_named_steps(engine, tmp_path):
    planned = engine.start_profile(output_dir=str(tmp_path / "traces"), record_shapes=True)
    assert Path(planned).parent == tmp_path / "traces" and "rank0" in Path(planned).name
    engine.generate(input_ids=[[5, 6, 7, 8], [9, 10, 11]], sampling_params=GREEDY)
    path = engine.stop_profile()
    assert path == planned and Path(path).is_file()
    names = step_names(path)
    # Both prompts' tokens, in one step or two (the requests may reach the scheduler a step apart).
    extends = [n for n in names if n.startswith("radixserve.extend[tokens=")]
    assert sum(int(n[len("radixserve.extend[tokens=") : -1]) for n in extends) == 7
    assert any(n.startswith("radixserve.decode[bs=") for n in names)
    assert not list((tmp_path / "traces").glob("*.tmp"))


def test_engine_profile_stops_by_itself_after_num_steps(engine, tmp_path):
    path = engine.start_profile(output_dir=str(tmp_path), num_steps=3)
    engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)  # 1 extend + 5 decode steps
    assert Path(path).is_file()  # written after the third step, before the request ended
    assert step_names(path) == ["radixserve.extend[tokens=3]"] + ["radixserve.decode[bs=1]"] * 2
    assert engine.stop_profile() == path  # hands out the finished trace once
    with pytest.raises(ValueError, match="no profile is running"):
        engine.stop_profile()


def test_engine_profile_errors(engine, tmp_path):
    with pytest.raises(ValueError, match="no profile is running"):
        engine.stop_profile()
    with pytest.raises(ValueError, match="^num_steps: must be a positive integer, got 0"):
        engine.start_profile(num_steps=0)
    with pytest.raises(ValueError, match="^record_shapes: must be a boolean"):
        engine.start_profile(record_shapes="yes")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="^output_dir: cannot create"):
        engine.start_profile(output_dir=str(blocker / "sub"))
    path = engine.start_profile(output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="already running"):
        engine.start_profile(output_dir=str(tmp_path))
    assert engine.generate(input_ids=[4, 5], sampling_params=GREEDY)["meta_info"]["completion_tokens"] == 6
    assert engine.stop_profile() == path and Path(path).is_file()


# ---- the server ---------------------------------------------------------------------------------


def test_server_profile_endpoints(tiny_llama_dir, tmp_path):
    env = {PROFILE_DIR_ENV: str(tmp_path / "default")}
    with (
        # Backends by priority: nothing is timed at start-up (the profile's subject is the steps).
        serving(tiny_llama_dir, "--max-total-tokens", "4096", "--backend-selection", "priority", env=env) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as http,
    ):
        r = http.post("/stop_profile")
        assert r.status_code == 400 and "no profile is running" in r.json()["error"]["message"]
        r = http.post("/start_profile", json={"num_steps": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "num_steps"
        r = http.post("/start_profile", json={"record_shapes": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "record_shapes"

        r = http.post("/start_profile")  # no body: the defaults, $RADIXSERVE_PROFILE_DIR
        assert r.status_code == 200, r.text
        planned = r.json()["trace_path"]
        assert Path(planned).parent == tmp_path / "default"
        r = http.post("/start_profile", json={})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "already running" in r.json()["error"]["message"]
        r = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 6
        r = http.post("/stop_profile")
        assert r.status_code == 200 and r.json() == {"success": True, "trace_path": planned}
        names = step_names(planned)
        assert "radixserve.extend[tokens=3]" in names and "radixserve.decode[bs=1]" in names

        # output_dir is relative to the profile directory (--profile-dir, here $RADIXSERVE_PROFILE_DIR's).
        r = http.post("/start_profile", json={"output_dir": "given", "num_steps": 2})
        assert r.status_code == 200 and Path(r.json()["trace_path"]).parent == tmp_path / "default" / "given"
        r = http.post("/start_profile", json={"output_dir": str(tmp_path / "given")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "output_dir"
        assert http.get("/health").status_code == 200
