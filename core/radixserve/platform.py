"""Platforms: what the core knows about a device, reached only through this class."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch.profiler import ProfilerActivity

from radixserve.communicator import Communicator


@dataclass(frozen=True)
class DtypeChoice:
    """The compute dtype chosen for a model, and why (the log and the startup summary say both)."""

    dtype: torch.dtype
    reason: str


class Platform:
    """A device kind (``cpu``, ``cuda``, ``rocm``, ``npu``, ...).

    ``unavailable_reasons`` must be cheap and side-effect free: probe with
    ``importlib.util.find_spec`` and environment checks, never by initialising a
    device runtime. ``priority`` orders platforms for ``--device auto``.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    torch_device_type: ClassVar[str] = "cpu"
    # The torch.distributed backend of the tensor-parallel ranks' device collectives.
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    default_dtype: ClassVar[torch.dtype] = torch.bfloat16
    # Share of device memory for weights + KV pool when --mem-fraction-static is not given.
    default_mem_fraction: ClassVar[float] = 0.85
    # Overlap scheduling unless --disable-overlap-schedule says otherwise: it pays
    # where the device computes asynchronously from the host, so the host's work
    # for one step hides behind the device's work for the previous one.
    overlap_schedule: ClassVar[bool] = True
    # A step's small host <-> device copies go through page-locked host memory,
    # asynchronously (radixserve/transfer.py): true where the device runs work
    # queued by the host asynchronously and torch pins host memory for it.
    pinned_host_staging: ClassVar[bool] = False

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        return []

    @classmethod
    def auto_dtype(cls, saved: torch.dtype | None) -> DtypeChoice:
        """What ``--dtype auto`` serves a checkpoint saved in ``saved`` (None: its config
        does not say) in: a 16-bit checkpoint in its own dtype where the platform
        supports it, anything else in ``default_dtype``. A platform whose fast dtype
        depends on the hardware overrides it. A classmethod: the start-up checks ask
        it before any device is initialised."""
        if saved in (torch.bfloat16, torch.float16) and saved in cls.supported_dtypes:
            return DtypeChoice(saved, "the checkpoint's dtype")
        what = f"a {str(saved).removeprefix('torch.')} checkpoint" if saved is not None else "no dtype in the config"
        return DtypeChoice(cls.default_dtype, f"{what}: the {cls.name} platform's default")

    def device(self, index: int = 0) -> torch.device:
        return torch.device(self.torch_device_type, index)

    def total_memory_bytes(self, index: int = 0) -> int:
        raise NotImplementedError

    def available_memory_bytes(self, index: int = 0) -> int:
        raise NotImplementedError

    def describe(self, index: int = 0) -> str:
        return self.name

    def pool_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zero-filled buffer of the KV pool, which requests fill over the
        server's life. The default is ``torch.zeros``; a platform whose memory
        the OS zero-fills on first touch may hand out pages that cost no start-up
        time (nor memory) until they are written (``cpu`` does)."""
        return torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def process_environment(cls, processes_per_host: int) -> dict[str, str]:
        """Environment variables for each of the ``processes_per_host`` model
        processes the runtime starts on this host (tensor-parallel ranks of the node
        times data-parallel replicas), asked only where there are several (a lone
        one is spawned before the platform is resolved). A platform whose
        processes share the host's cores gives each its share; the default adds
        nothing."""
        return {}

    def bind_device(self, device: torch.device) -> None:
        """Make ``device`` this process's current device, so that kernels launched on
        the current device's stream (Triton, FlashInfer, graph capture) run on the
        device ``--base-gpu-id`` chose. The model runner calls it before building
        anything; the default does nothing (a CPU has no current device)."""

    def synchronize(self, device: torch.device) -> None:
        """Wait until the work queued on ``device`` is done, so that a host timer
        measures it (selection by measurement). A device that runs work
        asynchronously from the host overrides this; the default returns at once."""

    def timing_fingerprint(self, index: int = 0) -> dict[str, str]:
        """What backend timings measured here depend on, as the key of their cache
        (radixserve/backend_timing.py): by default the platform, ``describe()`` and
        the torch version. A platform adds what else changes which kernel is
        fastest (the CPU's model and ISA flags, a GPU's name and capability)."""
        return {"platform": self.name, "device": self.describe(index), "torch": torch.__version__}

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Wraps every model step (autocast, stream or graph capture hooks)."""
        yield

    def graph_backend(self, device: torch.device) -> GraphBackend | None:
        """How this device records and replays a forward (CUDA graphs, HIP graphs
        through the same torch API, ...); None: it cannot, and every step runs eagerly."""
        return None

    def communicator(self, group: torch.distributed.ProcessGroup, size: int) -> Communicator:
        """The collectives of one tensor-parallel rank over ``group`` (made with
        ``dist_backend``, ``size`` ranks): torch.distributed's by default; a platform
        with faster ones of its own returns a ``Communicator`` subclass."""
        return Communicator(group, size)

    def profiler_activities(self) -> list[ProfilerActivity]:
        """What ``start_profile`` records with torch.profiler: host ops by default; a
        device platform adds its own activity (``CUDA`` on cuda and rocm) so that
        the trace holds the device kernels and copies."""
        return [ProfilerActivity.CPU]


