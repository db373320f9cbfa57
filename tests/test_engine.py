"""The local engine over real HTTP: a tiny random Qwen3, the real Qwen3.6 tokenizer, uvicorn on a free port.

Every logprob is checked against an independent full forward pass over prompt + output, so prefix
reuse, cropping and teacher forcing are held to what a trainer would recompute.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from rollbus.services.engine.app import create_app
from rollbus.services.engine.engine import Engine
from rollbus.services.engine.model import ModelSpec, random_model
from rollbus.services.engine.policies import ChainRoute, SamplePolicy, Script, ScriptedPolicy, ScriptedTurn
from rollbus.services.engine.protocol import parse_generate
from rollbus.tokenizer import SpecialIds

TINY = ModelSpec(hidden_size=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate_size=64)
TOLERANCE = 1e-4
SCRIPT = Script(
    turns=(
        ScriptedTurn("<think>\nlook first\n</think>\n\nI will list the files."),
        ScriptedTurn("Done: 3 files."),
    ),
    subagent_turns=(ScriptedTurn("sub-agent report"),),
    side_text="Listing files",
    final_text="Nothing left to do.",
)


@pytest.fixture(scope="module")
def special(tokenizer) -> SpecialIds:
    return SpecialIds.from_tokenizer(tokenizer)


def make_engine(tokenizer, policy, seed: int = 0, **kwargs) -> Engine:
    stops = SpecialIds.from_tokenizer(tokenizer).stop_token_ids
    model = random_model(TINY, len(tokenizer), stops, seed)
    return Engine(model, tokenizer, policy, model_path=f"random(seed={seed})", seed=seed, **kwargs)


@contextmanager
def serving(engine: Engine, api_key: str | None = None) -> Iterator[httpx.Client]:
    """Run the real app under uvicorn in a thread; a client bound to it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(engine, tokenizer_path="qwen3.6", api_key=api_key)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=120) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


@pytest.fixture(scope="module")
def sampled(tokenizer):
    engine = make_engine(tokenizer, SamplePolicy())
    with serving(engine) as client:
        yield engine, client


@pytest.fixture(scope="module")
def scripted(tokenizer):
    engine = make_engine(tokenizer, ScriptedPolicy(SCRIPT), seed=1)
    with serving(engine) as client:
        yield engine, client


def chat_prompt(tokenizer, user: str) -> list[int]:
    text = f"<|im_start|>system\nYou are a coding agent.<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
    return tokenizer.encode(text + "<|im_start|>assistant\n", add_special_tokens=False)


def reference_logprobs(engine: Engine, prompt: list[int], output: list[int], temperature: float = 1.0):
    """Logprobs of ``output`` from one cold forward over prompt + output (no cache, all logits)."""
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [logprobs[len(prompt) - 1 + i, token].item() for i, token in enumerate(output)]


def post_generate(client: httpx.Client, prompt: list[int], headers: dict | None = None, **sampling) -> dict:
    body = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
    response = client.post("/generate", json=body, headers=headers or {})
    assert response.status_code == 200, response.text
    return response.json()


def assert_logprobs_match(engine: Engine, prompt: list[int], body: dict, temperature: float = 1.0) -> None:
    entries = body["meta_info"]["output_token_logprobs"]
    assert [token for _, token, _ in entries] == body["output_ids"]
    expected = reference_logprobs(engine, prompt, body["output_ids"], temperature)
    assert [logprob for logprob, _, _ in entries] == pytest.approx(expected, abs=TOLERANCE)


# ---------------------------------------------------------------- sample policy


def test_sampled_logprobs_equal_a_full_forward(sampled, tokenizer):
    engine, client = sampled
    prompt = chat_prompt(tokenizer, "list the files")
    body = post_generate(client, prompt, max_new_tokens=12, ignore_eos=True)
    assert len(body["output_ids"]) == 12
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert body["meta_info"]["prompt_tokens"] == len(prompt)
    assert body["meta_info"]["completion_tokens"] == 12
    assert body["meta_info"]["weight_version"] == "0"
    assert body["text"] == tokenizer.decode(body["output_ids"], skip_special_tokens=True)
    assert_logprobs_match(engine, prompt, body)


