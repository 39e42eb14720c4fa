"""``radixserve bench``: the request sets, and both modes end to end on a tiny model
(offline: the Engine in this process; serving: a real server on port 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.bench import datasets
from radixserve.bench.datasets import TokenSource
from radixserve.cli import main


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_prefix_set_shares_exactly_its_prefix_and_follows_the_seed(tiny_tokenizer):
    source = TokenSource(tiny_tokenizer)

    def make(seed: int) -> list:
        return datasets.shared_prefix_requests(
            source, num_groups=3, prompts_per_group=4, system_prompt_len=20, question_len=5, output_len=7, seed=seed
        )

    requests = make(seed=0)
    assert len(requests) == 12
    assert all(len(r.input_ids) == r.prompt_len == 25 and r.output_len == 7 for r in requests)
    groups: dict[tuple, list[list[int]]] = {}
    for r in requests:
        groups.setdefault(tuple(r.input_ids[:20]), []).append(r.input_ids)
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4]
    for members in groups.values():  # within a group: the system prompt, and not one token more
        assert min(_common_prefix(members[0], m) for m in members[1:]) == 20
    systems = list(groups)
    assert all(_common_prefix(list(a), list(b)) < 20 for a in systems for b in systems if a is not b)
    order = [systems.index(tuple(r.input_ids[:20])) for r in requests]
    assert order != sorted(order), "the requests must be shuffled"
    special = set(tiny_tokenizer.all_special_ids)
    assert not any(t in special for r in requests for t in r.input_ids)
    assert [r.input_ids for r in make(seed=0)] == [r.input_ids for r in requests]
    assert [r.input_ids for r in make(seed=1)] != [r.input_ids for r in requests]


def test_random_set_lengths_and_text_prompts(tiny_tokenizer):
    requests = datasets.random_requests(
        TokenSource(tiny_tokenizer), num_prompts=50, input_len=40, output_len=20, range_ratio=0.5, seed=3
    )
    assert all(20 <= len(r.input_ids) <= 40 and 10 <= r.output_len <= 20 for r in requests)
    assert len({len(r.input_ids) for r in requests}) > 1
    texts = datasets.random_requests(
        TokenSource(tiny_tokenizer, "text"), num_prompts=3, input_len=30, output_len=5, range_ratio=1.0, seed=3
    )
    assert all(isinstance(r.prompt, str) and r.input_ids is None and r.prompt_len > 0 for r in texts)
    with pytest.raises(ValueError, match="random_range_ratio"):
        datasets.random_requests(TokenSource(tiny_tokenizer), 1, 4, 4, range_ratio=1.5, seed=0)


def test_jsonl_set_parses_round_trips_and_names_bad_lines(tmp_path, tiny_tokenizer):
    path = tmp_path / "set.jsonl"
    path.write_text('{"input_ids": [5, 6, 7], "output_len": 3}\n\n{"prompt": "hello world"}\n')
    requests = datasets.load_jsonl(str(path), default_output_len=9, tokenizer=tiny_tokenizer)
    assert [(r.input_ids, r.prompt, r.output_len) for r in requests] == [([5, 6, 7], None, 3), (None, "hello world", 9)]
    assert requests[1].prompt_len == len(tiny_tokenizer.encode("hello world", add_special_tokens=False))
    copy = tmp_path / "copy.jsonl"
    datasets.save_jsonl(requests, str(copy))
    assert [r.to_json() for r in datasets.load_jsonl(str(copy), 1)] == [r.to_json() for r in requests]
    for bad, message in [
        ('{"output_len": 3}', "exactly one of"),
        ('{"input_ids": []}', "non-empty"),
        ('{"prompt": "x", "output_len": 0}', "output_len"),
        ("not json", "not JSON"),
    ]:
        path.write_text('{"prompt": "fine"}\n' + bad + "\n")
        with pytest.raises(ValueError, match=rf"set.jsonl:2: .*{message}"):
            datasets.load_jsonl(str(path), 4)


def test_bad_flags_fail_before_any_engine_starts(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "offline", "--dataset", "jsonl"])
    assert exc.value.code == 2
    assert "dataset_path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "serving", "--base-url", "http://127.0.0.1:9", "--max-concurrency", "0"])
    assert "max_concurrency" in capsys.readouterr().err


def _last_line(path: Path) -> dict:
    return json.loads(path.read_text().splitlines()[-1])


def _check_latencies(run: dict) -> None:
    for stat in ("mean", "median", "p99"):
        assert 0 < run["ttft_ms"][stat] <= run["e2e_latency_ms"][stat]
    assert run["itl_ms"]["median"] > 0 and run["tpot_ms"]["mean"] > 0
    assert run["output_throughput"] > 0 and run["request_throughput"] > 0
    assert run["total_throughput"] == pytest.approx(run["input_throughput"] + run["output_throughput"])


def test_offline_shared_prefix_run(tmp_path, tiny_llama_dir):
    out, saved = tmp_path / "runs.jsonl", tmp_path / "requests.jsonl"
    code = main(
        [
            "bench",
            "offline",
            "--model",
            str(tiny_llama_dir),
            "--dataset",
            "generated-shared-prefix",
            "--gsp-num-groups",
            "2",
            "--gsp-prompts-per-group",
            "3",
            "--gsp-system-prompt-len",
            "32",
            "--gsp-question-len",
            "4",
            "--gsp-output-len",
            "5",
            "--max-concurrency",
            "1",
            "--warmup-requests",
            "1",
            "--disable-tqdm",
            "--save-requests",
            str(saved),
            "--output-file",
            str(out),
            "--label",
            "unit",
        ]
    )
    assert code == 0
    run = _last_line(out)
    assert run["mode"] == "offline" and run["config"]["label"] == "unit"
    assert run["completed"] == 6 and run["failed"] == 0
    assert run["total_input_tokens"] == 6 * 36
    assert run["total_output_tokens"] == 6 * 5  # ignore_eos is on by default
    _check_latencies(run)
    # One at a time: the 2nd and 3rd member of each group find its system prompt cached.
    assert 4 * 32 / (6 * 36) <= run["cache_hit_rate"] < 1
    assert run["peak_rss_mib"] > 0
    assert len(datasets.load_jsonl(str(saved), 1)) == 6


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from radixserve.bench.metrics import RequestResult
    from radixserve.bench.plot import plot_results

    results = []
    for i in range(3):
        result = RequestResult(prompt_len=3, sent=0.1 * i)
        result.add_tokens(1, 0.2 + 0.1 * i)
        result.add_tokens(2, 0.5 + 0.1 * i)
        results.append(result)
    png = tmp_path / "run.png"
    plot_results(results, str(png), "unit")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serving_run_against_a_real_server(tmp_path, tiny_server, tiny_tokenizer):
    out = tmp_path / "runs.jsonl"
    url = tiny_server.url
    code = main(
        [
            "bench",
            "serving",
            "--base-url",
            url,
            "--dataset",
            "random",
            "--num-prompts",
            "6",
            "--random-input-len",
            "24",
            "--random-output-len",
            "6",
            "--random-range-ratio",
            "0.5",
            "--request-rate",
            "50",
            "--disable-tqdm",
            "--output-file",
            str(out),
        ]
    )
    assert code == 0, tiny_server.log
    run = _last_line(out)
    assert run["mode"] == "serving" and run["model"] == "tiny" and run["engine"] == "radixserve"
    assert run["config"]["base_url"] == url
    assert run["completed"] == 6 and run["failed"] == 0
    expected = datasets.random_requests(TokenSource(tiny_tokenizer), 6, 24, 6, 0.5, seed=0)
    assert run["total_input_tokens"] == sum(r.prompt_len for r in expected)
    assert run["total_output_tokens"] == sum(r.output_len for r in expected)
    _check_latencies(run)
    assert run["cache_hit_rate"] is not None  # radixserve reports cached prompt tokens
    assert run["peak_rss_mib"] > 0  # its processes are local and listed by /get_server_info
