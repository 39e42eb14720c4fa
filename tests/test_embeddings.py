"""Embeddings: /v1/embeddings through the official ``openai`` client against a
real server, compared with HF transformers' ``AutoModel`` on the same weights
(fp32), pooled as the server pools.

Two embedding servers (one module-scoped fixture, two parameters), both with
a 16-token prefill chunk so that longer inputs are prefilled in chunks:

- ``last``: a Qwen3 backbone checkpoint (``Qwen3Model``, no LM head) laid out as
  a sentence-transformers directory asking for last-token pooling and
  normalisation (Qwen3-Embedding's layout), marked as Matryoshka-trained;
- ``mean``: the tiny Llama (``LlamaForCausalLM``) served with
  ``--is-embedding --pooling mean --no-normalize-embeddings``.

Then the in-process scheduler (mean pooling over chunks with and without
overlap, the pool invariant at every step, an abort mid-prompt), the embedding
settings read from a model's files, and ``Engine.encode``.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from generation_utils import make_scheduler, mixed_prompts
from helpers_pool import SchedulerPool, ServerPool, assert_whole_pool_back, stats
from helpers_server import ServerProcess, serving, wait_until
from transformers import AutoModel, AutoTokenizer

from radixserve import Engine
from radixserve.checkpoints.embedding import EmbeddingConfig, embedding_config
from radixserve.config import ServerArgs
from radixserve.messages import GenerateRequest
from radixserve.sampling.params import SamplingParams

CHUNK = 16
HIDDEN = 64
# Backends by priority: no start-up timing of the candidates on each server's, engine's and
# scheduler's shapes (none of these tests is about auto's measurement).
PRIORITY = ("--backend-selection", "priority")
TOL = 1e-4
TEXTS = [
    "Hello",
    "the cache tree holds every prefix of every prompt it has seen so far",
    "Radix trees share prefixes. " * 6,  # several chunks
]
POOLING_MODES = {  # sentence-transformers' Pooling modes, all off
    "pooling_mode_cls_token": False,
    "pooling_mode_mean_tokens": False,
    "pooling_mode_max_tokens": False,
    "pooling_mode_mean_sqrt_len_tokens": False,
    "pooling_mode_weightedmean_tokens": False,
    "pooling_mode_lasttoken": False,
}


def write_sentence_transformers(model_dir: Path, mode: str, normalize: bool, extra: tuple[str, ...] = ()) -> None:
    """A sentence-transformers layout: modules.json (Transformer, Pooling, then Normalize and ``extra``
    modules), 1_Pooling/config.json with ``mode`` on."""
    kinds = ["Transformer", "Pooling"] + (["Normalize"] if normalize else []) + list(extra)
    modules = []
    for i, kind in enumerate(kinds):
        path = "" if kind == "Transformer" else f"{i}_{kind}"
        modules.append({"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"})
        if path:
            (model_dir / path).mkdir(exist_ok=True)
    (model_dir / "modules.json").write_text(json.dumps(modules))
    pooling = {"word_embedding_dimension": HIDDEN, **POOLING_MODES, mode: True, "include_prompt": True}
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (model_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 1024, "do_lower_case": False}))


@pytest.fixture(scope="module")
def st_model_dir(tiny_model_factory, tmp_path_factory) -> Path:
    """A Qwen3-Embedding-like directory: a backbone checkpoint plus sentence-transformers files."""
    built = tiny_model_factory(arch="qwen3", head_dim=32, backbone=True, matryoshka_dimensions=[16, 32, HIDDEN])
    model_dir = tmp_path_factory.mktemp("qwen3-embedding") / "model"
    shutil.copytree(built, model_dir)
    write_sentence_transformers(model_dir, "pooling_mode_lasttoken", normalize=True)
    return model_dir


@dataclass
class Embedder:
    """One embedding server, its client, and HF's reference on the same weights."""

    server: ServerProcess
    client: openai.OpenAI
    model_dir: Path
    pooling: str
    normalize: bool
    matryoshka: bool
    hf: torch.nn.Module
    tokenizer: object

    def reference(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            hidden = self.hf(torch.tensor([ids])).last_hidden_state[0].float()
        pooled = hidden[-1] if self.pooling == "last" else hidden.mean(0)
        return F.normalize(pooled, dim=-1) if self.normalize else pooled

    def embed(self, inputs, **kw) -> list[torch.Tensor]:
        out = self.client.embeddings.create(model="tiny", input=inputs, encoding_format="float", **kw)
        assert [d.index for d in out.data] == list(range(len(out.data)))
        return [torch.tensor(d.embedding) for d in out.data]


@pytest.fixture(scope="module", params=["last", "mean"])
def embedder(request, st_model_dir, tiny_llama_dir):
    if request.param == "last":
        model_dir, flags, normalize, matryoshka = st_model_dir, (), True, True
    else:
        model_dir, normalize, matryoshka = tiny_llama_dir, False, False
        flags = ("--is-embedding", "--pooling", "mean", "--no-normalize-embeddings")
    args = ("--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "4096", *PRIORITY, *flags)
    with serving(model_dir, *args) as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
            hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            yield Embedder(srv, client, model_dir, request.param, normalize, matryoshka, hf, tokenizer)
        assert_whole_pool_back(ServerPool(srv.url))


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < TOL, (got - want).abs().max().item()


# ---- parity with HF ------------------------------------------------------------------------
def test_single_and_batched_ragged_inputs_equal_hf(embedder):
    ids = [embedder.tokenizer.encode(t) for t in TEXTS] + mixed_prompts(512, [1, 15, 16, 17, 70], seed=3)
    assert max(len(i) for i in ids) > 3 * CHUNK  # some are prefilled in several chunks
    references = [embedder.reference(i) for i in ids]
    for text, want in zip(TEXTS, references, strict=False):
        assert_close(embedder.embed(text)[0], want)
    batched = embedder.embed(TEXTS) + embedder.embed(ids[len(TEXTS) :])  # a batch of strings, one of token ids
    for got, want in zip(batched, references, strict=False):
        assert_close(got, want)
    if embedder.normalize:
        assert all(abs(v.norm().item() - 1) < 1e-5 for v in batched)


def test_shared_prefix_served_from_the_radix_cache(embedder):
    """Last-token pooling reads the shared prefix from the cache; mean pooling
    cannot (a cached token has no hidden state) and computes it again."""
    prefix, suffix = mixed_prompts(512, [48, 9], seed=4)
    first = prefix + suffix[:3]
    second = prefix + suffix
    assert_close(embedder.embed([first])[0], embedder.reference(first))
    before = stats(embedder.server.url)
    assert before["cached_tokens_in_tree"] >= len(first)  # its pages went to the cache
    cached_before = before["cached_tokens_total"]
    assert_close(embedder.embed([second])[0], embedder.reference(second))
    cached = stats(embedder.server.url)["cached_tokens_total"] - cached_before
    if embedder.pooling == "last":
        assert cached >= len(prefix)
    else:
        assert cached == 0


def test_through_the_router(embedder):
    """``radixserve router`` forwards /v1/embeddings to a worker that serves embeddings
    (its features say so) and refuses generation for a model only embedding workers serve."""
    if embedder.pooling != "last":
        pytest.skip("one worker is enough")
    with ServerProcess("--worker-urls", embedder.server.url, command="router") as router:
        router.wait_ready(60)
        workers = lambda: httpx.get(router.url + "/workers", timeout=10).json()["workers"]  # noqa: E731
        assert wait_until(lambda: len(workers()) == 1, 60), router.log
        features = workers()[0]["features"]
        assert features["embeddings"] and not features["generation"]
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = client.embeddings.create(model="tiny", input=TEXTS[:2], encoding_format="float")
        for got, want in zip(out.data, embedder.embed(TEXTS[:2]), strict=False):
            assert_close(torch.tensor(got.embedding), want)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert err.value.body["param"] == "model" and "generation" in err.value.body["message"]


# ---- the OpenAI shape -----------------------------------------------------------------------
def test_base64_equals_float_and_usage(embedder):
    """One input per request, so both are computed in the same steps and agree bit for bit."""
    url = embedder.server.url + "/v1/embeddings"
    body = {"model": "tiny", "input": TEXTS[1], "user": "someone"}
    floats = httpx.post(url, json={**body, "encoding_format": "float"}, timeout=60).json()
    encoded = httpx.post(url, json={**body, "encoding_format": "base64"}, timeout=60).json()
    assert floats["object"] == "list" and floats["model"] == "tiny"
    assert [d["object"] for d in floats["data"]] == ["embedding"]
    raw = base64.b64decode(encoded["data"][0]["embedding"])
    assert len(raw) == 4 * HIDDEN and list(struct.unpack(f"<{HIDDEN}f", raw)) == floats["data"][0]["embedding"]
    tokens = len(embedder.tokenizer.encode(TEXTS[1]))
    assert floats["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens} == encoded["usage"]
    # The openai client asks for base64 by default and decodes it.
    default = embedder.client.embeddings.create(model="tiny", input=TEXTS[1])
    assert default.data[0].embedding == floats["data"][0]["embedding"]
    batch = embedder.client.embeddings.create(model="tiny", input=TEXTS)
    assert (
        batch.usage.prompt_tokens == batch.usage.total_tokens == sum(len(embedder.tokenizer.encode(t)) for t in TEXTS)
    )


def test_token_id_inputs_equal_text(embedder):
    ids = [embedder.tokenizer.encode(t) for t in TEXTS]
    by_text = embedder.embed(TEXTS)
    for a, b in zip(
        embedder.embed(ids), by_text, strict=False
    ):  # a batch is computed alike, not always in the same steps
        assert_close(a, b)
    assert torch.equal(embedder.embed(ids[1])[0], embedder.embed(TEXTS[1])[0])


def test_dimensions(embedder, http_client):
    full = embedder.embed(TEXTS[1])[0]
    assert torch.equal(embedder.embed(TEXTS[1], dimensions=HIDDEN)[0], full)
    if embedder.matryoshka:
        cut = embedder.embed(TEXTS[1], dimensions=16)[0]
        assert cut.shape == (16,)
        assert_close(cut, F.normalize(full[:16], dim=-1))
        assert_bad(http_client, {"input": "x", "dimensions": 24}, "dimensions", "must be one of [16, 32, 64]")
    else:
        assert_bad(http_client, {"input": "x", "dimensions": 16}, "dimensions", "not marked as trained for Matryoshka")
    assert_bad(http_client, {"input": "x", "dimensions": HIDDEN + 1}, "dimensions", f"must be in [1, {HIDDEN}]")
    assert_bad(http_client, {"input": "x", "dimensions": 0}, "dimensions", f"must be in [1, {HIDDEN}]")


# ---- errors, and the server serves on -------------------------------------------------------------
@pytest.fixture
def http_client(embedder):
    with httpx.Client(base_url=embedder.server.url, timeout=60) as client:
        yield client


def assert_bad(http, body: dict, param: str, message: str, path: str = "/v1/embeddings", status: int = 400) -> None:
    r = http.post(path, json={"model": "tiny", **body})
    error = r.json()["error"]
    assert r.status_code == status and error["param"] == param and message in error["message"], r.text


def test_errors_name_the_field_and_the_server_serves_on(embedder, http_client):
    too_long = mixed_prompts(512, [1025], seed=5)[0]  # the context is 1024 tokens
    assert_bad(http_client, {"input": []}, "input", "must not be empty")
    assert_bad(http_client, {"input": ""}, "input", "empty")
    assert_bad(http_client, {"input": ["fine", ""]}, "input", "empty")
    assert_bad(http_client, {"input": too_long}, "input", "context length is 1024")
    assert_bad(http_client, {"input": [[1, 2], [3, 100000]]}, "input", "every id must be")
    assert_bad(http_client, {"input": "x", "encoding_format": "int8"}, "encoding_format", "")
    assert_bad(http_client, {"input": "x", "model": "other"}, "model", "does not exist", status=404)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert_bad(http_client, chat, "model", "served for embeddings", path="/v1/chat/completions")
    assert_bad(http_client, {"prompt": "hi"}, "model", "served for embeddings", path="/v1/completions")
    r = http_client.post("/generate", json={"text": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    # A whole context is one embedding (nothing is generated after it).
    full_context = too_long[:1024]
    assert_close(embedder.embed(full_context)[0], embedder.reference(full_context))
    info = http_client.get("/model_info").json()
    assert info["is_generation"] is False


def test_a_client_gone_mid_request_frees_its_kv(embedder):
    """A large batch, abandoned by its client: the server aborts it and the whole pool comes back."""
    body = {"model": "tiny", "input": mixed_prompts(512, [900] * 48, seed=6), "encoding_format": "base64"}
    before = stats(embedder.server.url)["prompt_tokens_total"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(embedder.server.url + "/v1/embeddings", json=body, timeout=httpx.Timeout(60, read=0.5))
    assert_whole_pool_back(ServerPool(embedder.server.url))
    assert stats(embedder.server.url)["prompt_tokens_total"] - before < 48 * 900  # aborted, not all computed
    assert embedder.embed("still serving")[0].shape == (HIDDEN,)


def test_sentence_transformers_agrees(embedder):
    st = pytest.importorskip("sentence_transformers")
    if embedder.pooling != "last":
        pytest.skip("the mean server's model is not a sentence-transformers directory")
    model = st.SentenceTransformer(str(embedder.model_dir), device="cpu")
    want = model.encode(TEXTS, convert_to_tensor=True, batch_size=1).float()
    for got, ref in zip(embedder.embed(TEXTS), want, strict=False):
        assert_close(got, ref)


def test_generation_server_refuses_embeddings(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/embeddings", json={"model": "tiny", "input": "hi"}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "model" and "served for generation" in error["message"]


# ---- the scheduler in-process ----------------------------------------------------------------
def embed_all(scheduler, prompts: dict[str, list[int]], abort_after: dict[str, int] | None = None) -> dict:
    """Step until idle with the pool invariant checked at every step; the final output of each
    request. ``abort_after``: abort a request after that many steps."""
    for rid, ids in prompts.items():
        scheduler.add_request(
            GenerateRequest(rid=rid, input_ids=ids, sampling_params=SamplingParams(max_new_tokens=0), embed=True)
        )
    finals, step = {}, 0
    while scheduler.has_work():
        step += 1
        for rid, at in (abort_after or {}).items():
            if step == at:
                scheduler.abort(rid)
        for out in scheduler.step() + scheduler.step_outputs():
            if out.finish_reason is not None:
                finals[out.rid] = out
        assert scheduler.check_memory(), scheduler.stats()
    return finals


@pytest.mark.parametrize("overlap", [False, True])
def test_scheduler_mean_pooling_over_chunks(tiny_llama_dir, overlap):
    """Ragged embedding requests, several in chunks, then one whose prefix is cached
    (mean pooling computes it again) and one aborted mid-prompt: each embedding equals
    HF's mean, the pool invariant holds at every step, and the whole pool comes back."""
    scheduler = make_scheduler(
        tiny_llama_dir,
        is_embedding=True,
        pooling="mean",
        chunked_prefill_size=8,
        disable_overlap_schedule=not overlap,
        backend_selection="priority",
    )
    prompts = {f"e{i}": ids for i, ids in enumerate(mixed_prompts(512, [3, 30, 9, 17, 1], seed=7))}
    finals = embed_all(scheduler, prompts)
    assert scheduler.stats().cached_tokens_in_tree >= len(prompts["e1"])  # its pages went to the cache
    later = {"cached-prefix": prompts["e1"] + prompts["e2"], "aborted": mixed_prompts(512, [200], seed=8)[0]}
    finals.update(embed_all(scheduler, later, abort_after={"aborted": 3}))
    assert finals["aborted"].finish_reason.type == "abort" and finals["aborted"].embedding is None
    hf = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for rid, ids in {**prompts, "cached-prefix": later["cached-prefix"]}.items():
        out = finals[rid]
        assert out.finish_reason.type == "length" and out.cached_tokens == 0 and out.new_token_ids == []
        with torch.no_grad():
            want = F.normalize(hf(torch.tensor([ids])).last_hidden_state[0].mean(0), dim=-1)
        assert_close(torch.tensor(out.embedding), want)
    assert_whole_pool_back(SchedulerPool(scheduler))


def test_engine_encode(st_model_dir):
    """The offline API: one prompt, a batch of strings, a batch of token ids; and no generation."""
    engine_args = dict(max_total_tokens=2048, log_level="warning", backend_selection="priority")
    with Engine(model_path=str(st_model_dir), **engine_args) as engine:
        ids = [engine.tokenizer.encode(t) for t in TEXTS]
        one, texts, by_ids = engine.encode(TEXTS[0]), engine.encode(TEXTS), engine.encode(input_ids=ids)
        with pytest.raises(ValueError, match="served for embeddings"):
            engine.generate("hello")
    assert one["meta_info"]["prompt_tokens"] == len(ids[0]) and one["meta_info"]["finish_reason"]["type"] == "length"
    hf = AutoModel.from_pretrained(st_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        wants = [F.normalize(hf(torch.tensor([i])).last_hidden_state[0, -1], dim=-1) for i in ids]
    for result, want in zip([one] + texts + by_ids, wants[:1] + wants + wants, strict=False):
        assert_close(torch.tensor(result["embedding"]), want)


def test_engine_encode_refused_by_a_generation_model(engine):
    with pytest.raises(ValueError, match="served for generation"):
        engine.encode("hello")


# ---- the settings read from a model's files --------------------------------------------------------
def settings(model_dir: Path, **flags) -> EmbeddingConfig | None:
    config = SimpleNamespace(
        architectures=[flags.pop("arch", "LlamaForCausalLM")], hidden_size=HIDDEN, **flags.pop("hf", {})
    )
    return embedding_config(ServerArgs(model_path=str(model_dir), **flags), model_dir, config)


def test_settings_from_files_and_flags(tmp_path):
    assert settings(tmp_path) is None  # a generation model
    assert settings(tmp_path, arch="Qwen3Model") == EmbeddingConfig("last", True, HIDDEN, source="default")
    write_sentence_transformers(tmp_path, "pooling_mode_mean_tokens", normalize=False)
    found = settings(tmp_path)
    assert (found.pooling, found.normalize, found.source) == ("mean", False, "sentence-transformers files")
    both = settings(tmp_path, pooling="last", normalize_embeddings=True)
    assert (both.pooling, both.normalize, both.source) == ("last", True, "--pooling and --normalize-embeddings")
    marked = settings(tmp_path, hf={"is_matryoshka": True})
    assert marked.dimensions_error(10) is None and "must be in" in marked.dimensions_error(HIDDEN + 1)
    assert settings(tmp_path, is_embedding=False) is None


@pytest.mark.parametrize(
    "layout, flags, message",
    [
        (("pooling_mode_cls_token", True, ()), {}, "pooling ['pooling_mode_cls_token'] is not served"),
        (("pooling_mode_lasttoken", True, ("Dense",)), {}, "the Dense module"),
        (None, {"arch": "Qwen3Model", "is_embedding": False}, "is_embedding: Qwen3Model has no LM head"),
        (None, {"pooling": "mean"}, "pooling: LlamaForCausalLM is served for generation"),
    ],
)
def test_settings_refused(tmp_path, layout, flags, message):
    if layout is not None:
        write_sentence_transformers(tmp_path, layout[0], layout[1], layout[2])
    with pytest.raises(ValueError, match=re.escape(message)):
        settings(tmp_path, **flags)
