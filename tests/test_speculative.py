"""Speculative decoding (docs/speculative.md): the n-gram proposer finds what a
scan finds; verification keeps exactly the greedy run and, under sampling,
draws every token from the target's distribution (the sampling-frequency check
of test_sampling, through the rejection rule); through the scheduler, greedy
tokens and logprobs are the ones plain decoding makes, with the radix cache,
chunked prefill, pages of 4, stops and budgets that cut a verified run, and
requests that take no proposals in the same batch; aborts and a broken proposer
leave the KV pool whole; a real server serves with it and says so."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
from generation_utils import generate, hf_model, make_scheduler, mixed_prompts, run, submit
from helpers_eagle import copying_eagle3_head, copying_eagle_head
from helpers_server import serving
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from test_sampling import FREQ_LOGITS, assert_drawn_from, expected_distribution
from transformers import AutoTokenizer, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer as HFLlamaDecoderLayer
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from radixserve.config import ServerArgs
from radixserve.hooks import hookimpl
from radixserve.messages import FinishReason
from radixserve.models.eagle import LlamaEagle3Head
from radixserve.registry import PluginRegistry
from radixserve.runtime.execution.eagle_head import FEATURE_BACKLOG
from radixserve.runtime.execution.sampler import SamplingBatch
from radixserve.runtime.execution.verifier import NO_PROPOSAL, verify, walk
from radixserve.runtime.scheduling.scheduler import Scheduler
from radixserve.sampling.params import SamplingParams
from radixserve.speculative.base import DraftRequest, Proposer, ProposerSettings
from radixserve.speculative.ngram import NgramProposer
from radixserve.structured_output.backend import GrammarSpec
from radixserve.testing import check_proposer

PRIORITY = {"backend_selection": "priority"}
NGRAM = {"speculative_algorithm": "ngram", "speculative_max_batch_size": 8}  # the batches here run up to 5
GREEDY = {"temperature": 0.0, "ignore_eos": True}


# ---- the n-gram proposer ------------------------------------------------------


def ngram(low: int = 1, high: int = 3, k: int = 3) -> NgramProposer:
    return NgramProposer(ProposerSettings(num_draft_tokens=k, ngram_min_match=low, ngram_max_match=high))


def test_ngram_proposes_what_followed_the_longest_then_latest_match():
    # [2, 3] ended at 3 (-> 9) and at 7 (-> 7, 8, 4): the latest wins.
    assert ngram().propose([DraftRequest("a", [1, 2, 3, 9, 5, 2, 3, 7, 8, 4, 2, 3], 3)]) == [[7, 8, 4]]
    # [1, 2, 3] (n = 3) beats the later [2, 3]; max_tokens bounds the proposal.
    seq = [1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3]
    assert ngram().propose([DraftRequest("b", seq, 3), DraftRequest("c", seq, 1)]) == [[9, 5, 2], [9]]
    assert ngram().propose([DraftRequest("d", [4, 5, 6], 3), DraftRequest("e", seq, 0)]) == [[], []]


def scan(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """What the proposer must find, by brute force."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == tokens[len(tokens) - n :]:
                return tokens[end : end + k]
    return []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=50), st.integers(1, 3), st.integers(0, 3))
def test_ngram_index_finds_what_a_scan_finds(tokens, low, extra):
    """Asked after each token as a request grows (the index extended each time), and
    again from scratch by a second request id."""
    proposer = ngram(low, low + extra, 4)
    for n in range(1, len(tokens) + 1):
        assert proposer.propose([DraftRequest("grown", tokens[:n], 4)]) == [scan(tokens[:n], low, low + extra, 4)]
    proposer.forget("grown")
    assert proposer.propose([DraftRequest("grown", tokens, 4)]) == [scan(tokens, low, low + extra, 4)]


class StatefulByBatchPosition(Proposer):
    """Wrong in two ways the kit must catch: proposals depend on a request's place
    in the batch, and one more token than asked for."""

    name = "by-position"

    def propose(self, requests):
        return [[i] * (r.max_tokens + (1 if i == 2 else 0)) for i, r in enumerate(requests)]


class StaleState(Proposer):
    """Wrong in another way: it keeps each request's first proposal for good."""

    name = "stale"

    def __init__(self, settings):
        super().__init__(settings)
        self.kept = {}

    def propose(self, requests):
        return [
            self.kept.setdefault(r.rid, list(r.token_ids[-r.max_tokens :]) if r.max_tokens else []) for r in requests
        ]


def test_the_proposer_kit_passes_ngram_and_catches_wrong_proposers():
    check_proposer("ngram").raise_for_failures(min_run=4)
    failed = {r.case: r.error for r in check_proposer(StatefulByBatchPosition).failures}
    assert set(failed) == {"bounds", "alone-or-batched"}, failed
    assert "was proposed [2, 2, 2]" in failed["bounds"]
    failed = {r.case: r.error for r in check_proposer(StaleState).failures}
    assert set(failed) == {"grown-step-by-step", "forget"}, failed


