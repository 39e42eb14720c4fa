"""Train, offline, the target and draft models a speculative-decoding benchmark runs on.

    python benchmarks/train_speculative_models.py --threads 2      # about 12 minutes on two cores
    python benchmarks/train_speculative_models.py --quick          # seconds: a smoke run, everything tiny

A draft's acceptance rate only means something when both models have learned
something, and random weights have not. This trains both on this machine's Python
standard library sources (``*.py`` outside ``test/``, ``idlelib/`` and
``site-packages``, files under 200 KB), split by file with ``--seed`` into a
training set and a held-out set of about ``--heldout-kb``:

- a byte-level BPE tokenizer (``--vocab-size`` tokens; ``<unk>`` ``<s>`` ``</s>``;
  no normalizer, so code and whitespace round-trip exactly; ``<s>`` is prepended
  when encoding, as Llama's tokenizers do);
- a target and a smaller draft ``LlamaForCausalLM`` (float32, tied embeddings),
  sharing that tokenizer, each trained with AdamW (warmup, then cosine decay over
  its wall-clock budget; forward and backward under bfloat16 autocast where the
  CPU multiplies bfloat16 natively, else float32 (``--bf16``/``--no-bf16`` decide),
  master weights and saved weights float32) on random windows of
  ``--seq-len`` tokens. A ``--repeat-fraction`` share of the windows are built like
  the ``repeat`` prompts, back to back: a training-set function, the marker
  comment, the same function again; the others are plain windows of the training
  token stream. Seeing copying that often is what lets induction heads form
  within a budget of minutes, and copying a function just seen is where n-gram
  speculation pays;
- an EAGLE head for the trained target (EAGLE-1/2's layout, radixserve's
  ``--speculative-eagle-path``): ``fc`` over [embedding of token p + 1, the target's
  final hidden state at p] and one Llama decoder layer without its input norm,
  trained for ``--eagle-minutes`` with the target frozen, as EAGLE trains its heads:
  a smooth-L1 loss between its output and the target's hidden state at p + 1 plus a
  tenth of the cross-entropy of that output read by the target's LM head against
  token p + 2, the input features jittered by uniform noise of +-``--eagle-noise``;
- an EAGLE-3 head for the trained target (``LlamaForCausalLMEagle3``, trained for
  ``--eagle3-minutes``, the target frozen): ``fc`` over the outputs of the target's
  layers 0, L/2 and L - 1 (EAGLE-3's default, 1, L/2 - 1 and L - 4, needs a deeper
  target than this one), a decoder layer attending over [normed embedding, normed
  feature], and an LM head over a draft vocabulary of the ``--eagle3-draft-vocab``
  tokens most frequent in the training stream (started from the target's rows).
  As EAGLE-3 trains, the loss is the cross-entropy against the target's own
  distribution of token p + 2 restricted to the draft vocabulary (no feature
  loss), and ``--eagle3-passes`` - 1 more passes ("training-time test") feed every
  position the head's own output of the position before in the pass before, as
  drafting past the first token does, pass ``i``'s loss weighted 0.8^i.

``--reuse-models`` loads the target, draft and tokenizer already under
``--out-dir`` instead of training them (and keeps ``heldout.jsonl``), to train a
head alone: ``--reuse-models --eagle-minutes 0`` trains only the EAGLE-3 head.

Written under ``--out-dir`` (default ``~/.cache/radixserve-bench/speculative``,
``...-quick`` with ``--quick``): ``target/`` and ``draft/`` (``from_pretrained``
directories with the tokenizer), ``eagle/`` and ``eagle3/`` (each head's
config.json and safetensors), ``heldout.jsonl`` (``{"prompt", "kind"}``:
``continue`` is 200-400 tokens of a held-out file to go on with, ``repeat`` is a
held-out function followed by a comment asking for it again and the start of its
``def`` line, where n-gram speculation pays) and ``summary.json`` (sizes,
parameters, tokens seen, held-out loss per token, how much of a ``repeat``
function each model copies greedily, the head's held-out top-1 accuracy on the
token after next given the target's features, the EAGLE-3 head's agreement with
the target's choice of it, wall times). The budgets are wall-clock, so
the step counts, and the weights, depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import re
import sysconfig
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from radixserve.checkpoints.random_eagle import eagle3_head_config, eagle3_token_map, head_config

SUMMARY_PARTS = ("target", "draft", "eagle", "eagle3")  # what --reuse-models keeps of summary.json
UNK, BOS, EOS = "<unk>", "<s>", "</s>"  # ids 0, 1, 2 (the BPE trainer puts special tokens first)
SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
MAX_FILE_BYTES = 200_000
REPEAT_MARKER = "\n\n# the same function again, unchanged:\n"
DEFAULT_OUT_DIR = Path.home() / ".cache/radixserve-bench/speculative"
WARMUP_STEPS = 20
MIN_LR_FRACTION = 0.1
Source = tuple[str, str]  # (path under the stdlib, text)


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


SIZES = {  # small enough to see millions of tokens in minutes on a couple of cores
    "target": ModelSize(hidden=192, layers=4, heads=4, kv_heads=2, intermediate=576),
    "draft": ModelSize(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=384),
}
QUICK = dict(  # --quick: defaults for a smoke run of a few seconds (flags given still win)
    max_train_files=40,
    heldout_kb=40,
    vocab_size=512,
    seq_len=128,
    repeat_max_tokens=48,
    target_minutes=0.05,
    draft_minutes=0.03,
    eagle_minutes=0.03,
    eagle3_minutes=0.03,
    eagle3_draft_vocab=128,
    target_hidden=64,
    target_layers=2,
    target_heads=4,
    target_kv_heads=2,
    target_intermediate=128,
    draft_hidden=32,
    draft_layers=1,
    draft_heads=2,
    draft_kv_heads=1,
    draft_intermediate=64,
    eval_tokens=2048,
    num_prompts=8,
    check_prompts=2,
    log_seconds=1.0,
)


def stdlib_sources() -> list[Source]:
    """(path relative to the stdlib, text) of every Python source the corpus takes, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIPPED_DIRS.intersection(rel.parts[:-1]) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            sources.append((str(rel), path.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    return sources


def split(sources: list[Source], heldout_bytes: int, seed: int) -> tuple[list[Source], list[Source]]:
    """(training, held out): shuffled with ``seed``, the first files, up to ``heldout_bytes``, are held out."""
    order = list(sources)
    random.Random(seed).shuffle(order)
    count, size = 0, 0
    while count < len(order) and size < heldout_bytes:
        size += len(order[count][1])
        count += 1
    return order[count:], order[:count]


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[UNK, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )


def token_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """Every file as ``<s> tokens </s>``, concatenated."""
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return torch.tensor([t for e in encodings for t in (bos, *e.ids, eos)], dtype=torch.long)


def unigram_loss(train: torch.Tensor, heldout: torch.Tensor, vocab_size: int) -> float:
    """Held-out loss per token of token frequencies alone (add-one smoothed): what learning must beat."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1
    return float(-(counts / counts.sum()).log()[heldout[1:]].mean())


def build_model(size: ModelSize, tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        intermediate_size=size.intermediate,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)  # float32: torch's default dtype


def repeat_window(examples: list[torch.Tensor], length: int, gen: torch.Generator) -> torch.Tensor:
    """``length`` tokens of random repeat examples back to back (the last one cut off)."""
    parts, size = [], 0
    while size < length:
        parts.append(examples[int(torch.randint(len(examples), (), generator=gen))])
        size += len(parts[-1])
    return torch.cat(parts)[:length]


def batch(
    stream: torch.Tensor, examples: list[torch.Tensor], args: argparse.Namespace, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``--batch-size`` windows of ``--seq-len`` + 1 tokens, each a repeat window with
    probability ``--repeat-fraction``, else a random window of ``stream``; and which are repeats."""
    windows, repeats = [], []
    for _ in range(args.batch_size):
        repeats.append(bool(examples) and float(torch.rand((), generator=gen)) < args.repeat_fraction)
        if repeats[-1]:
            windows.append(repeat_window(examples, args.seq_len + 1, gen))
        else:
            start = int(torch.randint(0, len(stream) - args.seq_len - 1, (), generator=gen))
            windows.append(stream[start : start + args.seq_len + 1])
    return torch.stack(windows), torch.tensor(repeats)


def learning_rate(peak: float, step: int, spent: float) -> float:
    """Linear warmup over the first steps, then cosine decay to a tenth of ``peak``
    over the share ``spent`` of the wall-clock budget."""
    cosine = 0.5 * (1 + math.cos(math.pi * spent))
    return peak * min(1.0, (step + 1) / WARMUP_STEPS) * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine)


def train(
    name: str,
    model: LlamaForCausalLM,
    stream: torch.Tensor,
    examples: list[torch.Tensor],
    args: argparse.Namespace,
    minutes: float,
    lr: float,
) -> dict[str, Any]:
    """AdamW on batches of ``batch`` for ``minutes`` of wall time: linear warmup over the first
    steps, then cosine decay to a tenth of ``lr`` over the budget's fraction spent."""
    gen = torch.Generator().manual_seed(args.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )
    model.train()
    budget, step, losses = minutes * 60, 0, []
    kind_losses: dict[bool, list[float]] = {False: [], True: []}  # per window: plain, repeat
    start = last_log = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget:
        for group in opt.param_groups:
            group["lr"] = learning_rate(lr, step, elapsed / budget)
        windows, repeats = batch(stream, examples, args, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=windows[:, :-1]).logits
        token_losses = F.cross_entropy(logits.float().transpose(1, 2), windows[:, 1:], reduction="none")
        loss = token_losses.mean()
        for is_repeat, window_loss in zip(repeats.tolist(), token_losses.detach().mean(1).tolist(), strict=True):
            kind_losses[is_repeat].append(window_loss)
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(loss.item())
        if time.perf_counter() - last_log >= args.log_seconds:
            last_log = time.perf_counter()
            tokens = step * args.batch_size * args.seq_len
            recent = sum(losses[-10:]) / len(losses[-10:])
            plain, repeat = (sum(k[-20:]) / max(1, len(k[-20:])) for k in (kind_losses[False], kind_losses[True]))
            print(
                f"{name}: step {step:5d}  {tokens:9d} tokens  loss {recent:.3f} "
                f"(plain {plain:.3f}, repeat {repeat:.3f})  "
                f"lr {opt.param_groups[0]['lr']:.2e}  {tokens / (last_log - start):6.0f} tok/s",
                flush=True,
            )
    return {
        "steps": step,
        "train_tokens_seen": step * args.batch_size * args.seq_len,
        "train_seconds": round(time.perf_counter() - start, 1),
        "final_train_loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4),
    }


class EagleHead(nn.Module):
    """An EAGLE head over ``target`` as radixserve serves one (models/eagle.py), in HF's modules."""

    def __init__(self, target: LlamaForCausalLM):
        super().__init__()
        config = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})
        config._attn_implementation = "sdpa"  # causal without a mask
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden)
        self.layer = LlamaDecoderLayer(config, 0)
        self.layer.input_layernorm = nn.Identity()  # type: ignore[assignment]
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, embedded: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([embedded, features], dim=-1))
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        out: torch.Tensor = self.layer(x, position_ids=positions, position_embeddings=self.rotary(x, positions))
        return out

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """EAGLE-1/2's tensor names."""
        weights = {f"fc.{k}": v for k, v in self.fc.state_dict().items()}
        weights.update({f"layers.0.{k}": v for k, v in self.layer.state_dict().items()})
        return {k: v.detach().contiguous() for k, v in weights.items()}


