"""radixserve-example-kernels: a minimal third-party kernel plugin.

radixserve finds this module through the ``radixserve`` entry point declared in
pyproject.toml and calls the ``@hookimpl`` functions below; each hands its
backend classes to ``register``. Import only radixserve's public contract
(``radixserve.hooks``, ``radixserve.kernels``, ``radixserve.forward_batch``, ...)
and keep this import cheap: it happens in every radixserve process.
"""

from radixserve.hooks import Register, hookimpl
from radixserve_example_kernels.attention import ExampleSDPAttention
from radixserve_example_kernels.gemm import ExampleGemm

__all__ = ["ExampleGemm", "ExampleSDPAttention"]
__version__ = "0.1.0"


@hookimpl
def register_attention_backends(register: Register) -> None:
    register(ExampleSDPAttention)


@hookimpl
def register_gemm_backends(register: Register) -> None:
    register(ExampleGemm)
