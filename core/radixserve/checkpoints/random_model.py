"""Random-weight models built offline: nothing is downloaded. The demo model
(``checkpoints/demo.py``) is one; the tests' tiny models (``radixserve.testing.tiny_models``)
are the others.

- :func:`build_tokenizer` trains a byte-level BPE tokenizer offline on a fixed
  synthetic corpus and saves it as a ``PreTrainedTokenizerFast`` with a
  ChatML-style chat template.
- :func:`build_tiny_model` saves a random-weight HF checkpoint (config,
  safetensors, generation config, tokenizer) for one of :data:`ARCHITECTURES`.

Both are deterministic: the same arguments write the same files. Weights are
drawn with their own seeded generator (not transformers' initialisers) and are
large enough that greedy decoding has clear top-2 margins, so engine-vs-HF
greedy parity does not hinge on near ties.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

PathLike = str | Path

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START, IM_END)
# Reasoning tags: single added tokens that decoding keeps (not special), as in Qwen3.
THINK_START, THINK_END = "<think>", "</think>"

DEFAULT_VOCAB_SIZE = 512

# ChatML: every message is "<|im_start|>{role}\n{content}<|im_end|>\n". Content is
# a string or a list of parts whose text parts are concatenated. Tools, when
# given, are listed in the system turn; assistant tool calls follow the content.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is iterable -%}"
    "{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set system_first = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if system_first -%}{{- render(messages[0].content) + '\\n\\n' -}}{%- endif -%}"
    '{{- \'# Tools\\nCall a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.\' -}}'
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (tools and loop.first and system_first) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + render(message.content) -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) -%}"
    "{{- '\\n<tool_call>{\"name\": \"' + fn.name + '\", \"arguments\": ' + args + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land different home "
    "us move try kind hand picture again change off play spell air away animal house point page letter mother "
    "answer found study still learn should america world server model token cache prefix radix tree batch "
    "request stream decode prefill kernel tensor memory page schedule latency throughput python function"
)
_WORDS = _WORD_TEXT.split()
_CJK = (
    "你好，世界。",
    "今天天气很好。",
    "我们一起学习。",
    "模型正在生成文本。",
    "こんにちは、世界。",
    "ありがとうございます。",
    "東京は大きい都市です。",
    "안녕하세요.",
    "감사합니다.",
)
_EMOJI = ("😀", "🚀", "🎉", "👍", "🔥", "🤖", "❤️", "🌍", "👨‍👩‍👧")
_PUNCT = (".", ",", "!", "?", ";", ":", "...", " -", "'s", '"', "(", ")")


def synthetic_corpus(num_lines: int = 3000, seed: int = 0) -> list[str]:
    """Deterministic training text: mostly English-like sentences with digits
    and punctuation, plus a little CJK and emoji (rare enough that BPE learns
    few merges for them, so they split into several tokens)."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 10 ** rng.randint(1, 5))))
        line = " ".join(words).capitalize() + rng.choice(_PUNCT)
        if rng.random() < 0.1:
            line = f"{line} {rng.choice(_PUNCT)}{rng.choice(_WORDS).upper()}"
        if i % 15 == 0:
            line += " " + rng.choice(_CJK)
        if i % 25 == 0:
            line += " " + rng.choice(_EMOJI)
        lines.append(line)
    return lines


# The plain corpus supports vocabularies up to about this size; larger ones get
# pseudo-words too (so small tokenizers stay exactly as they were).
_PLAIN_CORPUS_VOCAB = 2048
_ONSETS = (
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "st",
    "tr",
    "pl",
    "gr",
    "ch",
    "sh",
    "th",
)
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ou", "ee", "oa")


def pseudo_word_corpus(vocab_size: int, seed: int = 1) -> list[str]:
    """Lines of deterministic made-up words (syllable strings), enough distinct
    material for a byte-level BPE to learn ``vocab_size`` tokens."""
    rng = random.Random(seed)
    vocab = [
        "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) for _ in range(rng.randint(2, 4))) for _ in range(vocab_size)
    ]
    return [" ".join(rng.choice(vocab) for _ in range(12)) for _ in range(vocab_size)]