def eagle_batch(
    target: LlamaForCausalLM, windows: torch.Tensor, bf16: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head's inputs and targets for ``windows`` ([batch, n] tokens): the embeddings
    of tokens 1..n-2 and the target's features at 0..n-3 (its input), the features at
    1..n-2 and the tokens 2..n-1 (what it predicts)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        features = target.model(input_ids=windows[:, :-1]).last_hidden_state.float()
        embedded = target.model.embed_tokens(windows[:, 1:-1]).float()
    return embedded, features[:, :-1], features[:, 1:], windows[:, 2:]


def fit_head(
    name: str,
    head: nn.Module,
    losses_of: Callable[[torch.Tensor, torch.Generator], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    minutes: float,
    lr: float,
    stream: torch.Tensor,
    examples: list[torch.Tensor],
    args: argparse.Namespace,
    seed: int,
) -> dict[str, Any]:
    """AdamW on ``head`` for ``minutes`` of wall time (warmup, then cosine decay), a batch
    of ``batch`` a step: ``losses_of(windows, generator)`` gives the loss to minimise and
    the named parts to log and report (``final_<part>``: the mean of the last 20 steps)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    budget, step, logged = minutes * 60, 0, []
    start = last_log = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget:
        for group in opt.param_groups:
            group["lr"] = learning_rate(lr, step, elapsed / budget)
        windows, _ = batch(stream, examples, args, gen)
        loss, parts = losses_of(windows, gen)
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        logged.append({part: value.item() for part, value in parts.items()})
        if time.perf_counter() - last_log >= args.log_seconds:
            last_log = time.perf_counter()
            recent = {part: sum(x[part] for x in logged[-10:]) / len(logged[-10:]) for part in parts}
            shown = "  ".join(f"{part.replace('_', ' ')} {value:.4f}" for part, value in recent.items())
            print(f"{name}: step {step:5d}  {shown}  lr {opt.param_groups[0]['lr']:.2e}", flush=True)
    last = logged[-20:]
    finals = {f"final_{part}": round(sum(x[part] for x in last) / max(1, len(last)), 4) for part in logged[0]}
    return {
        "steps": step,
        "train_tokens_seen": step * args.batch_size * args.seq_len,
        "train_seconds": round(time.perf_counter() - start, 1),
        **finals,
    }


def train_eagle(
    target: LlamaForCausalLM,
    stream: torch.Tensor,
    examples: list[torch.Tensor],
    args: argparse.Namespace,
) -> tuple[EagleHead, dict[str, Any]]:
    """EAGLE's objective for ``--eagle-minutes``, the target frozen (see the module's docstring)."""
    target.train(False)
    target.requires_grad_(False)
    head = EagleHead(target)

    def losses(windows: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        embedded, features, next_features, next_tokens = eagle_batch(target, windows, args.bf16)
        noise = (torch.rand(features.shape, generator=gen) * 2 - 1) * args.eagle_noise
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            out = head(embedded, features + noise).float()
            logits = target.lm_head(out).float()
        feature_loss = F.smooth_l1_loss(out, next_features)
        token_loss = F.cross_entropy(logits.transpose(1, 2), next_tokens)
        return feature_loss + 0.1 * token_loss, {"feature_loss": feature_loss, "token_loss": token_loss}

    stats = fit_head("eagle", head, losses, args.eagle_minutes, args.eagle_lr, stream, examples, args, args.seed + 7)
    return head, stats


@torch.inference_mode()
def eagle_accuracy(head: EagleHead, target: LlamaForCausalLM, stream: torch.Tensor, args: argparse.Namespace) -> float:
    """Held-out top-1 accuracy of the head's token after next, given the target's features
    (teacher-forced: the first drafted token's chance of being the target's choice is
    bounded by it)."""
    head.train(False)
    n = min(len(stream) - 1, args.eval_tokens) // (args.seq_len + 1) * (args.seq_len + 1)
    windows = stream[:n].view(-1, args.seq_len + 1)
    right = total = 0
    for i in range(0, len(windows), 8):
        embedded, features, _, next_tokens = eagle_batch(target, windows[i : i + 8], args.bf16)
        guessed = target.lm_head(head(embedded, features)).argmax(-1)
        right += int((guessed == next_tokens).sum())
        total += next_tokens.numel()
    return right / max(1, total)


class Eagle3Head(nn.Module):
    """An EAGLE-3 head over ``target`` as radixserve serves one (models/eagle.py), in HF's modules."""

    draft_tokens: torch.Tensor  # the target's id of each draft token

    def __init__(self, target: LlamaForCausalLM, layer_ids: list[int], draft_tokens: torch.Tensor):
        super().__init__()
        config = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})
        config._attn_implementation = "sdpa"  # causal without a mask
        hidden = config.hidden_size
        self.layer_ids, self.vocab_size = layer_ids, config.vocab_size
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(config, 0)
        attn = self.layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, nn.Linear(2 * hidden, getattr(attn, name).out_features, bias=False))
        self.hidden_norm = LlamaRMSNorm(hidden, config.rms_norm_eps)
        self.norm = LlamaRMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, len(draft_tokens), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(target.lm_head.weight[draft_tokens])
        self.register_buffer("draft_tokens", draft_tokens)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, embedded: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The head's output (before its final norm) at every position."""
        layer = self.layer
        joined = torch.cat([layer.input_layernorm(embedded), self.hidden_norm(features)], dim=-1)
        positions = torch.arange(joined.shape[1])[None].expand(joined.shape[0], -1)
        attended = layer.self_attn(joined, position_embeddings=self.rotary(joined, positions), attention_mask=None)[0]
        residual = features + attended
        out: torch.Tensor = residual + layer.mlp(layer.post_attention_layernorm(residual))
        return out

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.norm(out))
        return logits

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """EAGLE-3's tensor names."""
        weights = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight}
        weights.update({f"midlayer.{k}": v for k, v in self.layer.state_dict().items()})
        weights["midlayer.hidden_norm.weight"] = self.hidden_norm.weight
        weights.update(eagle3_token_map(self.draft_tokens.tolist(), self.vocab_size))
        return {k: v.detach().contiguous() for k, v in weights.items()}


