"""Top-k logprobs per sampled token: the engine answers SGLang's ``top_logprobs_num``, the adapter's client
packs them (rollbus/top_logprobs.py), the turn event carries them, the segmenter lays them over its
segment's response, the trainer reads them back exactly; at k = 0 nothing is asked, the turn is one null
more."""

from __future__ import annotations

import io

import fastavro
import numpy as np
import pytest
import torch

from rollbus import codec
from rollbus.codec.avro import HEADER
from rollbus.kafka.bus import Publisher
from rollbus.kafka.read import read_partitions
from rollbus.services.adapter.engine_http import EngineHTTP
from rollbus.services.adapter.sglang_client import EngineError, SGLangClient, TurnHeaders, parse_generation
from rollbus.services.engine.policies import SamplePolicy, ScriptedPolicy
from rollbus.services.segmenter.segmentation import Segmenter
from rollbus.services.segmenter.segmentation.driver import decode_fact
from rollbus.top_logprobs import PAD_ID, BadTopLogprobs, chain_top_logprobs, from_sglang, pack, unpack
from rollbus.trainer.batch import InvalidSegment, top_logprobs_of, validate
from tests.event_samples import SAMPLES
from tests.synthetic_rollouts import RolloutWriter
from tests.test_adapter_support import body, scripted_adapter
from tests.test_engine import SCRIPT, chat_prompt, make_engine, serving

K = 4


def top(rows: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 5000, (rows, k)).astype(np.int32)
    logprobs = -np.sort(rng.random((rows, k)).astype(np.float32) * 5, axis=1)
    return ids, logprobs


# --------------------------------------------------------------------------- the format


def test_a_value_packs_and_unpacks_exactly_and_refuses_a_wrong_length() -> None:
    ids, logprobs = top(7, K, 0)
    value = pack(ids, logprobs)
    assert len(value) == 4 + 7 * K * 8  # k, then 4 bytes an id and 4 a logprob
    got_ids, got_logprobs = unpack(value, 7)
    assert np.array_equal(got_ids, ids) and np.array_equal(got_logprobs, logprobs)
    with pytest.raises(BadTopLogprobs, match="not 6 tokens x top 4"):
        unpack(value, 6)


def test_sglangs_rows_are_packed_best_first_and_short_rows_padded() -> None:
    rows = [[[-0.1, 5, None], [-2.0, 9, "x"]], [[-0.5, 7, None]]]
    ids, logprobs = unpack(from_sglang(rows, 2, 2), 2)
    assert ids.tolist() == [[5, 9], [7, PAD_ID]]
    assert logprobs == pytest.approx(np.array([[-0.1, -2.0], [-0.5, 0.0]]))
    with pytest.raises(BadTopLogprobs, match="1 rows for 2 output tokens"):
        from_sglang(rows[:1], 2, 2)


def test_a_chains_turns_are_laid_over_the_response_and_context_is_padding() -> None:
    """Turn 0: 3 outputs at response 0..2; turn 1's prompt adds 2 context tokens, its 2 outputs at 5..6;
    turn 2 carries none (sampled with k = 0): padding."""
    first, second = top(3, K, 1), top(2, K, 2)
    records = [
        {"prompt_tokens": 10, "output_ids": [1, 2, 3], "output_top_logprobs": pack(*first)},
        {"prompt_tokens": 15, "output_ids": [4, 5], "output_top_logprobs": pack(*second)},
        {"prompt_tokens": 18, "output_ids": [6], "output_top_logprobs": None},
    ]
    ids, logprobs = unpack(chain_top_logprobs(records, 9), 9)
    assert np.array_equal(ids[0:3], first[0]) and np.array_equal(logprobs[5:7], second[1])
    assert (ids[[3, 4, 7, 8]] == PAD_ID).all() and (logprobs[[3, 4, 7, 8]] == 0).all()
    assert chain_top_logprobs([{**r, "output_top_logprobs": None} for r in records], 9) is None


# ------------------------------------------------------------------- the engine and the adapter's client


@pytest.fixture(scope="module", params=["sample", "scripted"])
def engine(request, tokenizer):
    policy = SamplePolicy() if request.param == "sample" else ScriptedPolicy(SCRIPT)
    engine = make_engine(tokenizer, policy, seed=1)
    with serving(engine) as client:
        yield engine, str(client.base_url)