def build_tokenizer(out_dir: PathLike, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Train a byte-level BPE tokenizer of exactly ``vocab_size`` tokens (special
    tokens included) and save it with ``save_pretrained`` into ``out_dir``.

    Special tokens: bos ``<|startoftext|>``, eos ``<|endoftext|>``, pad
    ``<|pad|>``, and ``<|im_start|>``/``<|im_end|>`` for the chat template; then
    ``<think>`` and ``</think>``, added tokens that decoding keeps. No token is
    added automatically when encoding.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, THINK_START, THINK_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = synthetic_corpus()
    if vocab_size > _PLAIN_CORPUS_VOCAB:
        corpus += pseudo_word_corpus(vocab_size)
    tok.train_from_iterator(corpus, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"trained vocab has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    tok.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in (THINK_START, THINK_END)])
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers leaves its __init__ unannotated
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "phi3", "gemma2", "gemma3_text",
    "deepseek_v2",
)  # fmt: skip

# DeepSeek-V2-Lite's structure at tiny sizes: multi-head latent attention without
# query compression (q_lora_rank None), value heads wider than the query/key
# "nope" part, a dense first layer then MoE layers with 2 shared experts and
# greedy softmax routing, YaRN x40 with V2-Lite's mscale (the original context
# scaled down, 4096 -> 32, so that the tiny rotary dims see every branch of the
# YaRN ramp; the context is the factor times it, 1280, as V2-Lite's is).
DEEPSEEK_V2_LITE_TINY: dict[str, Any] = dict(
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
    n_shared_experts=2,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
    scoring_func="softmax",
    rope_scaling={
        "type": "yarn",
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)


def tiny_config(
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    **overrides: Any,
) -> PretrainedConfig:
    """The transformers config of a tiny ``arch`` model. MoE arguments apply to
    the MoE architectures: ``qwen3_moe`` (``norm_topk_prob=True`` like the real
    models), ``qwen2_moe`` (``norm_topk_prob=False`` like Qwen1.5-MoE; its shared
    expert is ``intermediate_size`` wide), ``mixtral`` (whose experts are
    ``intermediate_size`` wide: ``moe_intermediate_size`` does not apply) and
    ``deepseek_v2`` (which starts from :data:`DEEPSEEK_V2_LITE_TINY`; its KV heads
    are its heads, its head dims are its own and its context follows from its
    YaRN scaling, so ``num_kv_heads``, ``head_dim`` and ``max_position_embeddings``
    do not apply either); ``overrides`` are passed to the config as is (e.g.
    ``mlp_only_layers``, ``attention_bias``, ``sliding_window``, ``q_lora_rank``)."""
    from transformers import AutoConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES}")
    ids = _special_token_ids(vocab_size)
    kwargs: dict[str, Any] = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
    )
    if rope_scaling is not None:
        kwargs["rope_scaling"] = dict(rope_scaling)
    if arch in ("qwen3_moe", "qwen2_moe"):
        kwargs.update(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=arch == "qwen3_moe",
        )
    if arch == "qwen2_moe":
        kwargs.update(shared_expert_intermediate_size=intermediate_size)
    if arch == "mixtral":
        kwargs.update(num_local_experts=num_experts, num_experts_per_tok=num_experts_per_tok)
    if arch == "deepseek_v2":
        del kwargs["head_dim"]
        kwargs.update(DEEPSEEK_V2_LITE_TINY, num_key_value_heads=num_heads)
        kwargs.update(
            n_routed_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
        )
        if rope_scaling is not None:
            kwargs["rope_scaling"] = dict(rope_scaling)
        yarn = kwargs["rope_scaling"]
        kwargs["max_position_embeddings"] = yarn["factor"] * yarn["original_max_position_embeddings"]
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


def _special_token_ids(vocab_size: int) -> dict[str, int]:
    # The BPE trainer puts special tokens first, in order.
    if vocab_size < len(SPECIAL_TOKENS) + 2 + 256:
        raise ValueError(f"vocab_size {vocab_size} cannot hold the byte alphabet and special tokens")
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}