# ---- verification ---------------------------------------------------------------


def rows_batch(params: list[SamplingParams], output_lens: list[int] | None = None) -> SamplingBatch:
    return SamplingBatch(params, output_lens or [0] * len(params), [None] * len(params))


def test_greedy_rows_keep_the_run_that_matches_the_argmax():
    vocab = 8
    argmaxes = [3, 5, 2, 0, 4]  # request A: rows 0-3 (proposals 3, 5, 1); request B: row 4
    logits = torch.full((5, vocab), -1.0)
    logits[torch.arange(5), torch.tensor(argmaxes)] = 2.0
    proposed = [3, 5, 1, NO_PROPOSAL, NO_PROPOSAL]
    out = verify(logits, rows_batch([SamplingParams(temperature=0.0)] * 5), proposed, return_logprob=True)
    kept, tokens = out.kept.tolist(), out.tokens.tolist()
    assert kept == [True, True, False, False, False]
    logprobs = out.token_logprobs.tolist()
    a = walk(0, [3, 5, 1], kept, tokens, logprobs, out.proposal_logprobs.tolist(), [])
    assert a.tokens == [3, 5, 2] and a.accepted == 2
    expected = [torch.log_softmax(logits[r], -1)[t].item() for r, t in ((0, 3), (1, 5), (2, 2))]
    assert a.logprobs == pytest.approx(expected)
    assert walk(4, [], kept, tokens, None, None, []).tokens == [4]


SAMPLED_CASES = {
    "temperature 1, a likely proposal": (dict(temperature=1.0), 0),
    "temperature 0.7, an unlikely proposal": (dict(temperature=0.7), 5),
    "top_k 3, a proposal outside it": (dict(temperature=1.0, top_k=3), 4),
    "top_p 0.9 and min_p 0.05": (dict(temperature=1.2, top_p=0.9, min_p=0.05), 2),
}


@pytest.mark.parametrize("case", list(SAMPLED_CASES))
@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_rows_draw_from_the_targets_distribution(case, seeded):
    """Many requests, each with one proposal judged by row 0 (logits FREQ_LOGITS)
    and a row 1 after it (the logits reversed): the first token each request gets
    follows row 0's distribution whatever the proposal, the proposal is kept with
    its probability there, and the second token (where it was kept) follows row 1's."""
    settings_, proposal = SAMPLED_CASES[case]
    draws = 20_000
    params = [SamplingParams(**settings_, seed=i if seeded else None) for i in range(draws) for _ in range(2)]
    first, second = torch.tensor(FREQ_LOGITS), torch.tensor(FREQ_LOGITS[::-1])
    logits = torch.stack([first, second]).repeat(draws, 1)
    proposed = [proposal, NO_PROPOSAL] * draws
    out = verify(logits, rows_batch(params, [0, 1] * draws), proposed, generator=torch.Generator().manual_seed(5))
    kept, tokens = out.kept[0::2], out.tokens.view(draws, 2)
    first_tokens = torch.where(kept, proposal, tokens[:, 0])
    expected = expected_distribution(FREQ_LOGITS, **settings_)
    assert_drawn_from(torch.bincount(first_tokens, minlength=len(FREQ_LOGITS)).tolist(), expected)
    accepted = int(kept.sum())
    p = expected[proposal]
    assert abs(accepted - draws * p) <= 5 * (draws * p * (1 - p)) ** 0.5 + 1, (accepted, draws * p)
    if accepted > 100:
        counts = torch.bincount(tokens[kept, 1], minlength=len(FREQ_LOGITS)).tolist()
        assert_drawn_from(counts, expected_distribution(FREQ_LOGITS[::-1], **settings_))


# ---- through the scheduler ----------------------------------------------------------