async def test_the_engine_answers_each_tokens_top_k_as_a_full_forward_ranks_them(engine, tokenizer) -> None:
    """Sampled or teacher-forced (scripted), each output token's k best alternatives and their logprobs are
    those of one cold forward over prompt + output; the sampled token is never likelier than the best."""
    engine_, url = engine
    prompt = chat_prompt(tokenizer, "list the files")
    http = EngineHTTP(url, timeout=120, connect_timeout=10, max_connections=2, keepalive=2)
    client = SGLangClient(http)
    headers = TurnHeaders("r-0", "c", "main")
    params = {"max_new_tokens": 6, "ignore_eos": True}
    generation = await client.generate(prompt, params, "rid-1", headers, top_logprobs=K)
    plain = await client.generate(prompt, params, "rid-2", headers)
    await http.aclose()
    n = len(generation.output_ids)
    ids, logprobs = unpack(generation.top_logprobs, n)
    with torch.inference_mode():
        logits = engine_.model(torch.tensor([prompt + generation.output_ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).topk(K, dim=-1)
    assert ids.tolist() == expected.indices.tolist()
    assert logprobs == pytest.approx(expected.values.numpy(), abs=1e-4)
    assert all(lp <= row[0] + 1e-5 for lp, row in zip(generation.output_logprobs, logprobs, strict=True))
    assert plain.top_logprobs is None  # k = 0: not asked, none recorded


@pytest.mark.parametrize("k", [0, 3])
async def test_the_adapter_records_the_top_k_its_setting_asks_for_on_the_turn(engine, k: int) -> None:
    """The adapter in process, in front of the engine, with ``--top-logprobs k``: the turn it publishes
    carries k alternatives per output token, or (k = 0) none."""
    _, url = engine
    async with scripted_adapter(url, open_sessions=False, top_logprobs=k) as adapter:
        admin = {"authorization": "Bearer adm"}
        opened = await adapter.post("/admin/sessions", json={"rollout_id": "r-topk"}, headers=admin)
        headers = {"x-api-key": opened.json()["token"]}
        request = body("Read /repo/app.py", stream=False, max_tokens=8)  # a sampling engine stops there
        answer = await adapter.post("/v1/messages", json=request, headers=headers)
        assert answer.status_code == 200, answer.text
        (turn,) = adapter.publisher.of("turns", "r-topk")
    if not k:
        assert turn["output_top_logprobs"] is None
        return
    ids, logprobs = unpack(turn["output_top_logprobs"], len(turn["output_ids"]))
    assert ids.shape == (len(turn["output_ids"]), k) and (np.diff(logprobs, axis=1) <= 0).all()


def test_an_answer_whose_top_k_does_not_fit_its_output_is_an_engine_error() -> None:
    answer = {"output_ids": [5, 6], "meta_info": {
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]], "prompt_tokens": 3,
        "finish_reason": {"type": "stop"}, "output_top_logprobs": [[[-0.1, 5, None]]],
    }}  # fmt: skip
    with pytest.raises(EngineError, match="output_top_logprobs"):
        parse_generation(answer, "rid", 1, top_logprobs=1)
    assert parse_generation(answer, "rid", 1).top_logprobs is None  # not asked: not read


# --------------------------------------------------------------------------- through the bus and a segment


@pytest.mark.kafka
async def test_top_k_goes_through_the_bus_and_a_segment_and_the_trainer_reads_it_exactly(
    kafka_bootstrap: str, topics: dict[str, str]
) -> None:
    writer = RolloutWriter("topk-1", group_id="g")
    writer.turn("main", "main", [1, 2, 3, 4], 5)
    writer.turn("main", "main", [11, 12], 6)
    writer.close()
    writer.diff()
    writer.reward(1.0)
    turns = [record for topic, record in writer.events if topic == "turns"]
    tops = [top(5, K, 3), top(6, K, 4)]
    for record, (ids, logprobs) in zip(turns, tops, strict=True):
        record["output_top_logprobs"] = pack(ids, logprobs)
    async with Publisher(kafka_bootstrap) as publisher:
        for topic, record in writer.events:
            await publisher.publish(topics[topic], record)
    segmenter, segments = Segmenter({}, {}), []
    for topic in ("turns", "sessions", "diffs", "rewards"):
        partitions = [tp async for tp in _partitions(kafka_bootstrap, topics[topic])]
        async for message in read_partitions(kafka_bootstrap, partitions, client_id="test-topk"):
            fact = decode_fact(topics[topic], message.value, message.key, message.timestamp)
            handled = segmenter.handle(fact, message.value)
            segments += handled.messages
            segmenter.settle(handled)
    async with Publisher(kafka_bootstrap) as publisher:
        for message in segments:
            await publisher.publish(topics["segments"], codec.decode(message).record)
    partitions = [tp async for tp in _partitions(kafka_bootstrap, topics["segments"])]
    read = read_partitions(kafka_bootstrap, partitions, client_id="test-topk")
    (segment,) = [codec.decode(m.value).record async for m in read]
    validate(segment, vocab_size=100_000)
    ids, logprobs = top_logprobs_of(segment)
    # response: turn 0's 5 outputs, turn 1's 2 context tokens, its 6 outputs
    assert ids.shape == (13, K) and logprobs.dtype == torch.float32
    assert torch.equal(ids[:5], torch.from_numpy(tops[0][0]).long())
    assert torch.equal(logprobs[7:], torch.from_numpy(tops[1][1]))  # float32 bit for bit
    assert (ids[5:7] == PAD_ID).all() and (logprobs[5:7] == 0).all()


async def _partitions(bootstrap: str, topic: str):
    from aiokafka import TopicPartition

    from rollbus.kafka.topics import describe

    for p in range((await describe(bootstrap, [topic]))[topic]):
        yield TopicPartition(topic, p)


def test_a_top_k_that_does_not_fit_its_segment_is_refused_by_the_trainer() -> None:
    from tests.test_trainer_batch import segment

    good = segment("g", "r0")
    n = len(good["response_ids"])
    assert top_logprobs_of(good) is None
    validate({**good, "top_logprobs": pack(*top(n, K, 5))}, vocab_size=100_000)
    with pytest.raises(InvalidSegment, match="top logprobs"):
        validate({**good, "top_logprobs": pack(*top(n + 1, K, 5))}, vocab_size=100_000)
    with pytest.raises(InvalidSegment, match="outside the vocabulary"):
        validate({**good, "top_logprobs": pack(*top(n, K, 5))}, vocab_size=10)


# --------------------------------------------------------------------------- k = 0 costs one byte


def test_at_k_zero_a_turn_is_the_previous_versions_bytes_plus_one_null() -> None:
    """The turn of a k = 0 adapter: the bytes a version-3 writer wrote, then the null branch of the union."""
    record = {**SAMPLES["turn"], "output_top_logprobs": None}
    now = codec.encode("turn", record)
    before = io.BytesIO()
    fastavro.schemaless_writer(before, fastavro.parse_schema(codec.schema("turn", 3)), {
        **record, "schema_version": 4})  # fmt: skip
    assert now[HEADER.size :] == before.getvalue() + b"\x00"
    assert codec.decode(now).record["output_top_logprobs"] is None