def test_logprobs_follow_sglang_temperature_convention(sampled, tokenizer):
    """SGLang reports log_softmax(logits / T); greedy (T=0) reports the raw log_softmax and the argmax."""
    engine, client = sampled
    prompt = chat_prompt(tokenizer, "temperature")
    warm = post_generate(client, prompt, max_new_tokens=6, temperature=0.5, ignore_eos=True)
    assert_logprobs_match(engine, prompt, warm, temperature=0.5)
    greedy = post_generate(client, prompt, max_new_tokens=6, temperature=0.0, ignore_eos=True)
    assert_logprobs_match(engine, prompt, greedy)
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt + greedy["output_ids"]])).logits[0]
    argmax = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert greedy["output_ids"] == argmax


def test_sampling_seed_reproduces_output(sampled, tokenizer):
    _, client = sampled
    prompt = chat_prompt(tokenizer, "seeded")
    first = post_generate(client, prompt, max_new_tokens=8, sampling_seed=7, top_k=50, top_p=0.9)
    second = post_generate(client, prompt, max_new_tokens=8, sampling_seed=7, top_k=50, top_p=0.9)
    assert first["output_ids"] == second["output_ids"]


def test_stop_token_is_kept_in_output_ids_and_trimmed_from_text(sampled, tokenizer):
    """Mirror of SGLang: the matched stop id ends output_ids/logprobs, text omits it."""
    engine, client = sampled
    prompt = chat_prompt(tokenizer, "stop on anything")
    greedy = post_generate(client, prompt, max_new_tokens=1, temperature=0.0)["output_ids"]
    body = post_generate(client, prompt, max_new_tokens=4, stop_token_ids=greedy, temperature=0.0)
    matched = greedy[0]
    assert body["output_ids"] == [matched]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": matched}
    assert body["meta_info"]["completion_tokens"] == 1
    assert body["text"] == ""
    assert_logprobs_match(engine, prompt, body)


def test_prefix_cache_reuses_the_previous_turn(sampled, tokenizer):
    engine, client = sampled
    client.post("/flush_cache")
    first_prompt = chat_prompt(tokenizer, "turn one")
    first = post_generate(client, first_prompt, max_new_tokens=5, ignore_eos=True, temperature=0.0)
    assert first["meta_info"]["cached_tokens"] == 0
    tool_result = tokenizer.encode("<|im_end|>\n<|im_start|>user\nok<|im_end|>\n", add_special_tokens=False)
    second_prompt = first_prompt + first["output_ids"] + tool_result
    warm = post_generate(client, second_prompt, max_new_tokens=5, ignore_eos=True, temperature=0.0)
    # KV exists for everything fed so far: the prompt and all sampled tokens but the last.
    assert warm["meta_info"]["cached_tokens"] == len(first_prompt) + len(first["output_ids"]) - 1
    assert_logprobs_match(engine, second_prompt, warm)
    assert client.post("/flush_cache").status_code == 200
    cold = post_generate(client, second_prompt, max_new_tokens=5, ignore_eos=True, temperature=0.0)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert cold["output_ids"] == warm["output_ids"]
    warm_logprobs = [entry[0] for entry in warm["meta_info"]["output_token_logprobs"]]
    cold_logprobs = [entry[0] for entry in cold["meta_info"]["output_token_logprobs"]]
    assert warm_logprobs == pytest.approx(cold_logprobs, abs=TOLERANCE)


def test_divergent_prompt_crops_to_the_common_prefix_and_keeps_the_branch(sampled, tokenizer):
    engine, client = sampled
    client.post("/flush_cache")
    base = chat_prompt(tokenizer, "a prompt that will be edited later on")
    first = post_generate(client, base, max_new_tokens=4, ignore_eos=True, temperature=0.0)
    keep = len(base) - 6
    edited = base[:keep] + tokenizer.encode(" rewritten tail<|im_end|>\n", add_special_tokens=False)
    assert edited[keep] != base[keep]
    branch = post_generate(client, edited, max_new_tokens=4, ignore_eos=True, temperature=0.0)
    assert branch["meta_info"]["cached_tokens"] == keep
    assert_logprobs_match(engine, edited, branch)
    resumed_prompt = base + first["output_ids"]
    resumed = post_generate(client, resumed_prompt, max_new_tokens=3, ignore_eos=True, temperature=0.0)
    assert resumed["meta_info"]["cached_tokens"] == len(base) + len(first["output_ids"]) - 1
    assert_logprobs_match(engine, resumed_prompt, resumed)