def eagle3_layers(target: LlamaForCausalLM) -> list[int]:
    layers = target.config.num_hidden_layers
    return [0, layers // 2, layers - 1]


def eagle3_batch(
    target: LlamaForCausalLM, head: Eagle3Head, windows: torch.Tensor, bf16: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``windows`` ([batch, n] tokens): the target's layer outputs at 0..n-3 side by
    side and the embeddings of tokens 1..n-2 (the head's input), the target's
    distribution of tokens 2..n-1 over the draft vocabulary (what it learns) and its
    greedy choice of them."""
    outputs: dict[int, torch.Tensor] = {}
    hooks = [
        target.model.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i in head.layer_ids
    ]
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = target(input_ids=windows[:, :-1]).logits.float()
            embedded = target.model.embed_tokens(windows[:, 1:-1]).float()
    finally:
        for hook in hooks:
            hook.remove()
    features = torch.cat([outputs[i].float() for i in head.layer_ids], dim=-1)[:, :-1]
    wanted = torch.softmax(logits[:, 1:, head.draft_tokens], dim=-1)
    return features, embedded, wanted, logits[:, 1:].argmax(-1)


def eagle3_losses(
    head: Eagle3Head, features: torch.Tensor, embedded: torch.Tensor, wanted: torch.Tensor, passes: int
) -> list[torch.Tensor]:
    """The cross-entropy against ``wanted``, a value per pass: the first reads the
    target's features, each later one the head's own output of the position before
    in the pass before (the first position keeps what it read)."""
    features = head.fc(features)
    losses = []
    for _ in range(passes):
        out = head(embedded, features)
        log_probs = torch.log_softmax(head.draft_logits(out).float(), dim=-1)
        losses.append(-(wanted * log_probs).sum(-1).mean())
        features = torch.cat([features[:, :1], out[:, :-1]], dim=1)
    return losses


def train_eagle3(
    target: LlamaForCausalLM,
    stream: torch.Tensor,
    examples: list[torch.Tensor],
    args: argparse.Namespace,
) -> tuple[Eagle3Head, dict[str, Any]]:
    """EAGLE-3's objective for ``--eagle3-minutes``, the target frozen (see the module's docstring)."""
    target.train(False)
    target.requires_grad_(False)
    counts = torch.bincount(stream, minlength=target.config.vocab_size)
    draft_tokens = counts.topk(args.eagle3_draft_vocab).indices.sort().values
    head = Eagle3Head(target, eagle3_layers(target), draft_tokens)

    def losses(windows: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        features, embedded, wanted, _ = eagle3_batch(target, head, windows, args.bf16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            passes = eagle3_losses(head, features, embedded, wanted, args.eagle3_passes)
        loss = torch.stack([0.8**i * pass_loss for i, pass_loss in enumerate(passes)]).sum()
        return loss, {"loss": passes[0], "ahead_loss": passes[-1]}

    stats = fit_head(
        "eagle3", head, losses, args.eagle3_minutes, args.eagle3_lr, stream, examples, args, args.seed + 11
    )
    share = float(counts[draft_tokens].sum() / counts.sum())
    return head, {
        "layer_ids": head.layer_ids,
        "draft_vocab_size": len(draft_tokens),
        "draft_vocab_share_of_tokens": round(share, 4),
        **stats,
    }


@torch.inference_mode()
def eagle3_agreement(
    head: Eagle3Head, target: LlamaForCausalLM, stream: torch.Tensor, args: argparse.Namespace
) -> float:
    """Held-out share of positions where the head's token after next (given the target's
    features) is the target's own greedy choice of it."""
    head.train(False)
    n = min(len(stream) - 1, args.eval_tokens) // (args.seq_len + 1) * (args.seq_len + 1)
    windows = stream[:n].view(-1, args.seq_len + 1)
    right = total = 0
    for i in range(0, len(windows), 8):
        features, embedded, _, chosen = eagle3_batch(target, head, windows[i : i + 8], args.bf16)
        guessed = head.draft_tokens[head.draft_logits(head(embedded, head.fc(features))).argmax(-1)]
        right += int((guessed == chosen).sum())
        total += chosen.numel()
    return right / max(1, total)


@torch.inference_mode()
def heldout_loss(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int, max_tokens: int) -> float:
    """Mean loss per token over non-overlapping windows of the held-out stream."""
    model.train(False)
    n = min(len(stream) - 1, max_tokens) // seq_len * seq_len
    inputs, labels = stream[:n].view(-1, seq_len), stream[1 : n + 1].view(-1, seq_len)
    total = 0.0
    for i in range(0, len(inputs), 8):
        logits = model(input_ids=inputs[i : i + 8]).logits
        total += F.cross_entropy(logits.flatten(0, 1), labels[i : i + 8].flatten(), reduction="sum").item()
    return total / n


def continue_prompts(tokenizer: PreTrainedTokenizerFast, files: list[str], n: int, rng: random.Random) -> list[str]:
    """200-400 tokens from the start of each held-out file, then from top-level ``def``/``class`` lines."""
    starts = [(text, 0) for text in files]
    later = [(text, m.start()) for text in files for m in re.finditer(r"^(?:async def|def|class) ", text, re.M)]
    rng.shuffle(later)
    prompts = []
    for text, start in starts + later:
        chunk = text[start : start + 4000]
        ids = tokenizer.encode(chunk, add_special_tokens=False)
        length = rng.randint(200, 400)
        prompt = tokenizer.backend_tokenizer.decode(ids[:length])
        if len(ids) >= length + 64 and chunk.startswith(prompt):  # something left to continue, a clean cut
            prompts.append(prompt)
        if len(prompts) == n:
            break
    return prompts


def functions_of(files: list[str]) -> list[str]:
    """Every function and method in ``files``, dedented, ending with one newline."""
    functions = []
    for text in files:
        lines = text.splitlines(keepends=True)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                functions.append(textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno])).rstrip() + "\n")
    return functions