def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts whose continuations the n-gram proposer can guess (a tiny random model
    falls into loops), random ones, and one twice (shared prefix, n > 1 alike)."""
    rand = mixed_prompts(vocab, [5, 33, 70], seed=11)
    looped = (rand[0] * 8)[:36]
    return [looped, *rand, rand[1]]


def plain_and_speculative(model_dir: Path, prompts, server_args: dict, **params):
    plain = generate(make_scheduler(model_dir, **PRIORITY, **server_args), prompts, **params)
    scheduler = make_scheduler(model_dir, **PRIORITY, **NGRAM, **server_args)
    return plain, generate(scheduler, prompts, **params), scheduler.stats()


CONFIGS = {
    "radix cache": {},
    "cache off": {"disable_radix_cache": True},
    "chunked prefill": {"chunked_prefill_size": 8},
    "pages of 4, 7 proposals": {"page_size": 4, "speculative_num_draft_tokens": 7},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_tokens_and_logprobs_are_plain_decodings(tiny_llama_dir, config):
    prompts = repetitive_prompts(512)
    plain, spec, stats = plain_and_speculative(
        tiny_llama_dir, prompts, CONFIGS[config], max_new_tokens=40, return_logprob=True, **GREEDY
    )
    for a, b in zip(plain, spec, strict=True):
        assert b.output_ids == a.output_ids
        assert b.finish_reason == a.finish_reason == FinishReason("length")
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    # Both kinds of verdict happened: proposals kept and proposals refused.
    assert stats.spec_verify_steps > 0
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_proposed_tokens_total


def test_a_speculative_worker_reports_the_tokens_its_decode_steps_give(tiny_llama_dir):
    """Each decode band's ``output_tokens_per_s`` (what a router predicts a request's time
    per output token from) counts the proposals a verify step kept: above the band's rate
    of requests advanced where proposals were kept, equal to it without speculation."""
    prompts = repetitive_prompts(512)[:1]  # alone: every step in the batch-1 band
    plain_scheduler = make_scheduler(tiny_llama_dir, **PRIORITY)
    generate(plain_scheduler, prompts, max_new_tokens=40, **GREEDY)
    plain = plain_scheduler.stats()
    assert plain.decode_band_output_tokens_per_s[0] == pytest.approx(plain.decode_band_tokens_per_s[0])
    spec_scheduler = make_scheduler(tiny_llama_dir, **PRIORITY, **NGRAM)
    generate(spec_scheduler, prompts, max_new_tokens=40, **GREEDY)
    spec = spec_scheduler.stats()
    assert spec.spec_accepted_tokens_total > 0
    # The tokens after the first (a prefill's) over the decode steps that made them.
    per_request_step = spec.decode_band_output_tokens_per_s[0] / spec.decode_band_tokens_per_s[0]
    assert 1 < per_request_step <= 1 + spec_scheduler.args.speculative_num_draft_tokens


def test_stops_and_budgets_cut_inside_a_verified_run(tiny_llama_dir):
    """A stop string and max_new_tokens that end a request inside the run of tokens
    one verify step kept (this prompt's output settles into repeating one token
    after about 20, which the proposer then guesses), a stop token, min_new_tokens
    and logit_bias: it ends where plain decoding ends, with the same tokens."""
    prompt = repetitive_prompts(512)[1]
    [free] = generate(make_scheduler(tiny_llama_dir, **PRIORITY), [prompt], max_new_tokens=40, **GREEDY)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    stop = tokenizer.decode(free.output_ids[26:29])
    cases = [
        dict(max_new_tokens=40, min_new_tokens=26, stop=[stop], ignore_eos=True),
        dict(max_new_tokens=27, ignore_eos=True),
        dict(max_new_tokens=40, stop_token_ids=[free.output_ids[30]]),
        dict(max_new_tokens=30, min_new_tokens=20, logit_bias={free.output_ids[30]: 0.5}),
    ]
    plain_s, spec_s = make_scheduler(tiny_llama_dir, **PRIORITY), make_scheduler(tiny_llama_dir, **PRIORITY, **NGRAM)
    for params in cases:
        accepted = spec_s.stats().spec_accepted_tokens_total
        [plain] = generate(plain_s, [prompt], temperature=0.0, **params)
        spec = generate(spec_s, [prompt], temperature=0.0, **params)
        assert spec[0].output_ids == plain.output_ids, params
        assert spec[0].finish_reason == plain.finish_reason, params
        assert spec_s.stats().spec_accepted_tokens_total > accepted, params
        if "stop" in params:
            assert spec[0].finish_reason == FinishReason("stop", stop) and 20 < len(spec[0].output_ids) < 40


def test_penalties_count_the_proposals_before_each_row(tiny_llama_dir):
    """Repetition, frequency and presence penalties under speculation: each row of a
    verify step counts the proposals before it as outputs, so the tokens are plain
    decoding's, alone and beside requests without penalties."""
    prompts = repetitive_prompts(512)[:2]
    penalties = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.4), dict(presence_penalty=0.6)]
    results, accepted = [], 0
    for speculation in ({}, NGRAM):
        scheduler = make_scheduler(tiny_llama_dir, **PRIORITY, **speculation)
        rids = [submit(scheduler, prompts[0], max_new_tokens=40, **GREEDY, **p) for p in penalties]
        rids += [submit(scheduler, p, max_new_tokens=40, **GREEDY) for p in prompts]
        done = run(scheduler)
        results.append([done[r].output_ids for r in rids])
        accepted = scheduler.stats().spec_accepted_tokens_total
    assert results[1] == results[0]
    assert results[0][0] != results[0][3], "the penalty should change the looping request's tokens"
    assert accepted > 0
    # Alone, so that what was kept was a penalised request's.
    [plain], [spec], stats = plain_and_speculative(
        tiny_llama_dir, prompts[:1], {}, max_new_tokens=40, frequency_penalty=0.2, **GREEDY
    )
    assert spec.output_ids == plain.output_ids and stats.spec_accepted_tokens_total > 0