def test_abort_stops_a_streaming_generation_between_decode_steps(sampled, tokenizer):
    _, client = sampled
    body = {
        "rid": "to-abort",
        "input_ids": chat_prompt(tokenizer, "go on forever"),
        "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True},
        "return_logprob": True,
        "stream": True,
    }
    events = []
    with client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            events.append(json.loads(line.removeprefix("data: ")))
            if len(events) == 1:
                assert client.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
    final = events[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(final["output_ids"]) < 100_000
    assert len(final["meta_info"]["output_token_logprobs"]) == len(final["output_ids"])
    assert all(event["meta_info"]["finish_reason"] is None for event in events[:-1])


# ---------------------------------------------------------------- scripted policy


def route(rollout: str, chain: str, kind: str = "main") -> dict[str, str]:
    return {"X-Rollbus-Rollout": rollout, "X-Rollbus-Chain": chain, "X-Rollbus-Chain-Kind": kind}


def post_scripted(client: httpx.Client, prompt: list[int], headers: dict[str, str], **sampling) -> dict:
    """Scripted turns carry <think>/<tool_call> markup, so keep special tokens in ``text``."""
    return post_generate(client, prompt, headers, skip_special_tokens=False, **sampling)


def test_scripted_turn_is_returned_with_real_logprobs(scripted, tokenizer, special):
    engine, client = scripted
    prompt = chat_prompt(tokenizer, "list the files")
    body = post_scripted(client, prompt, route("logprobs", "main"))
    scripted_ids = tokenizer.encode(SCRIPT.turns[0].text, add_special_tokens=False) + [special.im_end]
    assert body["output_ids"] == scripted_ids
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": special.im_end}
    assert body["text"] == SCRIPT.turns[0].text
    assert_logprobs_match(engine, prompt, body)


def test_scripted_cursor_is_per_rollout_and_chain(scripted, tokenizer):
    _, client = scripted
    prompt = chat_prompt(tokenizer, "cursor")

    def text(headers: dict[str, str]) -> str:
        return post_scripted(client, prompt, headers)["text"]

    assert text(route("r1", "main")) == SCRIPT.turns[0].text
    assert text(route("r2", "main")) == SCRIPT.turns[0].text
    assert text(route("r1", "sub-1", "subagent")) == SCRIPT.subagent_turns[0].text
    assert text(route("r1", "side-1", "side")) == SCRIPT.side_text
    assert text(route("r1", "main")) == SCRIPT.turns[1].text
    assert text(route("r1", "main")) == SCRIPT.final_text
    assert text(route("r1", "sub-1", "subagent")) == SCRIPT.final_text
    assert text(route("r2", "main")) == SCRIPT.turns[1].text


def test_a_rewritten_main_chain_carries_on_with_the_next_scripted_turn(scripted, tokenizer):
    """A compaction makes the adapter start ``main.1``; the agent itself is mid-script, not starting over."""
    _, client = scripted
    prompt = chat_prompt(tokenizer, "rewrite")
    assert post_scripted(client, prompt, route("r3", "main"))["text"] == SCRIPT.turns[0].text
    assert post_scripted(client, prompt, route("r3", "main.1"))["text"] == SCRIPT.turns[1].text


def test_scripted_output_is_truncated_by_max_new_tokens(scripted, tokenizer):
    engine, client = scripted
    prompt = chat_prompt(tokenizer, "short budget")
    body = post_scripted(client, prompt, route("budget", "main"), max_new_tokens=3)
    scripted_ids = tokenizer.encode(SCRIPT.turns[0].text, add_special_tokens=False)
    assert body["output_ids"] == scripted_ids[:3]
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert_logprobs_match(engine, prompt, body)


def test_scripted_turns_reuse_the_prefix_cache(scripted, tokenizer):
    engine, client = scripted
    prompt = chat_prompt(tokenizer, "two turns")
    first = post_scripted(client, prompt, route("cache", "main"))
    follow_up = tokenizer.encode(
        "\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    second_prompt = prompt + first["output_ids"] + follow_up
    second = post_scripted(client, second_prompt, route("cache", "main"))
    assert second["meta_info"]["cached_tokens"] == len(prompt) + len(first["output_ids"]) - 1
    assert second["text"] == SCRIPT.turns[1].text
    assert_logprobs_match(engine, second_prompt, second)


# ---------------------------------------------------------------- weights and errors


def test_update_weights_from_disk_changes_logprobs_and_version(tokenizer, tmp_path: Path):
    engine = make_engine(tokenizer, SamplePolicy())
    make_engine(tokenizer, SamplePolicy(), seed=99).model.save_pretrained(tmp_path / "step-1")
    prompt = chat_prompt(tokenizer, "weights")
    with serving(engine) as client:
        before = post_generate(client, prompt, max_new_tokens=4, temperature=0.0, ignore_eos=True)
        old_logprobs = reference_logprobs(engine, prompt, before["output_ids"])
        response = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "step-1")})
        assert response.status_code == 200 and response.json()["success"] is True
        info = client.get("/get_model_info").json()
        assert info["weight_version"] == "1" and info["model_path"] == str(tmp_path / "step-1")
        rerun = post_generate(client, prompt, max_new_tokens=4, temperature=0.0, ignore_eos=True)
        assert rerun["meta_info"]["weight_version"] == "1"
        assert rerun["meta_info"]["cached_tokens"] == 0  # the update flushed the prefix cache
        assert_logprobs_match(engine, prompt, rerun)
        new_logprobs = reference_logprobs(engine, prompt, before["output_ids"])
        assert new_logprobs != pytest.approx(old_logprobs, abs=1e-3)
        missing = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
        assert missing.status_code == 400 and missing.json()["success"] is False
        assert client.get("/get_model_info").json()["weight_version"] == "1"