def repeat_examples(tokenizer: PreTrainedTokenizerFast, files: list[str], max_tokens: int) -> list[torch.Tensor]:
    """``<s>`` function, marker, the same function again ``</s>``, tokenized, for every function of
    ``files`` of 24 to ``max_tokens`` tokens: the shape of a ``repeat`` prompt and its answer."""
    functions = [f for f in functions_of(files) if f.startswith(("def ", "async def "))]
    lengths = [len(e.ids) for e in tokenizer.backend_tokenizer.encode_batch(functions, add_special_tokens=False)]
    texts = [f + REPEAT_MARKER + f for f, n in zip(functions, lengths, strict=True) if 24 <= n <= max_tokens]
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return [torch.tensor([bos, *e.ids, eos], dtype=torch.long) for e in encodings]


def repeat_prompts(
    tokenizer: PreTrainedTokenizerFast, files: list[str], n: int, rng: random.Random, max_tokens: int
) -> list[tuple[str, str]]:
    """(prompt, the rest of the function it should be continued with) for held-out functions of
    32 to ``max_tokens`` tokens: the function, the marker comment, its ``def`` line up to ``(``."""
    functions = functions_of(files)
    rng.shuffle(functions)
    prompts = []
    for source in functions:
        head, paren, rest = source.partition("(")
        if not paren or not head.startswith(("def ", "async def ")):  # a def line split oddly, or not dedented
            continue
        if 32 <= len(tokenizer.encode(source, add_special_tokens=False)) <= max_tokens:
            prompts.append((source + REPEAT_MARKER + head + paren, rest))
        if len(prompts) == n:
            break
    return prompts


