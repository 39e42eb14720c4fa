"""SamplingParams validation, the batched sampler, and stop checking."""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field

import pytest
import torch

from radixserve.messages import FinishReason
from radixserve.runtime.execution.sampler import Sampler, SamplingBatch, adjusted_logits, compute_logprobs, sample
from radixserve.runtime.scheduling.stop import (
    StopChecker,
    StopHoldback,
    drop_stop_token,
    trim_stop_string,
)
from radixserve.sampling import SamplingParams
from radixserve.transfer import HostTransfer

V = 64
EOS = 0


def batch_of(params, prompts=None, outputs=None, eos=(EOS,)) -> SamplingBatch:
    prompts = prompts or [[] for _ in params]
    outputs = outputs or [[] for _ in params]
    return SamplingBatch.build(params, prompts, outputs, vocab_size=V, eos_token_ids=eos)


def greedy_pick(logits_row, params: SamplingParams, prompt=(), output=()) -> int:
    out = sample(logits_row.unsqueeze(0), batch_of([params], [list(prompt)], [list(output)]))
    return int(out.next_token_ids[0])


# ---- SamplingParams ------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, field_name",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"logit_bias": {"5": 1e39}}, "logit_bias"),
        ({"logit_bias": {"5": -101}}, "logit_bias"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"n": 0}, "n"),
        ({"logit_bias": {"64": 1.0}}, "logit_bias"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": "big"}}, "logit_bias"),
        ({"seed": "42"}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [64]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"max_new_tokens": True}, "max_new_tokens"),
    ],
)
def test_validation_names_the_field(bad, field_name):
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict(bad).validate(vocab_size=V)
    assert str(e.value).startswith(field_name + " "), str(e.value)


def test_validation_message_example_and_unknown_key():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1).validate()
    with pytest.raises(ValueError, match=r"^unknown sampling parameter 'foo'$"):
        SamplingParams.from_dict({"temperature": 0.5, "foo": 1})


def test_from_dict_normalizes_json_shapes():
    p = SamplingParams.from_dict({"stop": "###", "logit_bias": {"5": -100}, "stop_token_ids": None})
    p.validate(vocab_size=V)
    assert p.stop == ["###"] and p.logit_bias == {5: -100} and p.stop_token_ids == []
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy and not SamplingParams(temperature=0.1).is_greedy


# ---- greedy and seeds ------------------------------------------------------------


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=1, temperature=1.5),
        SamplingParams(temperature=1e-8),
        SamplingParams(temperature=0, seed=3),
        SamplingParams(temperature=0),
    ]
    before = logits.clone()
    out = sample(logits, batch_of(params))
    assert out.next_token_ids.tolist() == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)  # the caller's logits are left alone


def _run(params_list, steps: int, logits_seq, gen_seed: int) -> list[list[int]]:
    """Decode ``steps`` tokens for each request against fixed per-step logits."""
    outputs = [[] for _ in params_list]
    generator = torch.Generator().manual_seed(gen_seed)
    for step in range(steps):
        batch = batch_of(params_list, outputs=outputs)
        ids = sample(logits_seq[step][: len(params_list)], batch, generator=generator).next_token_ids.tolist()
        for out, token in zip(outputs, ids, strict=False):
            out.append(token)
    return outputs


def test_seeded_requests_ignore_their_batch_neighbours():
    steps = 12
    logits_seq = torch.randn(steps, 4, V, generator=torch.Generator().manual_seed(1)) * 0.3
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = _run([seeded], steps, logits_seq, gen_seed=0)[0]
    crowded = _run(
        [
            SamplingParams(temperature=1.0),
            seeded,
            SamplingParams(temperature=0.8, top_p=0.9),
            SamplingParams(temperature=0),
        ],
        steps,
        logits_seq[:, [3, 0, 1, 2]],
        gen_seed=99,
    )
    # The seeded request sees the same logits as row 1 here; everything else differs.
    assert crowded[1] == alone
    assert _run([seeded], steps, logits_seq, gen_seed=5)[0] == alone
    other_seed = _run([SamplingParams(temperature=1.0, seed=1235)], steps, logits_seq, gen_seed=0)[0]
    assert other_seed != alone