# -- graph capture and replay (the platform's side; runtime/execution/graph_runner.py drives it) --


class DeviceGraph(abc.ABC):
    """A recorded forward: replaying it reruns the same device work on the same
    buffers, so new inputs go in by copying into the buffers it was captured on."""

    @abc.abstractmethod
    def replay(self) -> None:
        """Launch the recorded work (asynchronously, like any device call)."""


class GraphBackend(abc.ABC):
    """Captures device graphs for one device; the graphs it makes may share a
    memory pool, so capture the largest first and replay one at a time."""

    name: ClassVar[str]

    @abc.abstractmethod
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[DeviceGraph, torch.Tensor]:
        """Record ``fn`` (warm-up runs first, where the device needs them) and return
        the graph with ``fn``'s output tensor, which every replay rewrites in place.
        ``fn`` must not synchronise with the host."""


class GraphRuntime(Protocol):
    """The stream and graph API of a torch device module, as torch's CUDA-style
    modules spell it (a plugin's, on the builds of torch that have one): what
    :class:`StreamGraphBackend` calls. A plugin passes the module itself."""

    def device(self, device: torch.device, /) -> contextlib.AbstractContextManager[Any]:
        """Makes ``device`` the current device for the block (the device guard)."""
        ...

    @property
    def Stream(self) -> Callable[[torch.device], Any]:
        """Makes a new stream on a device (a class, in torch's modules)."""
        ...

    def current_stream(self, device: torch.device, /) -> Any: ...

    def stream(self, stream: Any, /) -> contextlib.AbstractContextManager[Any]:
        """Makes ``stream`` the current stream for the block."""
        ...

    def synchronize(self, device: torch.device, /) -> None: ...

    def graph_pool_handle(self) -> Any:
        """A memory pool that several graphs' captures can share."""
        ...

    def graph(self, graph: Any, /, *, pool: Any, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Records into ``graph`` what ``stream`` runs in the block."""
        ...


class RecordedGraph(DeviceGraph):
    """A graph recorded by a :class:`StreamGraphBackend` (an instance of the graph class its plugin passed)."""

    def __init__(self, graph: Any):
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()  # torch replays on the device the graph was captured on


class StreamGraphBackend(GraphBackend):
    """Graph capture through a torch device module's stream-capture API, the one
    procedure that every platform with that API shares (``hardware/cuda``'s CUDA
    graphs and ``hardware/rocm``'s HIP graphs are this class with their module):

    - everything runs under the device guard of ``device``: ``--base-gpu-id`` may
      select another device than the process's current one, and the runtime's
      calls without a device (graph capture synchronises and empties the cache of
      the current device before it records) would otherwise reach that one;
    - captures run on a side stream (CUDA forbids capturing the legacy default
      stream), which first waits for the current stream, where the inputs were
      written;
    - ``warmup_runs`` eager runs on that stream come first, to compile kernels and
      let the allocator and libraries settle, since none of that may happen while
      a graph records;
    - all graphs of one backend share one memory pool (the runner captures the
      largest batch first, and the smaller graphs reuse its blocks).

    A subclass sets ``name``; the plugin's platform (``graph_backend``) builds it
    with its torch device module and that module's graph class.
    """

    warmup_runs: ClassVar[int] = 2

    def __init__(self, device: torch.device, runtime: GraphRuntime, graph_type: Callable[[], Any]):
        self.device = device
        self.runtime = runtime
        self.graph_type = graph_type
        with runtime.device(device):
            self.pool = runtime.graph_pool_handle()
            self.stream = runtime.Stream(device)

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[DeviceGraph, torch.Tensor]:
        rt = self.runtime
        with rt.device(self.device):
            current = rt.current_stream(self.device)
            self.stream.wait_stream(current)  # the inputs were written on the current stream
            with rt.stream(self.stream):
                for _ in range(self.warmup_runs):
                    fn()
            current.wait_stream(self.stream)
            rt.synchronize(self.device)
            graph = self.graph_type()
            with rt.graph(graph, pool=self.pool, stream=self.stream):
                output = fn()
            rt.synchronize(self.device)
        return RecordedGraph(graph), output
