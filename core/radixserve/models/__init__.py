"""Built-in model architectures, registered through the same ``register_models``
hook a third-party plugin uses (the registry loads this module as a plugin)."""

from radixserve.hooks import Register, hookimpl
from radixserve.models.base import CausalLM, ModelFacts
from radixserve.models.deepseek_v2 import DeepseekV2ForCausalLM
from radixserve.models.eagle import LlamaEagle3Head, LlamaEagleHead
from radixserve.models.gemma2 import Gemma2ForCausalLM
from radixserve.models.gemma3 import Gemma3ForCausalLM
from radixserve.models.llama import LlamaForCausalLM
from radixserve.models.mixtral import MixtralForCausalLM
from radixserve.models.phi3 import Phi3ForCausalLM
from radixserve.models.qwen2 import Qwen2ForCausalLM
from radixserve.models.qwen2_moe import Qwen2MoeForCausalLM
from radixserve.models.qwen3 import Qwen3ForCausalLM
from radixserve.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: tuple[type, ...] = (
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    DeepseekV2ForCausalLM,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Phi3ForCausalLM,
    LlamaEagleHead,  # the drafts of --speculative-algorithm eagle, not served alone
    LlamaEagle3Head,
)


@hookimpl
def register_models(register: Register) -> None:
    for cls in MODEL_CLASSES:
        register(cls)


__all__ = [
    "CausalLM",
    "DeepseekV2ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaEagle3Head",
    "LlamaEagleHead",
    "LlamaForCausalLM",
    "MODEL_CLASSES",
    "MixtralForCausalLM",
    "ModelFacts",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "register_models",
]