def test_unseeded_rows_follow_the_generator():
    logits_seq = torch.zeros(8, 3, V)
    params = [SamplingParams()] * 3
    assert _run(params, 8, logits_seq, gen_seed=7) == _run(params, 8, logits_seq, gen_seed=7)
    assert _run(params, 8, logits_seq, gen_seed=7) != _run(params, 8, logits_seq, gen_seed=8)


# ---- logit adjustments -----------------------------------------------------------


def test_penalties_follow_hf_and_openai_formulas():
    raw = torch.tensor([[2.0, -1.0, 0.5, 1.0, 3.0] + [0.0] * (V - 5)])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={4: -1.0})
    # Prompt holds 0 and 1; the output holds 2 twice and 1 once.
    x = adjusted_logits(raw, batch_of([p], prompts=[[0, 1]], outputs=[[2, 2, 1]]), HostTransfer(raw.device))[0]
    expected = [2.0 / 2, -1.0 * 2 - 0.5 - 0.25, 0.5 / 2 - 2 * 0.5 - 0.25, 1.0, 3.0 - 1.0]
    assert torch.allclose(x[:5], torch.tensor(expected))
    assert torch.equal(x[5:], raw[0, 5:])


def test_penalties_move_the_choice_the_right_way():
    logits = torch.zeros(V)
    logits[10], logits[11] = 2.0, 1.9
    greedy = dict(temperature=0)
    assert greedy_pick(logits, SamplingParams(**greedy)) == 10
    # Repeating token 10 makes it less likely, with each penalty on its own.
    for penalty in ({"repetition_penalty": 1.5}, {"frequency_penalty": 0.5}, {"presence_penalty": 0.5}):
        assert greedy_pick(logits, SamplingParams(**greedy, **penalty), output=[10]) == 11, penalty
    # Frequency and presence count generated tokens only; repetition counts the prompt too.
    assert greedy_pick(logits, SamplingParams(**greedy, frequency_penalty=2.0), prompt=[10]) == 10
    assert greedy_pick(logits, SamplingParams(**greedy, repetition_penalty=1.5), prompt=[10]) == 11
    # A negative frequency penalty favours the repeated token.
    assert greedy_pick(logits, SamplingParams(**greedy, frequency_penalty=-0.5), output=[11]) == 11
    # Repetition penalty on negative logits multiplies: they drop further.
    negative = torch.full((V,), -5.0)
    negative[10], negative[11] = -1.0, -1.2
    assert greedy_pick(negative, SamplingParams(**greedy, repetition_penalty=1.5), output=[10]) == 11


def test_logit_bias_forces_and_forbids():
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3))
    best = int(logits.argmax())
    forced = SamplingParams(logit_bias={"17": 100.0}, seed=0)
    forbidden = SamplingParams(logit_bias={best: -100.0}, temperature=0)
    assert greedy_pick(logits, forced) == 17
    assert greedy_pick(logits, forbidden) != best


def test_min_new_tokens_blocks_eos_and_stop_tokens():
    logits = torch.zeros(V)
    logits[EOS], logits[5], logits[9] = 10.0, 9.0, 8.0
    p = SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=[5])
    assert greedy_pick(logits, p, output=[1, 2]) == 9
    assert greedy_pick(logits, p, output=[1, 2, 3]) == EOS
    # With ignore_eos the EOS token ends nothing, so it is not blocked; stop tokens still are.
    ignoring = SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=[5], ignore_eos=True)
    assert greedy_pick(logits, ignoring, output=[1]) == EOS
    logits[EOS] = 0.0
    assert greedy_pick(logits, ignoring, output=[1]) == 9


