"""IncrementalDetokenizer: streamed text equals the full decode, never shows half
a character, honours skip_special_tokens; on the project's tiny byte-level BPE
tokenizer (GPT-2, Llama-3, Qwen style) and on a SentencePiece-like one with byte
fallback and a leading-space strip (Llama-2, Mistral style) trained here.

DetokenizerState (the detokenizer process's logic): settings once per request,
stop-string holdback, and one failing request never affecting the others."""

from __future__ import annotations

import json
import random

import pytest
from generation_utils import FailingDecode
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from radixserve.messages import DetokenizeSettings, FinishReason, TokenBatch, TokenOutput
from radixserve.runtime.processes.detokenizer import DetokenizerState
from radixserve.runtime.processes.incremental_detokenizer import IncrementalDetokenizer
from radixserve.runtime.scheduling.stop import StopHoldback
from radixserve.testing.tiny_models import build_tokenizer

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog!",
    "你好，世界。今天天气很好。",
    "日本語のテキストも少し。",
    "emoji: 😀🎉👍🏽 and 🚀 rockets",
    "Mixed 中文 and English 😀 text.",
] * 10
SPECIALS = ["<s>", "</s>", "<pad>"]
# Characters the corpus lacks come out as single-byte tokens, so one character
# spans several tokens.
ALPHABET = list("abcdefgh XYZ,.!\n") + list("你好世界龍鳳") + ["😀", "🎉", "🦀", "🧪", "👍🏽", "é"]


def _sentencepiece_like() -> PreTrainedTokenizerFast:
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS, show_progress=False)
    )
    model = json.loads(trained.to_str())["model"]
    # Byte-fallback tokens are ordinary vocabulary (not special) in these tokenizers.
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.add_special_tokens(SPECIALS)
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece_like"])
def tokenizer(request, tmp_path_factory) -> PreTrainedTokenizerFast:
    if request.param == "byte_level":
        return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tokenizer")))
    return _sentencepiece_like()