@torch.inference_mode()
def copied_fraction(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: list[tuple[str, str]]
) -> float:
    """Mean fraction of each function's rest that greedy decoding reproduces exactly (common prefix)."""
    model.train(False)
    fractions = []
    for prompt, expected in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        budget = len(tokenizer.encode(expected, add_special_tokens=False)) + 4
        out = model.generate(ids, max_new_tokens=budget, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        text = tokenizer.backend_tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
        same = next((i for i, (a, b) in enumerate(zip(text, expected, strict=False)) if a != b), None)
        fractions.append((min(len(text), len(expected)) if same is None else same) / len(expected))
    return sum(fractions) / max(1, len(fractions))


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (avx512_bf16 or AMX). Without,
    autocast's bfloat16 matmuls are emulated: about 12x slower than float32 on a 2-core
    AVX2 EPYC (265 against 3,275 training tokens/s for the target)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch and tokenizers threads (0: their default)")
    parser.add_argument("--quick", action="store_true", help="tiny everything, for a smoke run in seconds")
    parser.add_argument("--heldout-kb", type=int, default=300, help="held-out files, about this many KB")
    parser.add_argument("--max-train-files", type=int, default=0, help="0: all")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument(
        "--seq-len", type=int, default=512, help="training window: holds a continue prompt and its continuation"
    )
    parser.add_argument(
        "--repeat-fraction", type=float, default=0.5, help="share of training windows of repeat examples"
    )
    parser.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bfloat16 autocast in training (default: where the CPU multiplies bfloat16 natively)",
    )
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--target-minutes", type=float, default=7.5)
    parser.add_argument("--draft-minutes", type=float, default=3.0)
    parser.add_argument("--target-lr", type=float, default=2e-3)
    parser.add_argument("--draft-lr", type=float, default=3e-3)
    parser.add_argument("--eagle-minutes", type=float, default=3.0)
    parser.add_argument("--eagle-lr", type=float, default=3e-3)
    parser.add_argument("--eagle-noise", type=float, default=0.1, help="uniform jitter of the head's input features")
    parser.add_argument("--eagle3-minutes", type=float, default=3.0, help="0: no EAGLE-3 head")
    parser.add_argument("--eagle3-lr", type=float, default=3e-3)
    parser.add_argument("--eagle3-draft-vocab", type=int, default=1024, help="the EAGLE-3 head's draft vocabulary")
    parser.add_argument(
        "--eagle3-passes", type=int, default=3, help="passes a step: the target's features, then the head's own"
    )
    parser.add_argument(
        "--reuse-models", action="store_true", help="load the target, draft and tokenizer under --out-dir; train heads"
    )
    for role, size in SIZES.items():
        for field in fields(ModelSize):
            flag = f"--{role}-{field.name.replace('_', '-')}"
            parser.add_argument(flag, type=int, default=getattr(size, field.name))
    parser.add_argument("--eval-tokens", type=int, default=1 << 17, help="held-out tokens the loss is taken over")
    parser.add_argument("--num-prompts", type=int, default=200, help="heldout.jsonl prompts of each kind")
    parser.add_argument(
        "--repeat-max-tokens", type=int, default=120, help="longest function a repeat prompt or example holds"
    )
    parser.add_argument("--check-prompts", type=int, default=8, help="repeat prompts the copy check generates on")
    parser.add_argument("--log-seconds", type=float, default=20.0)
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args()
    if args.bf16 is None:
        args.bf16 = native_bf16()
        print(f"bfloat16 autocast: {'on' if args.bf16 else 'off (this CPU has no avx512_bf16 or amx_bf16)'}")
    out_dir = args.out_dir or DEFAULT_OUT_DIR.with_name(DEFAULT_OUT_DIR.name + ("-quick" if args.quick else ""))
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # tokenizers' pool, read when first used
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    begin = time.perf_counter()
    wall: dict[str, float] = {}

    train_files, heldout_files = split(stdlib_sources(), args.heldout_kb * 1000, args.seed)
    train_texts = [text for _, text in train_files][: args.max_train_files or None]
    heldout_texts = [text for _, text in heldout_files]
    if args.reuse_models:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir / "target")
    else:
        tokenizer = train_tokenizer(train_texts, args.vocab_size)
    train_stream, heldout_stream = token_stream(tokenizer, train_texts), token_stream(tokenizer, heldout_texts)
    unigram = unigram_loss(train_stream, heldout_stream, len(tokenizer))
    examples = repeat_examples(tokenizer, train_texts, args.repeat_max_tokens) if args.repeat_fraction > 0 else []
    wall["tokenizer_and_corpus"] = round(time.perf_counter() - begin, 1)
    print(
        f"corpus: {len(train_texts)} training files ({len(train_stream)} tokens), "
        f"{len(heldout_texts)} held out ({len(heldout_stream)} tokens); vocab {len(tokenizer)}; "
        f"held-out loss of token frequencies alone {unigram:.4f}; {len(examples)} repeat examples",
        flush=True,
    )

    rng = random.Random(args.seed)
    continues = continue_prompts(tokenizer, heldout_texts, args.num_prompts, rng)
    repeats = repeat_prompts(tokenizer, heldout_texts, args.num_prompts, rng, args.repeat_max_tokens)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.reuse_models:
        with open(out_dir / "heldout.jsonl", "w") as f:
            for prompt in continues:
                f.write(json.dumps({"prompt": prompt, "kind": "continue"}) + "\n")
            for prompt, _ in repeats:
                f.write(json.dumps({"prompt": prompt, "kind": "repeat"}) + "\n")

    results: dict[str, Any] = {}
    trained: dict[str, LlamaForCausalLM] = {}
    if args.reuse_models:
        results = {k: v for k, v in json.loads((out_dir / "summary.json").read_text()).items() if k in SUMMARY_PARTS}
        trained = {role: LlamaForCausalLM.from_pretrained(out_dir / role) for role in SIZES}
    for i, role in enumerate(SIZES):
        if args.reuse_models:
            break
        size = ModelSize(**{f.name: getattr(args, f"{role}_{f.name}") for f in fields(ModelSize)})
        model = build_model(size, tokenizer, args.seed + i)
        parameters = sum(p.numel() for p in model.parameters())
        print(f"{role}: {asdict(size)}, {parameters} parameters", flush=True)
        minutes, lr = getattr(args, f"{role}_minutes"), getattr(args, f"{role}_lr")
        stats = train(role, model, train_stream, examples, args, minutes, lr)
        start = time.perf_counter()
        loss = heldout_loss(model, heldout_stream, args.seq_len, args.eval_tokens)
        copied = copied_fraction(model, tokenizer, repeats[: args.check_prompts])
        stats["check_seconds"] = round(time.perf_counter() - start, 1)
        print(f"{role}: held-out loss {loss:.4f} per token; copies {copied:.0%} of a repeated function", flush=True)
        trained[role] = model
        model.save_pretrained(out_dir / role)  # safetensors: transformers 5 writes nothing else
        tokenizer.save_pretrained(out_dir / role)
        results[role] = {
            "size": asdict(size),
            "parameters": parameters,
            "heldout_loss": round(loss, 4),
            "repeat_copied_fraction": round(copied, 4),
            **stats,
        }

    if args.eagle_minutes > 0:
        head, stats = train_eagle(trained["target"], train_stream, examples, args)
        accuracy = eagle_accuracy(head, trained["target"], heldout_stream, args)
        print(f"eagle: held-out accuracy of the token after next {accuracy:.1%}", flush=True)
        (out_dir / "eagle").mkdir(exist_ok=True)
        (out_dir / "eagle" / "config.json").write_text(json.dumps(head_config(out_dir / "target"), indent=2))
        save_file(head.checkpoint(), str(out_dir / "eagle" / "model.safetensors"))
        results["eagle"] = {
            "parameters": sum(p.numel() for p in head.parameters()),
            "heldout_top1_accuracy": round(accuracy, 4),
            **stats,
        }

    if args.eagle3_minutes > 0:
        head3, stats = train_eagle3(trained["target"], train_stream, examples, args)
        agreement = eagle3_agreement(head3, trained["target"], heldout_stream, args)
        print(f"eagle3: held-out agreement with the target on the token after next {agreement:.1%}", flush=True)
        (out_dir / "eagle3").mkdir(exist_ok=True)
        config = eagle3_head_config(out_dir / "target", len(head3.draft_tokens), head3.layer_ids)
        (out_dir / "eagle3" / "config.json").write_text(json.dumps(config, indent=2))
        save_file(head3.checkpoint(), str(out_dir / "eagle3" / "model.safetensors"))
        results["eagle3"] = {
            "parameters": sum(p.numel() for p in head3.parameters()),
            "heldout_top1_agreement": round(agreement, 4),
            **stats,
        }

    wall["total"] = round(time.perf_counter() - begin, 1)
    summary = {
        "seed": args.seed,
        "quick": args.quick,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "corpus": {
            "stdlib": sysconfig.get_paths()["stdlib"],
            "train_files": len(train_texts),
            "heldout_files": len(heldout_texts),
            "train_tokens": len(train_stream),
            "repeat_examples": len(examples),
            "heldout_tokens": len(heldout_stream),
            "heldout_names": [name for name, _ in heldout_files],
            "heldout_unigram_loss": round(unigram, 4),
            "eval_tokens": min(len(heldout_stream) - 1, args.eval_tokens) // args.seq_len * args.seq_len,
        },
        "vocab_size": len(tokenizer),
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "repeat_fraction": args.repeat_fraction,
        "bf16_autocast": args.bf16,
        "prompts": {"continue": len(continues), "repeat": len(repeats)},
        **results,
        "wall_seconds": wall,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out_dir} in {wall['total']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
