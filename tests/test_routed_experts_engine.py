"""Routed experts through the real parts: the rollbus engine serving a small random Qwen3-MoE with
``--enable-return-routed-experts``, the adapter asking for them turn by turn, the store, the segmenter's
references.

The oracle is independent of the engine and the adapter: the same seeded model built with transformers in
this process, one plain forward over the chain's whole token stream, each router's top-k caught by a hook.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid

import httpx
import numpy as np
import pytest
import torch

from rollbus.policy_model import ModelSpec, MoeSpec, random_qwen3_moe
from rollbus.routed_experts import RoutesRef, RoutesStore, cover, load
from rollbus.services.segmenter.segmentation import chain_routes
from rollbus.tokenizer import SpecialIds, load_tokenizer
from tests.test_adapter_support import (
    ROOT,
    BusPublisher,
    adapter_client,
    body,
    free_port,
    settings,
    wait_http,
)

SPEC = ModelSpec(hidden_size=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate_size=32)
MOE = MoeSpec(experts=4, top_k=2, expert_size=16)
SEED = 5
SCRIPT = {
    "turns": [
        "Look first.\n</think>\n\n<tool_call>\n<function=Read>\n<parameter=file_path>\n/repo/app.py\n"
        "</parameter>\n</function>\n</tool_call>",
        "Seen it.\n</think>\n\nThe file defines main().",
    ]
}


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-engine")
    script = tmp / "script.json"
    script.write_text(json.dumps(SCRIPT))
    port = free_port()
    shape = ["--hidden-size", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
             "--intermediate-size", "32", "--moe-experts", "4", "--moe-top-k", "2", "--moe-expert-size", "16",
             "--seed", str(SEED)]  # fmt: skip
    cmd = [sys.executable, "-m", "rollbus.services.engine", "--policy", "scripted", "--script", str(script),
           "--port", str(port), "--threads", "1", "--enable-return-routed-experts", *shape]  # fmt: skip
    log = (tmp / "engine.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", 300, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def oracle_routes(tokens: list[int]) -> np.ndarray:
    """Each position's experts under the engine's model (same seed and shape), ``[T, layers x top_k]``."""
    tokenizer = load_tokenizer("qwen3.6")
    stops = SpecialIds.from_tokenizer(tokenizer).stop_token_ids
    model = random_qwen3_moe(SPEC, MOE, len(tokenizer), stops, SEED).eval()
    chosen: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: chosen.__setitem__(i, out[2]))
             for i, layer in enumerate(model.model.layers)]  # fmt: skip
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    for hook in hooks:
        hook.remove()
    return torch.stack([chosen[i] for i in range(SPEC.layers)], 1).reshape(len(tokens), -1).numpy()


async def test_the_adapter_records_exactly_the_rows_the_engine_computed_for_each_turn(moe_engine, tmp_path):
    publisher = BusPublisher()
    config = settings(moe_engine, routed_experts=True, routed_experts_dir=tmp_path / "routes")
    headers = {"x-api-key": f"r-{uuid.uuid4().hex[:8]}"}
    async with adapter_client(config, publisher) as client:
        first = body("Read /repo/app.py", stream=False)
        one = (await client.post("/v1/messages", json=first, headers=headers)).json()
        results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "def main(): ..."}
                   for b in one["content"] if b["type"] == "tool_use"]  # fmt: skip
        history = [*first["messages"], {"role": "assistant", "content": one["content"]},
                   {"role": "user", "content": results}]  # fmt: skip
        response = await client.post("/v1/messages", json=body(history, stream=False), headers=headers)
        assert response.status_code == 200, response.text
    turns = publisher.of("turns", headers["x-api-key"])
    assert [t["prompt_ref_turn"] for t in turns] == [None, 0]
    p0, o0 = len(turns[0]["prompt_ids"]), len(turns[0]["output_ids"])
    stream = turns[0]["prompt_ids"] + turns[0]["output_ids"] + turns[1]["prompt_ids"] + turns[1]["output_ids"]
    refs = [RoutesRef.of(t["routed_experts"]) for t in turns]
    # turn 0 covers its prompt and all its output but the last token; turn 1 starts at that token
    assert [(r.start, r.rows, r.width) for r in refs] == [
        (0, p0 + o0 - 1, SPEC.layers * MOE.top_k),
        (p0 + o0 - 1, len(stream) - 1 - (p0 + o0 - 1), SPEC.layers * MOE.top_k),
    ]
    store = RoutesStore(tmp_path / "routes")
    expected = oracle_routes(stream)[:-1]
    np.testing.assert_array_equal(np.concatenate([store.get(r) for r in refs]), expected)
    wire = chain_routes(turns, len(stream))  # what the segmenter puts on the chain's segment
    assert wire is not None
    parts = cover([RoutesRef.of(r) for r in wire], len(stream))
    np.testing.assert_array_equal(load(parts, store), expected)


def test_the_engine_refuses_a_start_outside_the_prompt_and_answers_sglangs_shape(moe_engine) -> None:
    prompt = [1, 2, 3, 4]
    request = {"input_ids": prompt, "rid": f"t-{uuid.uuid4().hex}", "return_logprob": True,
               "sampling_params": {"max_new_tokens": 3}, "return_routed_experts": True}  # fmt: skip
    bad = httpx.post(f"{moe_engine}/generate", json={**request, "routed_experts_start_len": 5}, timeout=60)
    assert bad.status_code == 400 and "routed_experts_start_len (5)" in bad.json()["error"]["message"]
    answer = httpx.post(f"{moe_engine}/generate", json={**request, "routed_experts_start_len": 4}, timeout=60)
    meta = answer.json()["meta_info"]
    output = answer.json()["output_ids"]
    ids = np.frombuffer(base64.b64decode(meta["routed_experts"]), np.int32)
    rows = len(prompt) + len(output) - 1 - 4  # SGLang's [start, seqlen - 1)
    assert ids.size == rows * SPEC.layers * MOE.top_k
    assert ((ids >= 0) & (ids < MOE.experts)).all()
    plain = httpx.post(f"{moe_engine}/generate", json={**request, "return_routed_experts": False}, timeout=60)
    assert "routed_experts" not in plain.json()["meta_info"]