def _stream(tokenizer, ids: list[int], rng: random.Random, skip: bool = True) -> list[str]:
    """Push ``ids`` in random chunks of 1-4 tokens; return every chunk of text."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        chunks.append(detok.push(ids[i : i + n]))
        i += n
    chunks.append(detok.finish())
    return chunks


def test_multibyte_characters_really_span_tokens(tokenizer):
    # Guards the fixtures: without this the other tests would prove little.
    for text in ("龍", "🦀"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) >= 2, (text, ids)
        assert any("\ufffd" in tokenizer.decode(ids[:k]) for k in range(1, len(ids)))


def test_valid_text_streams_exactly_without_replacement_chars(tokenizer):
    rng = random.Random(0)
    for _ in range(150):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 30)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        chunks = _stream(tokenizer, ids, rng)
        assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=True)
        assert not any("\ufffd" in c for c in chunks), chunks


def test_one_token_at_a_time_holds_back_partial_characters(tokenizer):
    text = "a龍 b🦀 c"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    chunks = [detok.push([i]) for i in ids] + [detok.finish()]
    assert "".join(chunks) == tokenizer.decode(ids) == text
    assert "" in chunks  # a push that only got part of a character emits nothing
    assert all("\ufffd" not in c for c in chunks)


def test_random_ids_concatenate_to_the_full_decode(tokenizer):
    """Arbitrary ids (specials, lone UTF-8 bytes, invalid sequences included)."""
    rng = random.Random(1)
    vocab = len(tokenizer)
    for skip in (True, False):
        for _ in range(100):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
            chunks = _stream(tokenizer, ids, rng, skip=skip)
            assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_skip_special_tokens_is_honoured(tokenizer):
    body = tokenizer.encode("Hello 你好 world", add_special_tokens=False)
    ids = [tokenizer.bos_token_id] + body[:2] + [tokenizer.eos_token_id] + body[2:] + [tokenizer.eos_token_id]
    rng = random.Random(2)
    kept = "".join(_stream(tokenizer, ids, rng, skip=False))
    skipped = "".join(_stream(tokenizer, ids, rng, skip=True))
    assert kept == tokenizer.decode(ids, skip_special_tokens=False)
    assert tokenizer.bos_token in kept and tokenizer.eos_token in kept
    assert skipped == tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.bos_token not in skipped and tokenizer.eos_token not in skipped


def test_context_dependent_spaces_survive_streaming():
    """A SentencePiece decoder drops the leading space of a sequence's first
    token: decoding each new token alone would glue the words together."""
    tokenizer = _sentencepiece_like()
    ids = tokenizer.encode("the quick brown fox", add_special_tokens=False)
    assert "".join(tokenizer.decode([i]) for i in ids) != "the quick brown fox"  # the premise
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join([detok.push([i]) for i in ids] + [detok.finish()]) == "the quick brown fox"


# ---- DetokenizerState -----------------------------------------------------------------------
def stop_holdback(text: str, stop: list[str]) -> int:
    """The plain definition: the longest suffix of ``text`` that begins some stop string."""
    held = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held


def test_stop_holdback_agrees_with_the_plain_definition():
    rng = random.Random(3)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab#") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))]
        text = "".join(rng.choice("ab#") for _ in range(rng.randint(0, 8)))
        assert StopHoldback(tuple(stops))(text) == stop_holdback(text, stops), (text, stops)
    assert StopHoldback(())("anything") == 0


def _out(rid: str, ids: list[int], finish: FinishReason | None = None, **settings) -> TokenOutput:
    return TokenOutput(
        rid=rid,
        new_token_ids=ids,
        finish_reason=finish,
        detokenize=DetokenizeSettings(**settings) if settings else None,
    )


def test_settings_travel_once_and_stop_strings_are_held_back_and_trimmed(tokenizer):
    state = DetokenizerState(tokenizer)
    hello, world = (tokenizer.encode(t, add_special_tokens=False) for t in ("Hello", " world###"))
    first = state.handle(_out("r", hello, stop_strings=("###",), no_stop_trim=False))
    later = [state.handle(_out("r", [i])) for i in world[:-1]]  # no settings: the state has them
    final = state.handle(_out("r", world[-1:], FinishReason("stop", "###")))  # the token completing it
    assert first.new_text + "".join(o.new_text for o in later) + final.new_text == "Hello world"
    assert not any("#" in o.new_text for o in later)
    assert state.requests == {}


def test_a_failing_request_ends_with_an_error_and_the_rest_are_served(tokenizer):
    ids = tokenizer.encode("good text here", add_special_tokens=False)
    bad = next(i for i in tokenizer.encode("龍", add_special_tokens=False) if i not in ids)
    state = DetokenizerState(FailingDecode(tokenizer, bad))
    batch = TokenBatch(
        [
            _out("a", ids[:2], skip_special_tokens=True),
            _out("bad", [bad], skip_special_tokens=True),
            _out("c", ids[:1], skip_special_tokens=True),
        ]
    )
    a, failed, c = state.handle_batch(batch).outputs
    assert a.error is None and c.error is None and a.new_text + c.new_text != ""
    assert "RuntimeError" in failed.error and failed.token.finish_reason is None
    # The scheduler runs it until the abort lands: its outputs are dropped, but
    # its final one still goes through (the TokenizerManager tracks it until then).
    later = state.handle_batch(TokenBatch([_out("bad", ids[:1]), _out("a", ids[2:])])).outputs
    assert [o.token.rid for o in later] == ["a"] and later[0].error is None
    end = state.handle_batch(
        TokenBatch(
            [
                _out("bad", [], FinishReason("abort")),
                _out("a", [], FinishReason("length")),
                _out("c", [], FinishReason("length")),
            ]
        )
    ).outputs
    assert [(o.token.rid, o.error, o.new_text) for o in end][0] == ("bad", None, "")
    assert a.new_text + later[0].new_text + end[1].new_text == tokenizer.decode(ids)
    assert state.requests == {} and state.failed == set()
    # A failure on a final output ends the request there: nothing is kept.
    state.handle_batch(TokenBatch([_out("d", ids[:1], skip_special_tokens=True)]))
    (last,) = state.handle_batch(TokenBatch([_out("d", [bad], FinishReason("length"))])).outputs
    assert last.error and state.requests == {} and state.failed == set()


def test_an_output_without_settings_for_an_unknown_request_fails_only_that_request(tokenizer):
    state = DetokenizerState(tokenizer)
    (orphan,) = state.handle_batch(TokenBatch([_out("x", [1])])).outputs
    assert "DetokenizeSettings" in orphan.error
    assert state.handle(_out("y", [1], stop_strings=())).error is None
