"""The CUDA and ROCm graph backends on a CPU, through a stand-in for torch.cuda's
stream and graph API (tests/cuda_graph_standin.py): both are the core's
``StreamGraphBackend``, and with ``--base-gpu-id 1`` everything a capture does
(warm-up runs, the capture itself, every synchronisation) happens on device 1,
on a side stream, and nothing reaches device 0."""

from __future__ import annotations

import pytest
import torch
from cuda_graph_standin import StandInCuda, install

from radixserve.config import ServerArgs
from radixserve.platform import GraphBackend, StreamGraphBackend
from radixserve_cuda import CudaPlatform
from radixserve_rocm import RocmPlatform

PLATFORMS = [pytest.param(CudaPlatform, id="cuda"), pytest.param(RocmPlatform, id="rocm")]
NAMES = {CudaPlatform: "cuda_graph", RocmPlatform: "hip_graph"}


@pytest.fixture
def cuda(monkeypatch) -> StandInCuda:
    return install(monkeypatch, StandInCuda(count=2))


def backend_for(platform_cls, base_gpu_id: int) -> GraphBackend:
    """The graph backend the model runner gets for rank 0 under ``--base-gpu-id``."""
    args = ServerArgs(base_gpu_id=base_gpu_id)
    platform = platform_cls()
    backend = platform.graph_backend(platform.device(args.base_gpu_id + 0))  # ModelRunner: base_gpu_id + tp_rank
    assert backend is not None
    return backend


@pytest.mark.parametrize("platform_cls", PLATFORMS)
def test_both_are_the_cores_stream_graph_backend(cuda, platform_cls):
    backend = backend_for(platform_cls, 1)
    assert isinstance(backend, StreamGraphBackend) and backend.name == NAMES[platform_cls]
    assert backend.device == torch.device("cuda", 1) and backend.runtime is torch.cuda


@pytest.mark.parametrize("platform_cls", PLATFORMS)
@pytest.mark.parametrize("base_gpu_id", [1, 0])
def test_capture_runs_on_the_device_base_gpu_id_selects(cuda, platform_cls, base_gpu_id):
    backend = backend_for(platform_cls, base_gpu_id)
    runs = []
    out = torch.zeros(3)

    def forward() -> torch.Tensor:
        recording = bool(cuda.graphs) and cuda.graphs[-1].recording
        runs.append((cuda.where(), recording))
        return out

    graph, output = backend.capture(forward)
    assert output is out

    # Two warm-up runs, then the recorded one: all on the selected device, on the backend's side stream.
    (side,) = cuda.streams
    assert side.device_index == base_gpu_id and side not in cuda.defaults
    assert runs == [((base_gpu_id, side), False), ((base_gpu_id, side), False), ((base_gpu_id, side), True)]
    (recorded,) = cuda.graphs
    assert recorded.captured_on == (base_gpu_id, side) and recorded.pool is not None
    # The side stream waited for the selected device's current stream, where the inputs were written.
    assert side.waited_for == [cuda.defaults[base_gpu_id]]
    # Nothing (no synchronisation, no cache flush, no stream) touched another device: no context there.
    assert {index for _, index in cuda.touched} == {base_gpu_id}, cuda.touched
    # The guard is left as found: the process's current device and streams are unchanged.
    assert cuda.current_device == 0 and cuda.current == cuda.defaults

    graph.replay()
    assert recorded.replays == 1


@pytest.mark.parametrize("platform_cls", PLATFORMS)
def test_graphs_of_one_backend_share_one_pool(cuda, platform_cls):
    backend = backend_for(platform_cls, 1)
    for rows in (8, 4):
        backend.capture(lambda rows=rows: torch.zeros(rows))
    first, second = cuda.graphs
    assert first.pool is not None and second.pool == first.pool and cuda.pools == 1


def test_a_failed_capture_leaves_the_device_and_stream_as_found(cuda):
    backend = backend_for(CudaPlatform, 1)
    calls = []

    def fails_when_recorded() -> torch.Tensor:
        calls.append(cuda.where())
        if len(calls) == 3:
            raise RuntimeError("operation not permitted when stream is capturing")
        return torch.zeros(1)

    with pytest.raises(RuntimeError, match="capturing"):
        backend.capture(fails_when_recorded)
    assert cuda.current_device == 0 and cuda.current == cuda.defaults
    assert not cuda.graphs[0].recording


@pytest.mark.parametrize("platform_cls", PLATFORMS)
def test_the_runner_binds_the_process_to_the_device_base_gpu_id_selects(cuda, platform_cls):
    """Kernels that launch on the current device's stream (Triton, FlashInfer) run
    on the chosen device only if the process's current device is it."""
    platform = platform_cls()
    device = platform.device(1)
    assert cuda.current_device == 0
    platform.bind_device(device)  # what ModelRunner does first
    assert cuda.current_device == 1 and cuda.touched == [("set_device", 1)]