# ---- restricting the support -------------------------------------------------------


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=3), {0, 1, 2}),
        # The probabilities are 0.455, 0.276, 0.167, 0.101 and almost nothing for the rest.
        (SamplingParams(top_p=0.5), {0, 1}),
        (SamplingParams(min_p=0.3), {0, 1, 2}),  # 0.167 / 0.455 > 0.3 > 0.101 / 0.455
        (SamplingParams(top_k=3, top_p=0.7), {0, 1}),  # renormalized over the top 3: 0.506, 0.307, ...
        (SamplingParams(temperature=0.5, top_p=0.9), {0, 1, 2}),  # 0.644, 0.237, 0.087, 0.032
    ],
)
def test_top_k_top_p_min_p_restrict_the_support(params, allowed):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5] + [-10.0] * (V - 4))
    n = 3000
    out = sample(logits.expand(n, V), batch_of([params] * n), generator=torch.Generator().manual_seed(0))
    assert set(out.next_token_ids.tolist()) == allowed


# ---- how often: empirical frequencies against the distribution -------------------------
# The distribution each setting must draw from, computed here from the definitions
# vLLM and HF's logits warpers use (and SGLang, for each filter alone): p =
# softmax(logits / T); top_k keeps the k likeliest tokens; top_p then keeps the
# smallest set of likeliest tokens whose probability, renormalized over what
# top_k kept, reaches top_p (a token stays while the tokens better than it hold
# less than top_p); min_p drops tokens below min_p times the likeliest one's
# probability; what is kept is renormalized. The logits leave no boundary within
# 0.02 of a threshold, so float rounding cannot move a token in or out.

FREQ_LOGITS = [2.0, 1.6, 1.1, 0.7, 0.2, -0.4, -1.0, -2.5]
DRAWS = 40_000
# z for a one-sided 1e-6 tail: a right distribution fails about once in a million
# seeds, and the seed is fixed, so the test is deterministic and not flaky.
Z_1E6 = 4.753


def expected_distribution(
    logits: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> list[float]:
    scaled = [x / temperature for x in logits]
    weights = [math.exp(x - max(scaled)) for x in scaled]
    order = sorted(range(len(logits)), key=lambda i: -weights[i])
    kept = order[:top_k] if top_k > 0 else order
    if top_p < 1.0:
        total, better, nucleus = sum(weights[i] for i in kept), 0.0, []
        for i in kept:
            if better >= top_p:
                break
            nucleus.append(i)
            better += weights[i] / total
        kept = nucleus
    kept = [i for i in kept if weights[i] >= min_p * weights[order[0]]]
    total = sum(weights[i] for i in kept)
    return [weights[i] / total if i in kept else 0.0 for i in range(len(logits))]


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=False) if p > 0)


def chi_square_bound(df: int) -> float:
    """The chi-square value a right distribution exceeds with probability about 1e-6
    (Wilson-Hilferty; above the exact value for every df, so never too strict)."""
    h = 2 / (9 * df)
    return df * (1 - h + Z_1E6 * math.sqrt(h)) ** 3


def assert_drawn_from(counts: list[int], probs: list[float]) -> None:
    never = [t for t, (c, p) in enumerate(zip(counts, probs, strict=False)) if p == 0 and c]
    assert not never, f"tokens {never} are outside the kept set but were drawn: {counts}"
    df = sum(p > 0 for p in probs) - 1
    if df:
        stat = chi_square(counts, probs)
        assert stat < chi_square_bound(df), f"chi-square {stat:.1f} >= {chi_square_bound(df):.1f}: {counts} vs {probs}"


def draw_counts(params: SamplingParams, draws: int = DRAWS, seed: int = 1234) -> list[int]:
    """``draws`` tokens from FREQ_LOGITS, one per row of one batch, from one seeded generator."""
    logits = torch.tensor(FREQ_LOGITS).expand(draws, len(FREQ_LOGITS))
    batch = SamplingBatch([params] * draws, [0] * draws, [None] * draws)
    out = sample(logits, batch, generator=torch.Generator().manual_seed(seed))
    return torch.bincount(out.next_token_ids, minlength=len(FREQ_LOGITS)).tolist()