def test_a_grammar_cuts_the_proposals_it_forbids_and_masks_each_row(tiny_llama_dir):
    """Constrained requests (a regex whose text repeats, so the n-gram proposer guesses
    it; alone in the batch, so every kept proposal is theirs): each proposal the grammar
    forbids is cut before the step, each row is masked by the grammar after the
    proposals before it, and every request gets plain decoding's tokens; the matchers
    are released at the end."""
    spec = GrammarSpec("regex", "(hello world ){3,9}done")
    prompts = repetitive_prompts(512)
    results, accepted = [], 0
    for speculation in ({}, NGRAM):
        scheduler = make_scheduler(tiny_llama_dir, **PRIORITY, **speculation)
        rids = [submit(scheduler, p, max_new_tokens=60, temperature=0.0, grammar=spec) for p in prompts[:3]]
        done = run(scheduler)
        results.append([(done[r].output_ids, done[r].finish_reason) for r in rids])
        assert scheduler.grammars.active == 0
        accepted = scheduler.stats().spec_accepted_tokens_total
    assert results[1] == results[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for ids, reason in results[1][:3]:
        assert reason.type == "stop"
        assert re.fullmatch("(hello world ){3,9}done", tokenizer.decode(ids, skip_special_tokens=True))
    assert accepted > 0


def test_a_seeded_sampled_request_gets_its_tokens_alone_and_in_a_batch(tiny_llama_dir):
    """Under speculation a seeded request draws each position's tokens from its own
    generators, and the n-gram proposals depend on its tokens alone."""
    prompts = repetitive_prompts(512)
    params = dict(max_new_tokens=30, temperature=0.8, top_p=0.95, seed=42, ignore_eos=True)
    scheduler = make_scheduler(tiny_llama_dir, **PRIORITY, **NGRAM)
    [alone] = generate(scheduler, prompts[:1], **params)
    batch = generate(scheduler, prompts, **params)
    assert batch[0].output_ids == alone.output_ids
    assert scheduler.stats().spec_accepted_tokens_total > 0


def test_an_abort_between_verify_steps_leaves_the_pool_whole(tiny_llama_dir):
    scheduler = make_scheduler(tiny_llama_dir, **PRIORITY, **NGRAM)
    prompts = repetitive_prompts(512)
    rids = [submit(scheduler, p, max_new_tokens=60, **GREEDY) for p in prompts[:3]]
    outputs = []
    while scheduler.stats().spec_verify_steps < 3:
        outputs += scheduler.step()
    scheduler.abort(rids[0])
    assert scheduler.check_memory(), scheduler.stats()
    done = run(scheduler, earlier=outputs)
    assert done[rids[0]].finish_reason.type == "abort"
    assert all(done[r].finish_reason == FinishReason("length") for r in rids[1:])
    assert scheduler.stats().private_tokens == 0


class TokenOutsideTheVocabulary(Proposer):
    """A third party's proposer with a bug: for prompts starting with token 99 it
    proposes a token the model does not have."""

    name = "broken"

    def propose(self, requests):
        return [[1_000_000] if r.token_ids[0] == 99 else [] for r in requests]


class BrokenProposerPlugin:
    @hookimpl
    def register_speculative_proposers(self, register):
        register(TokenOutsideTheVocabulary)


def test_a_broken_proposer_fails_its_step_loudly_and_the_scheduler_goes_on(tiny_llama_dir):
    registry = PluginRegistry()
    registry.register_plugin(BrokenProposerPlugin(), "broken-proposer")
    scheduler = make_scheduler(tiny_llama_dir, registry, **PRIORITY, speculative_algorithm="broken")
    [failed] = generate(scheduler, [[99, 40, 41, 42]], max_new_tokens=8, **GREEDY)
    assert failed.finish_reason.type == "abort" and failed.finish_reason.status_code == 500
    assert "proposer 'broken' proposed token ids outside the vocabulary" in failed.finish_reason.message
    [fine] = generate(scheduler, [[98, 40, 41, 42]], max_new_tokens=8, **GREEDY)
    assert fine.finish_reason == FinishReason("length") and len(fine.output_ids) == 8
    assert scheduler.stats().private_tokens == 0


# ---- the draft-model proposer --------------------------------------------------------


@pytest.fixture(scope="module")
def small_draft_dir(tiny_model_factory) -> Path:
    """A draft with the tiny Llama's tokenizer: one layer, half the width, other weights."""
    return tiny_model_factory(arch="llama", num_layers=1, hidden_size=32, seed=5)


def test_a_draft_model_gives_plain_decodings_tokens_and_frees_its_kv(tiny_llama_dir, small_draft_dir):
    """The target as its own draft proposes exactly its greedy tokens (every proposal
    kept); an unrelated draft proposes others (refused). Both give plain decoding's
    tokens, under a ragged batch with chunked prefill and pages of 4, and the draft's
    pool is empty once the requests end."""
    prompts = repetitive_prompts(512)
    server_args = {"chunked_prefill_size": 16, "page_size": 4, "speculative_max_batch_size": 8}
    plain = generate(
        make_scheduler(tiny_llama_dir, **PRIORITY, chunked_prefill_size=16, page_size=4),
        prompts,
        max_new_tokens=24,
        **GREEDY,
    )
    for draft, all_kept in ((tiny_llama_dir, True), (small_draft_dir, False)):
        scheduler = make_scheduler(
            tiny_llama_dir,
            **PRIORITY,
            **server_args,
            speculative_algorithm="draft",
            speculative_draft_model_path=str(draft),
        )
        spec = generate(scheduler, prompts, max_new_tokens=24, **GREEDY)
        assert [r.output_ids for r in spec] == [r.output_ids for r in plain], draft
        stats = scheduler.stats()
        assert stats.spec_proposed_tokens_total > 0
        kept_all = stats.spec_accepted_tokens_total == stats.spec_proposed_tokens_total
        assert kept_all == all_kept, (draft, stats.spec_accepted_tokens_total, stats.spec_proposed_tokens_total)
        assert scheduler.speculation.draft_model.tokens_held() == 0


def test_the_draft_proposer_passes_the_kit(tiny_llama_dir):
    scheduler = make_scheduler(
        tiny_llama_dir, **PRIORITY, speculative_algorithm="draft", speculative_draft_model_path=str(tiny_llama_dir)
    )
    draft = scheduler.speculation.draft_model
    check_proposer("draft", ProposerSettings(num_draft_tokens=3, draft_model=draft)).raise_for_failures(min_run=4)


def test_a_draft_model_must_share_the_vocabulary(tiny_llama_dir, tiny_model_factory):
    other = tiny_model_factory(arch="llama", vocab_size=384)
    with pytest.raises(ValueError, match="speculative_draft_model_path: the draft model's vocabulary has 384"):
        make_scheduler(
            tiny_llama_dir, **PRIORITY, speculative_algorithm="draft", speculative_draft_model_path=str(other)
        )
    with pytest.raises(ValueError, match="runs a draft model; name one"):
        make_scheduler(tiny_llama_dir, **PRIORITY, speculative_algorithm="draft")
    with pytest.raises(ValueError, match="speculative_draft_model_path: is for --speculative-algorithm draft"):
        make_scheduler(tiny_llama_dir, **PRIORITY, speculative_draft_model_path=str(other))


# ---- the EAGLE proposer ---------------------------------------------------------------


@pytest.fixture(scope="module")
def eagle_head_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return copying_eagle_head(tiny_llama_dir, tmp_path_factory.mktemp("eagle"))


def hf_eagle_logits(target_dir: Path, head_dir: Path, token_ids: list[int], k: int) -> list[torch.Tensor]:
    """The logits of ``k`` drafted positions after ``token_ids``, computed from scratch
    with HF transformers' modules: the target's final hidden states of every token but
    the newest, then ``k`` times: ``fc`` over [embedding of token p + 1, feature of p]
    for every position, HF's Llama decoder layer (no input norm), the target's LM head
    on the last output; its argmax is the next drafted token, the output its feature."""
    target = hf_model(str(target_dir))
    config = LlamaConfig.from_pretrained(head_dir)
    config._attn_implementation = "sdpa"  # causal without a mask
    weights = load_file(head_dir / "model.safetensors")
    layer = HFLlamaDecoderLayer(config, 0)
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k[len("layers.0.") :]: v for k, v in weights.items() if k.startswith("layers.0.")})
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size)
    fc.load_state_dict({"weight": weights["fc.weight"], "bias": weights["fc.bias"]})
    rotary = LlamaRotaryEmbedding(config)
    with torch.no_grad():
        features = target.model(torch.tensor([token_ids[:-1]])).last_hidden_state[0]
        tokens, logits = list(token_ids), []
        for _ in range(k):
            x = fc(torch.cat([target.model.embed_tokens(torch.tensor(tokens[1:])), features], dim=-1))[None]
            positions = torch.arange(x.shape[1])[None]
            out = layer(x, position_ids=positions, position_embeddings=rotary(x, positions))[0, -1]
            logits.append(target.lm_head(out))
            tokens.append(int(logits[-1].argmax()))
            features = torch.cat([features, out[None]])
    return logits