def build_tiny_model(
    out_dir: PathLike,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_position_embeddings: int = 1024,
    dtype: str | torch.dtype = torch.float32,
    seed: int = 0,
    weight_scale: float = 0.1,
    lm_head_scale: float = 0.5,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    shard: bool = False,
    with_tokenizer: bool = True,
    backbone: bool = False,
    **overrides: Any,
) -> Path:
    """Save a random-weight ``arch`` model to ``out_dir`` and return the path.

    Weights come from a generator seeded with ``seed``: matrices and the input
    embedding are ``N(0, weight_scale^2)``, the LM head (or the tied embedding)
    ``N(0, lm_head_scale^2)``, biases ``N(0, (weight_scale/2)^2)``, norm weights
    ``1 + N(0, 0.1^2)`` (not all ones, so a norm that failed to load would be
    noticed). The LM head scale sets the logit spread: at the defaults the logits
    have a standard deviation of about 4 and top-2 greedy gaps are typically
    ~0.8 (rarely below 1e-3), far above float32 noise. ``dtype`` is the saved
    checkpoint dtype. ``shard=True`` writes at
    least two safetensors shards plus ``model.safetensors.index.json``. The
    tokenizer (:func:`build_tokenizer`, same ``vocab_size``) is saved alongside
    unless ``with_tokenizer`` is False. ``backbone=True`` saves the model without
    its LM head (architecture ``Qwen3Model``, ``LlamaModel``...), as embedding
    models ship. Extra keyword arguments go to :func:`tiny_config`.
    """
    from transformers import AutoModel, AutoModelForCausalLM, GenerationConfig

    config = tiny_config(
        arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
        **overrides,
    )
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    # transformers leaves from_config and GenerationConfig.__init__ unannotated.
    auto = AutoModel if backbone else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    _randomize(model, seed, weight_scale, lm_head_scale)
    model = model.to(torch_dtype)
    ids = _special_token_ids(vocab_size)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=[ids[EOS_TOKEN], ids[IM_END]],
        pad_token_id=ids[PAD_TOKEN],
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    max_shard_size = _total_bytes(model) // 3 if shard else "50GB"
    with _quiet_progress_bars():
        model.save_pretrained(str(out), max_shard_size=max_shard_size)
    if shard and not (out / "model.safetensors.index.json").is_file():
        raise RuntimeError(f"sharded save of {arch} produced a single file")
    if with_tokenizer:
        build_tokenizer(out, vocab_size=vocab_size)
    return out


def build_llama_without_its_class(
    out_dir: PathLike,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    max_position_embeddings: int,
    seed: int,
    weight_scale: float = 0.1,
    lm_head_scale: float = 0.5,
) -> Path:
    """What ``build_tiny_model(out_dir, "llama", ...)`` writes (float32, untied, one
    file, with the tokenizer), without transformers' Llama model class: its import
    and construction are over a second of CPU, on the demo model's first start.
    The parameters are named and shaped here as that class names and shapes them
    (tests/test_server_units.py checks that both write the same checkpoint)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    config = tiny_config(
        "llama",
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
    )
    config.architectures, config.dtype = ["LlamaForCausalLM"], torch.float32  # as the class's save_pretrained sets them
    head_dim = hidden_size // num_heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab_size, hidden_size),
        "model.norm.weight": (hidden_size,),
        "lm_head.weight": (vocab_size, hidden_size),
    }
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (num_heads * head_dim, hidden_size),
            f"{layer}.self_attn.k_proj.weight": (num_kv_heads * head_dim, hidden_size),
            f"{layer}.self_attn.v_proj.weight": (num_kv_heads * head_dim, hidden_size),
            f"{layer}.self_attn.o_proj.weight": (hidden_size, num_heads * head_dim),
            f"{layer}.mlp.gate_proj.weight": (intermediate_size, hidden_size),
            f"{layer}.mlp.up_proj.weight": (intermediate_size, hidden_size),
            f"{layer}.mlp.down_proj.weight": (hidden_size, intermediate_size),
            f"{layer}.input_layernorm.weight": (hidden_size,),
            f"{layer}.post_attention_layernorm.weight": (hidden_size,),
        }
    weights = _random_weights(shapes, "lm_head.weight", seed, weight_scale, lm_head_scale)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    ids = _special_token_ids(vocab_size)
    GenerationConfig(  # type: ignore[no-untyped-call]  # unannotated in transformers
        bos_token_id=ids[BOS_TOKEN], eos_token_id=[ids[EOS_TOKEN], ids[IM_END]], pad_token_id=ids[PAD_TOKEN]
    ).save_pretrained(str(out))
    build_tokenizer(out, vocab_size=vocab_size)
    return out


@torch.no_grad()
def _randomize(model: PreTrainedModel, seed: int, scale: float, lm_head_scale: float) -> None:
    head = model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated in transformers; None for a backbone
    params = dict(model.named_parameters())
    head_name = next((name for name, param in params.items() if head is not None and param is head.weight), None)
    shapes = {name: tuple(param.shape) for name, param in params.items()}
    for name, values in _random_weights(shapes, head_name, seed, scale, lm_head_scale).items():
        params[name].copy_(values)


def _random_weights(
    shapes: dict[str, tuple[int, ...]], head_name: str | None, seed: int, scale: float, lm_head_scale: float
) -> dict[str, torch.Tensor]:
    """Random values of these shapes, drawn in name order from one generator seeded
    with ``seed`` (the scales: ``build_tiny_model``'s docstring)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name in sorted(shapes):
        noise = torch.randn(shapes[name], generator=gen, dtype=torch.float32)
        if name == head_name:
            weights[name] = lm_head_scale * noise
        elif "norm" in name:
            weights[name] = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            weights[name] = 0.5 * scale * noise
        else:
            weights[name] = scale * noise
    return weights


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers


def _total_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