FREQUENCY_CASES = {
    "temperature 1": dict(temperature=1.0),
    "temperature 0.7": dict(temperature=0.7),
    "temperature 1.5": dict(temperature=1.5),
    "top_k 3": dict(top_k=3),
    "top_p 0.7": dict(top_p=0.7),  # kept: mass before them 0, 0.375, 0.626; the next has 0.779 before it
    "top_p 0.92 at temperature 1.5": dict(temperature=1.5, top_p=0.92),  # six kept: 0.887 < 0.92 <= 0.946
    "min_p 0.25": dict(min_p=0.25),  # kept down to 0.102 >= 0.094; 0.062 is dropped
    # Renormalized over the top 4 (0.426, 0.285, 0.173, 0.116) the fourth has 0.884 >= 0.8 before it
    # (SGLang's unrenormalized sum, 0.779, would keep it).
    "top_k 4 then top_p 0.8": dict(top_k=4, top_p=0.8),
    "temperature 0.7, top_k 5, min_p 0.1": dict(temperature=0.7, top_k=5, min_p=0.1),  # 0.074 kept, 0.036 not
}


@pytest.mark.parametrize("case", list(FREQUENCY_CASES))
def test_frequencies_follow_the_distribution(case):
    settings = FREQUENCY_CASES[case]
    assert_drawn_from(draw_counts(SamplingParams(**settings)), expected_distribution(FREQ_LOGITS, **settings))


def test_seeded_requests_draw_from_the_same_distribution():
    """A request's own seed (a generator per output position) samples the same distribution."""
    draws = 5000
    params = [SamplingParams(temperature=0.7, top_p=0.95, seed=seed) for seed in range(draws)]
    logits = torch.tensor(FREQ_LOGITS).expand(draws, len(FREQ_LOGITS))
    out = sample(logits, SamplingBatch(params, list(range(draws)), [None] * draws))
    counts = torch.bincount(out.next_token_ids, minlength=len(FREQ_LOGITS)).tolist()
    assert_drawn_from(counts, expected_distribution(FREQ_LOGITS, temperature=0.7, top_p=0.95))


def test_the_frequency_check_rejects_a_slightly_wrong_distribution():
    """The bound is tight enough to matter: the same draws fail against a
    temperature off by 5%, and against a top_p set one token too large."""
    counts = draw_counts(SamplingParams(temperature=0.7))
    with pytest.raises(AssertionError, match="chi-square"):
        assert_drawn_from(counts, expected_distribution(FREQ_LOGITS, temperature=0.735))
    counts = draw_counts(SamplingParams(top_p=0.7))
    with pytest.raises(AssertionError, match="chi-square"):
        assert_drawn_from(counts, expected_distribution(FREQ_LOGITS, top_p=0.8))


# ---- logprobs ------------------------------------------------------------------------


def test_logprobs_are_those_of_the_raw_logits():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=1),
        SamplingParams(temperature=0, logit_bias={3: 5.0}),
        SamplingParams(top_k=4, seed=2),
    ]
    out = sample(logits, batch_of(params, outputs=[[1, 2]] * 3), return_logprob=True, top_logprobs_num=5)
    reference = torch.log_softmax(logits, dim=-1)
    ids = out.next_token_ids
    assert torch.allclose(out.chosen_logprobs, reference[torch.arange(3), ids], atol=1e-5)
    top = out.top_logprobs
    assert top.values.shape == (3, 5)
    assert torch.all(top.values[:, :-1] >= top.values[:, 1:])
    assert torch.allclose(top.values, reference.gather(1, top.ids), atol=1e-5)
    assert torch.equal(top.ids[:, 0], logits.argmax(-1))
    assert out.top_logprobs_list(1, 2) == list(zip(top.values[1, :2].tolist(), top.ids[1, :2].tolist(), strict=False))
    assert sample(logits, batch_of(params)).chosen_logprobs is None


def test_prompt_logprobs_helper():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(5))
    targets = torch.tensor([3, 1, 4, 1, 5, 9])
    values, top = compute_logprobs(logits, targets, top_k=2)
    assert torch.allclose(values, torch.log_softmax(logits, -1)[torch.arange(6), targets], atol=1e-5)
    sampler = Sampler(V, "cpu")
    as_lists, tops = sampler.prompt_logprobs(logits, targets.tolist(), 2)
    assert as_lists == pytest.approx(values.tolist()) and tops == top.tolist()
    assert sampler.prompt_logprobs(logits, targets.tolist())[1] == [[] for _ in range(6)]