def eagle_scheduler(target_dir: Path, head_dir: Path, **server_args):
    server_args.setdefault("speculative_max_batch_size", 8)
    return make_scheduler(
        target_dir, **PRIORITY, speculative_algorithm="eagle", speculative_eagle_path=str(head_dir), **server_args
    )


class RecordedDrafts:
    """Watches a scheduler's EAGLE proposer: for each request it was asked about, its
    tokens and the logits the head gave each drafted position."""

    def __init__(self, speculation):
        self.drafts: list[tuple[list[int], list[torch.Tensor]]] = []
        proposer, head = speculation.proposer, speculation.draft_model
        propose, next_token_logits, rows = proposer.propose, head.next_token_logits, {}

        def recording_logits(requests):
            logits = next_token_logits(requests)
            for request, row in zip(requests, logits, strict=True):
                rows.setdefault(request.rid, []).append(row.clone())
            return logits

        def recording_propose(requests):
            rows.clear()
            made = propose(requests)
            self.drafts += [(list(r.token_ids), rows[r.rid]) for r in requests if r.max_tokens]
            return made

        proposer.propose, head.next_token_logits = recording_propose, recording_logits


def assert_drafts_are_hfs(
    target_dir: Path, head_dir: Path, reference, prompts: list[list[int]], max_new_tokens: int, every: int
) -> int:
    """Through the scheduler (chunked prefill, pages of 4, no radix cache so that every
    head sequence starts at the prompt's first token): the logits of every ``every``-th
    request's drafted positions are ``reference``'s, computed from scratch with HF's
    modules (minus infinity at the same tokens), though the head computed them step by
    step (its own outputs standing in for features the target had not computed yet,
    computed again with the target's once kept); the tokens are plain decoding's, some
    proposals kept and some refused; the head's pool is empty at the end. Returns how
    many drafts were recorded."""
    server_args = {"chunked_prefill_size": 16, "page_size": 4, "disable_radix_cache": True}
    plain_s = make_scheduler(target_dir, **PRIORITY, **server_args)
    plain = generate(plain_s, prompts, max_new_tokens=max_new_tokens, **GREEDY)
    scheduler = eagle_scheduler(target_dir, head_dir, **server_args)
    recorded = RecordedDrafts(scheduler.speculation)
    spec = generate(scheduler, prompts, max_new_tokens=max_new_tokens, **GREEDY)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    stats = scheduler.stats()
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_proposed_tokens_total
    assert scheduler.speculation.draft_model.tokens_held() == 0
    for token_ids, rows in recorded.drafts[::every]:  # not all: each costs HF forwards
        expected = reference(target_dir, head_dir, token_ids, len(rows))
        for step, (ours, theirs) in enumerate(zip(rows, expected, strict=True)):
            assert torch.equal(ours.isfinite(), theirs.isfinite()), (len(token_ids), step)
            difference = (ours - theirs).nan_to_num(posinf=0, neginf=0).abs().max()
            assert difference < 1e-4, (len(token_ids), step)  # fp32: 1.3e-5 seen
    return len(recorded.drafts)