def test_a_late_push_of_an_older_version_never_rolls_the_weights_back(tokenizer, tmp_path: Path):
    """A trainer gave up waiting for version 3's load and pushed 4; 3's load then ends: it is refused."""
    engine = make_engine(tokenizer, SamplePolicy())
    make_engine(tokenizer, SamplePolicy(), seed=99).model.save_pretrained(tmp_path / "step")
    with serving(engine) as client:
        push = {"model_path": str(tmp_path / "step")}
        first = client.post("/update_weights_from_disk", json={**push, "weight_version": "4"})
        assert first.json()["success"]
        late = client.post("/update_weights_from_disk", json={**push, "weight_version": "3"})
        assert late.status_code == 400 and "older than the served 4" in late.json()["message"]
        assert client.get("/get_model_info").json()["weight_version"] == "4"
        again = client.post("/update_weights_from_disk", json={**push, "weight_version": "4"})
        assert again.json()["success"]  # a retried push of the served version is a reload, not a rollback


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"sampling_params": {"max_new_tokens": 4}}, "input_ids is required"),
        ({"text": "hello"}, "token-in only"),
        ({"input_ids": []}, "must not be empty"),
        ({"input_ids": [1, 10**7]}, "out-of-vocabulary token id 10000000"),
        ({"input_ids": [1, -3]}, "out-of-vocabulary token id -3"),
        ({"input_ids": [[1, 2]]}, "batched requests are not supported"),
        ({"input_ids": [1, "2"]}, "input_ids.1 must be an integer, got '2'"),
        ({"input_ids": [1, True]}, "input_ids.1 must be an integer, got True"),
        ({"input_ids": [1, 2.0]}, "input_ids.1 must be an integer"),
        ({"input_ids": "1 2"}, "input_ids must be a list"),
        ({"input_ids": [1], "rid": 7}, "rid must be a string, got 7"),
        ({"input_ids": [1], "stream": "yes"}, "stream must be a boolean"),
        ({"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len is not supported"),
        ({"input_ids": [1], "sampling_params": {"top_k": 1.5}}, "sampling_params.top_k must be an integer"),
        ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature must be a number"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [1, -1]}}, "out-of-vocabulary token id -1"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be at least 0"),
        ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "temperature must be a non-negative"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
        ({"input_ids": [1], "sampling_params": "greedy"}, "sampling_params must be an object"),
        ([1, 2, 3], "must be a JSON object"),
    ],
)
def test_bad_generate_requests_are_400_with_a_clear_message(sampled, body, message):
    _, client = sampled
    response = client.post("/generate", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_malformed_json_and_unknown_chain_kind_are_400(sampled):
    _, client = sampled
    response = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = client.post("/generate", json={"input_ids": [1]}, headers={"X-Rollbus-Chain-Kind": "tool"})
    assert response.status_code == 400 and "X-Rollbus-Chain-Kind" in response.json()["error"]["message"]


def test_zero_max_new_tokens_finishes_by_length_with_no_output(sampled, tokenizer):
    _, client = sampled
    body = post_generate(client, chat_prompt(tokenizer, "nothing"), max_new_tokens=0)
    assert body["output_ids"] == [] and body["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_info_endpoints(sampled, tokenizer):
    engine, client = sampled
    assert client.get("/health").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["is_generation"] is True and info["vocab_size"] >= len(tokenizer)
    server = client.get("/get_server_info").json()
    assert server["counters"]["requests"] == engine.counters.requests
    assert "rollbus_engine_requests_total" in client.get("/metrics").text


def test_metrics_are_prometheus_text_with_types_and_the_engines_counts(sampled, tokenizer):
    from prometheus_client.parser import text_string_to_metric_families

    engine, client = sampled
    post_generate(client, chat_prompt(tokenizer, "count me"), max_new_tokens=2)
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=")
    assert "# TYPE rollbus_engine_requests_total counter" in response.text
    assert "# TYPE rollbus_engine_prefix_cache_entries gauge" in response.text
    families = {family.name: family for family in text_string_to_metric_families(response.text)}
    assert families["rollbus_engine_requests"].type == "counter"
    totals = {s.name: s.value for f in families.values() for s in f.samples}
    assert totals["rollbus_engine_requests_total"] == engine.counters.requests >= 1
    assert totals["rollbus_engine_generated_tokens_total"] == engine.counters.generated_tokens
    weights = families["rollbus_engine_weights_info"].samples[0].labels
    assert weights["weight_version"] == str(engine.weight_version)


def test_incomplete_scripted_turns_end_by_length_without_a_stop_token(tokenizer, special):
    script = Script(turns=(ScriptedTurn("", complete=False), ScriptedTurn("half an answer", complete=False)))
    engine = make_engine(tokenizer, ScriptedPolicy(script))
    prompt = chat_prompt(tokenizer, "incomplete")
    with serving(engine) as client:
        empty = post_scripted(client, prompt, route("partial", "main"))
        assert empty["output_ids"] == []
        assert empty["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        half = post_scripted(client, prompt, route("partial", "main"))
    assert half["output_ids"] == tokenizer.encode("half an answer", add_special_tokens=False)
    assert special.im_end not in half["output_ids"]
    assert half["meta_info"]["finish_reason"] == {"type": "length", "length": len(half["output_ids"])}
    assert_logprobs_match(engine, prompt, half)


def test_a_request_aborted_while_queued_never_runs(sampled, tokenizer):
    engine, _ = sampled
    body = {"rid": "queued", "input_ids": chat_prompt(tokenizer, "q")}
    request = parse_generate(body, engine.vocab_size, engine.context_length)
    engine.admit("queued")
    assert engine.abort("queued") == 1
    generation = engine.generate(request, ChainRoute())
    assert generation.finish_reason["type"] == "abort" and generation.output_ids == []
    assert engine.abort("queued") == 0  # retired once finished


def test_random_weights_are_a_function_of_the_seed(tokenizer):
    stops = SpecialIds.from_tokenizer(tokenizer).stop_token_ids
    first, again, other = (random_model(TINY, 1000 + len(tokenizer), stops, seed) for seed in (5, 5, 6))
    weights = [model.model.embed_tokens.weight for model in (first, again, other)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