# ---- the Sampler facade --------------------------------------------------------------------


@dataclass
class FakeReq:
    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    return_logprob: bool = False
    top_logprobs_num: int = 0


def test_sampler_keeps_token_stats_incrementally_and_drops_them_with_the_request():
    sampler = Sampler(V, "cpu", random_seed=0, eos_token_ids=[EOS])
    params = SamplingParams(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.3, seed=11)
    reqs = [
        FakeReq(params, [1, 2, 3]),
        FakeReq(SamplingParams(temperature=0), [4], return_logprob=True, top_logprobs_num=2),
    ]
    logits_seq = torch.randn(10, 2, V, generator=torch.Generator().manual_seed(6))
    for logits in logits_seq:
        # Same step from scratch: identical tokens (the seeded row) and identical statistics.
        scratch = sample(
            logits,
            SamplingBatch.build(
                [r.sampling_params for r in reqs],
                [r.origin_input_ids for r in reqs],
                [r.output_ids for r in reqs],
                vocab_size=V,
            ),
        )
        out = sampler.sample(reqs, logits)
        assert out.next_token_ids[0] == scratch.next_token_ids[0]
        assert out.top_logprobs.values.shape == (2, 2)
        for r, token in zip(reqs, out.next_token_ids.tolist(), strict=False):
            r.output_ids.append(token)
    assert len(sampler._stats) == 1
    del reqs
    gc.collect()
    assert not sampler._stats


# ---- stop checking --------------------------------------------------------------------


class ByteTokenizer:
    """A stand-in HF tokenizer whose tokens are fixed byte strings, so tests choose
    exactly where the token boundaries fall."""

    special = {0: "<eos>"}
    pieces = {
        1: b"Hel",
        2: b"lo",
        3: b" wor",
        4: b"ld",
        5: b"##",
        6: b"#",
        7: b"\xe4\xb8",
        8: b"\xad",
        9: b"x",
        10: b"\n",
        11: b"\n\n",
    }

    def decode(self, ids, skip_special_tokens=False, spaces_between_special_tokens=True):
        out = b""
        for i in ids:
            if i in self.special:
                out += b"" if skip_special_tokens else self.special[i].encode()
            else:
                out += self.pieces[i]
        return out.decode("utf-8", errors="replace")


def check(params: SamplingParams, ids: list[int]):
    return StopChecker(ByteTokenizer(), eos_token_ids=[EOS]).check(params, ids)


def test_stop_tokens_and_length():
    assert check(SamplingParams(), [1, EOS]) == FinishReason("stop", EOS)
    assert check(SamplingParams(ignore_eos=True), [1, EOS]) is None
    assert check(SamplingParams(stop_token_ids=[9]), [1, 9]) == FinishReason("stop", 9)
    assert check(SamplingParams(stop_token_ids=[9], ignore_eos=True), [1, 9]) == FinishReason("stop", 9)
    assert check(SamplingParams(max_new_tokens=3), [1, 2]) is None
    assert check(SamplingParams(max_new_tokens=3), [1, 2, 9]) == FinishReason("length")
    assert check(SamplingParams(max_new_tokens=0), []) == FinishReason("length")
    # A stop token on the last allowed token is a stop, not a length finish.
    assert check(SamplingParams(max_new_tokens=2), [1, EOS]) == FinishReason("stop", EOS)
    assert FinishReason("stop", "###").to_dict() == {"type": "stop", "matched": "###"}
    assert FinishReason("abort", message="gone").to_dict() == {"type": "abort", "matched": None, "message": "gone"}


def test_stop_strings_across_token_boundaries():
    p = SamplingParams(stop=["lo wo", "zzz"])
    assert check(p, [1, 2]) is None
    assert check(p, [1, 2, 3]) == FinishReason("stop", "lo wo")
    # A multi-byte character split over two tokens matches once complete.
    cjk = SamplingParams(stop=["中"])
    assert check(cjk, [1, 7]) is None
    assert check(cjk, [1, 7, 8]) == FinishReason("stop", "中")
    # Of two stop strings completed by one token, the one that ends first wins.
    assert check(SamplingParams(stop=["###", "x##"]), [9, 6, 5]) == FinishReason("stop", "x##")
    # Matching happens in the text the user sees: skipped special tokens are not there.
    assert check(SamplingParams(stop=["<eos>"], ignore_eos=True), [1, EOS]) is None
    assert check(SamplingParams(stop=["<eos>"], ignore_eos=True, skip_special_tokens=False), [1, EOS]) == FinishReason(
        "stop", "<eos>"
    )