def test_an_eagle_head_drafts_what_hfs_layers_compute_and_gives_plain_decodings_tokens(tiny_llama_dir, eagle_head_dir):
    """EAGLE-1/2's layout (``assert_drafts_are_hfs``: HF's decoder layer on the target's
    final hidden states), a ragged batch, one prompt longer than the head's feature backlog."""
    prompts = [*repetitive_prompts(512)[:3], mixed_prompts(512, [FEATURE_BACKLOG + 20], seed=4)[0]]
    assert assert_drafts_are_hfs(tiny_llama_dir, eagle_head_dir, hf_eagle_logits, prompts, 30, every=2) >= 20


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_an_eagle_head_under_the_radix_cache_gives_plain_decodings_tokens(layout, request):
    """With the radix cache (a prompt twice, and each prompt again in a second round:
    those heads start after the cached prefix) and pages of 4, in EAGLE-1/2's and
    EAGLE-3's layouts: plain decoding's tokens, some proposals kept, the pools whole."""
    fixtures = {"eagle": ("tiny_llama_dir", "eagle_head_dir"), "eagle3": ("eagle3_target_dir", "eagle3_head_dir")}
    target_dir, head_dir = (request.getfixturevalue(name) for name in fixtures[layout])
    prompts = repetitive_prompts(512)
    plain_s = make_scheduler(target_dir, **PRIORITY, page_size=4)
    spec_s = eagle_scheduler(target_dir, head_dir, page_size=4)
    for _ in range(2):
        plain = generate(plain_s, prompts, max_new_tokens=20, **GREEDY)
        spec = generate(spec_s, prompts, max_new_tokens=20, **GREEDY)
        assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    stats = spec_s.stats()
    assert stats.spec_accepted_tokens_total > 0 and stats.cached_tokens_total > 0 and stats.private_tokens == 0
    assert spec_s.speculation.draft_model.tokens_held() == 0


