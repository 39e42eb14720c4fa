"""radixserve-example-model: a minimal third-party model plugin.

radixserve finds this module through the ``radixserve`` entry point declared in
pyproject.toml and calls ``register_models``, which hands it the model classes;
a checkpoint whose config.json names one of their ``architectures`` is then
served by it. Import only radixserve's public API (``radixserve.hooks``,
``radixserve.models``, ``radixserve.layers``) and keep this import cheap: it
happens in every radixserve process.
"""

from radixserve.hooks import Register, hookimpl
from radixserve_example_model.model import ExampleLlamaForCausalLM

__all__ = ["ExampleLlamaForCausalLM"]
__version__ = "0.1.0"


@hookimpl
def register_models(register: Register) -> None:
    register(ExampleLlamaForCausalLM)