def test_stop_strings_only_look_at_a_bounded_tail():
    class Counting(ByteTokenizer):
        longest = 0

        def decode(self, ids, **kw):
            Counting.longest = max(Counting.longest, len(ids))
            return super().decode(ids, **kw)

    checker = StopChecker(Counting(), [EOS])
    p = SamplingParams(stop=["lo wo"], max_new_tokens=10_000)
    ids = [9] * 5000 + [1, 2, 3]
    assert checker.check(p, ids) == FinishReason("stop", "lo wo")
    assert Counting.longest <= len("lo wo") + 2


def test_min_new_tokens_delays_every_stop():
    p = SamplingParams(min_new_tokens=4, stop=["##"], stop_token_ids=[9])
    assert check(p, [1, EOS]) is None
    assert check(p, [1, 9]) is None
    assert check(p, [1, 5]) is None
    # "##" was completed at the 2nd token, before the minimum: it does not count later.
    assert check(p, [1, 5, 2, 3]) is None
    assert check(p, [1, 5, 2, 6, 6]) == FinishReason("stop", "##")
    assert check(p, [1, 2, 3, EOS]) == FinishReason("stop", EOS)


def test_final_text_helpers():
    eos = FinishReason("stop", EOS)
    assert drop_stop_token([1, 2, EOS], eos.matched, no_stop_trim=False) == [1, 2]
    assert drop_stop_token([1, 2, EOS], eos.matched, no_stop_trim=True) == [1, 2, EOS]
    assert drop_stop_token([1, 2], None, no_stop_trim=False) == [1, 2]
    assert trim_stop_string("Hello\n\nworld\n\n", "\n\n", no_stop_trim=False) == "Hello"
    assert trim_stop_string("Hello\n\nworld\n\n", "\n\n", no_stop_trim=False, start=7) == "Hello\n\nworld"
    assert trim_stop_string("Hello###", "###", no_stop_trim=True) == "Hello###"
    assert StopHoldback(("###",))("Hello #") == 1
    assert StopHoldback(("###", "#!"))("Hello ##") == 2
    assert StopHoldback(("###",))("Hello") == 0
    assert StopHoldback(("abc", "b"))("ab") == 2


def test_streaming_with_holdback_never_shows_a_stop_string():
    """The detokenizer-side recipe: stream what ``StopHoldback`` allows, and at
    the finish trim from what was already sent."""
    p = SamplingParams(stop=["wor"], min_new_tokens=0)
    tokenizer = ByteTokenizer()
    checker = StopChecker(tokenizer, [EOS])
    ids, text, sent, streamed = [], "", 0, ""
    for token in [1, 2, 3, 4]:
        ids.append(token)
        reason = checker.check(p, ids)
        text = tokenizer.decode(ids)
        if reason is not None:
            streamed += trim_stop_string(text, reason.matched, p.no_stop_trim, start=sent)[sent:]
            break
        end = len(text) - StopHoldback(tuple(p.stop))(text)
        streamed += text[sent:end]
        sent = end
    assert streamed == "Hello " and reason == FinishReason("stop", "wor")


def test_extreme_penalties_never_produce_nan():
    """A tiny repetition penalty overflows the seen tokens' logits to inf; the
    draw must still work (one request must not be able to break a batch)."""
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0)) * 5
    params = [SamplingParams(temperature=1.0, repetition_penalty=1e-45, seed=1), SamplingParams(temperature=0.0)]
    out = sample(logits, batch_of(params, prompts=[[3, 4], [5]], outputs=[[6], []]))
    assert out.next_token_ids.shape == (2,)
    assert int(out.next_token_ids[1]) == int(logits[1].argmax())