def test_a_batch_too_large_to_speculate_trims_the_heads_features(tiny_llama_dir, eagle_head_dir):
    """Four requests where only two may speculate, prompts longer than the head's
    feature backlog: while four run, each keeps only its newest features and the head
    computes nothing for them; once two have ended, the others speculate from what
    they kept. Plain decoding's tokens; the head's pool empty at the end."""
    prompts = mixed_prompts(512, [FEATURE_BACKLOG + 40, FEATURE_BACKLOG + 60, 30, 40], seed=9)
    budgets = [40, 40, 6, 6]
    plain_s = make_scheduler(tiny_llama_dir, **PRIORITY, page_size=4)
    spec_s = eagle_scheduler(tiny_llama_dir, eagle_head_dir, page_size=4, speculative_max_batch_size=2)
    head = spec_s.speculation.draft_model
    results = []
    for scheduler in (plain_s, spec_s):
        rids = [submit(scheduler, p, max_new_tokens=n, **GREEDY) for p, n in zip(prompts, budgets, strict=True)]
        outputs = []
        while len(scheduler.running) < 4 or scheduler.waiting:  # the prompts prefilled, four decoding
            outputs += scheduler.step()
        if scheduler is spec_s:
            assert head.tokens_held() == 0  # nothing computed while the batch is too large
        done = run(scheduler, earlier=outputs)
        results.append([done[r].output_ids for r in rids])
    assert results[1] == results[0]
    assert spec_s.stats().spec_verify_steps > 0 and head.tokens_held() == 0


def test_an_eagle_head_is_checked_at_start(
    tiny_llama_dir, eagle_head_dir, small_draft_dir, tiny_model_factory, tmp_path
):
    with pytest.raises(ValueError, match="speculative_eagle_path: --speculative-algorithm eagle runs an EAGLE head"):
        make_scheduler(tiny_llama_dir, **PRIORITY, speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="speculative_eagle_path: --speculative-algorithm ngram runs no EAGLE head"):
        make_scheduler(
            tiny_llama_dir, **PRIORITY, speculative_algorithm="ngram", speculative_eagle_path=str(eagle_head_dir)
        )
    with pytest.raises(ValueError, match="speculative_eagle_path: is for --speculative-algorithm eagle"):
        make_scheduler(tiny_llama_dir, **PRIORITY, speculative_eagle_path=str(eagle_head_dir))
    with pytest.raises(ValueError, match="the head's hidden size is 64, the target's 32"):
        eagle_scheduler(small_draft_dir, eagle_head_dir)
    gemma = tiny_model_factory(arch="gemma2")
    with pytest.raises(ValueError, match="hidden states, which Gemma2ForCausalLM does not expose"):
        eagle_scheduler(gemma, eagle_head_dir)
    named = Path(shutil.copytree(eagle_head_dir, tmp_path / "head"))
    config = json.loads((named / "config.json").read_text())
    (named / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLMEagle"]}))
    with pytest.raises(ValueError, match="is an EAGLE head, which drafts for its target model: serve the target"):
        Scheduler(  # the head as the model, its config naming the head's architecture
            ServerArgs(model_path=str(named), max_total_tokens=8192, **PRIORITY),
            str(named),
            AutoTokenizer.from_pretrained(tiny_llama_dir),
        )


@pytest.fixture(scope="module")
def eagle3_target_dir(tiny_model_factory) -> Path:
    """A tiny Llama of four layers: an EAGLE-3 head reads three."""
    return tiny_model_factory(arch="llama", num_layers=4)


@pytest.fixture(scope="module")
def eagle3_head_dir(eagle3_target_dir, tmp_path_factory) -> Path:
    return copying_eagle3_head(eagle3_target_dir, tmp_path_factory.mktemp("eagle3"))


def hf_eagle3_logits(target_dir: Path, head_dir: Path, token_ids: list[int], k: int) -> list[torch.Tensor]:
    """The logits of ``k`` drafted positions after ``token_ids``, from scratch with HF
    transformers' modules as EAGLE-3 defines the head: the outputs of the target's
    layers the config names (forward hooks on HF's decoder layers) side by side for
    every token but the newest, through ``fc``; then ``k`` times, for every position,
    attention over [normed embedding of token p + 1, normed feature of p] (HF's Llama
    attention with projections twice as wide), the feature as the residual, HF's MLP
    block; the last output normed through the head's LM head over its draft
    vocabulary, placed at the target's ids (minus infinity elsewhere). Its argmax is
    the next drafted token, the un-normed output the next position's feature."""
    target = hf_model(str(target_dir))
    config = LlamaConfig.from_pretrained(head_dir)
    config._attn_implementation = "sdpa"  # causal without a mask
    weights = load_file(head_dir / "model.safetensors")
    hidden = config.hidden_size
    layer = HFLlamaDecoderLayer(config, 0)
    attn = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, torch.nn.Linear(2 * hidden, getattr(attn, name).out_features, bias=False))
    layer.hidden_norm = LlamaRMSNorm(hidden, config.rms_norm_eps)
    layer.load_state_dict({k[len("midlayer.") :]: v for k, v in weights.items() if k.startswith("midlayer.")})
    fc = torch.nn.Linear(3 * hidden, hidden, bias=False)
    fc.load_state_dict({"weight": weights["fc.weight"]})
    norm = LlamaRMSNorm(hidden, config.rms_norm_eps)
    norm.load_state_dict({"weight": weights["norm.weight"]})
    draft_ids = weights["d2t"] + torch.arange(len(weights["d2t"]))
    rotary = LlamaRotaryEmbedding(config)
    outputs: dict[int, torch.Tensor] = {}
    layer_ids = config.eagle_config["eagle_aux_hidden_state_layer_ids"]
    for i in layer_ids:
        target.model.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
    with torch.no_grad():
        target.model(torch.tensor([token_ids[:-1]]))
        features = fc(torch.cat([outputs[i][0] for i in layer_ids], dim=-1))
        tokens, logits = list(token_ids), []
        for _ in range(k):
            embedded = target.model.embed_tokens(torch.tensor(tokens[1:]))
            joined = torch.cat([layer.input_layernorm(embedded), layer.hidden_norm(features)], dim=-1)[None]
            positions = torch.arange(joined.shape[1])[None]
            attended = attn(joined, position_embeddings=rotary(joined, positions), attention_mask=None)[0][0]
            residual = features + attended
            out = (residual + layer.mlp(layer.post_attention_layernorm(residual)))[-1]
            full = torch.full((config.vocab_size,), float("-inf"))
            full[draft_ids] = torch.nn.functional.linear(norm(out), weights["lm_head.weight"])
            logits.append(full)
            tokens.append(int(full.argmax()))
            features = torch.cat([features, out[None]])
    return logits


def test_an_eagle3_head_drafts_what_hfs_modules_compute_and_gives_plain_decodings_tokens(
    eagle3_target_dir, eagle3_head_dir
):
    """EAGLE-3's layout (``assert_drafts_are_hfs``: HF's modules on the outputs of the
    target's first, middle and last layers, logits over the target's vocabulary, minus
    infinity outside the draft vocabulary), a ragged batch."""
    prompts = [*repetitive_prompts(512)[:3], mixed_prompts(512, [90], seed=4)[0]]
    assert assert_drafts_are_hfs(eagle3_target_dir, eagle3_head_dir, hf_eagle3_logits, prompts, 24, every=3) >= 12


def test_an_eagle3_head_is_checked_at_start(eagle3_target_dir, eagle3_head_dir, tiny_llama_dir, tmp_path):
    """What an EAGLE-3 checkpoint says that cannot be served is named: target layers
    the target lacks, a draft vocabulary without ``d2t``; EAGLE-3's default layers
    are 1, L/2 - 1 and L - 4."""
    config = json.loads((eagle3_head_dir / "config.json").read_text())
    assert LlamaEagle3Head.target_layers(LlamaConfig(**{**config, "eagle_config": None}), 32) == (1, 15, 28)
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids is \[0, 2, 3\].*the target's 2 layers"):
        eagle_scheduler(tiny_llama_dir, eagle3_head_dir)
    head = Path(shutil.copytree(eagle3_head_dir, tmp_path / "head"))
    weights = load_file(head / "model.safetensors")
    del weights["d2t"]
    save_file(weights, head / "model.safetensors")
    with pytest.raises(ValueError, match="draft vocabulary has 256 tokens .* no d2t"):
        eagle_scheduler(eagle3_target_dir, head)


def test_a_server_speculates_and_says_so(tiny_llama_dir, tiny_server):
    prompt = repetitive_prompts(512)[0]
    with serving(tiny_llama_dir, "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "5") as srv:
        answers = []
        for url, n in ((tiny_server.url, 1), (srv.url, 2)):
            with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
                answers.append(
                    client.completions.create(
                        model="tiny", prompt=prompt, max_tokens=32, temperature=0, n=n, extra_body={"ignore_eos": True}
                    )
                )
        info = httpx.get(srv.url + "/server_info", timeout=30).json()
    assert [c.text for c in answers[1].choices] == [answers[0].choices[0].text] * 2
    assert answers[1].usage.completion_tokens == 64
    expected = {"algorithm": "ngram", "num_draft_tokens": 5, "max_batch_size": 4, "draft_model": None}
    assert info["speculative"] == info["worker"]["speculative"] == expected
    assert info["stats"]["spec_accepted_tokens_total"] > 0
    assert info["stats"]["memory_invariant_ok"]
