"""Pure parts of the engine: prefix cache bookkeeping, sampling support, request and script parsing."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from rollbus.services.engine.attention import suffix_attention
from rollbus.services.engine.kv import GrowingLayer
from rollbus.services.engine.policies import (
    ChainRoute,
    ScriptedPolicy,
    ScriptedTurn,
    load_script,
    parse_script,
)
from rollbus.services.engine.prefix_cache import PrefixCache, common_prefix_length
from rollbus.services.engine.protocol import BadRequest, parse_generate, parse_sampling
from rollbus.services.engine.sampling import Sampling, sample_token, truncated_probs

VOCAB = 1000


def filled_kv(length: int) -> DynamicCache:
    kv = DynamicCache()
    keys = torch.arange(length, dtype=torch.float32).reshape(1, 1, length, 1)
    kv.update(keys, keys.clone(), layer_idx=0)
    return kv


def entry_for(cache: PrefixCache, ids: list[int]):
    entry = cache.acquire(ids + [0])
    entry.token_ids = np.asarray(ids, dtype=np.int64)
    entry.kv = filled_kv(len(ids))
    return entry


def test_common_prefix_length():
    assert common_prefix_length(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert common_prefix_length(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert common_prefix_length(np.array([9]), np.array([1])) == 0


def test_extension_takes_the_entry_over_and_divergence_copies_a_cropped_branch():
    cache = PrefixCache(4, DynamicCache)
    cache.release(entry_for(cache, [1, 2, 3, 4]))
    branch = cache.acquire([1, 2, 7, 8])
    assert branch.token_ids.tolist() == [1, 2] and branch.kv.get_seq_length() == 2
    assert len(cache) == 1  # the original branch is still there
    extended = cache.acquire([1, 2, 3, 4, 5, 6])
    assert extended.token_ids.tolist() == [1, 2, 3, 4] and extended.kv.get_seq_length() == 4
    assert len(cache) == 0  # taken over, not copied


def test_a_full_hit_still_leaves_one_token_to_forward():
    cache = PrefixCache(4, DynamicCache)
    cache.release(entry_for(cache, [1, 2, 3]))
    entry = cache.acquire([1, 2, 3])
    assert entry.token_ids.tolist() == [1, 2] and entry.kv.get_seq_length() == 2


def test_least_recently_used_entries_are_evicted():
    cache = PrefixCache(2, DynamicCache)
    for first in (10, 20, 30):
        cache.release(entry_for(cache, [first, 1, 2]))
    assert len(cache) == 2
    assert len(cache.acquire([10, 1, 2, 3]).token_ids) == 0
    assert len(cache.acquire([30, 1, 2, 3]).token_ids) == 3


def test_zero_capacity_keeps_nothing():
    cache = PrefixCache(0, DynamicCache)
    cache.release(entry_for(cache, [1, 2, 3]))
    assert len(cache) == 0 and len(cache.acquire([1, 2, 3, 4]).token_ids) == 0


def test_growing_layer_matches_concatenation_through_growth_crop_and_copy():
    reference, growing = DynamicCache(), DynamicCache()
    growing.layers = [GrowingLayer()]
    generator = torch.Generator().manual_seed(0)

    def feed(n: int) -> None:
        keys = torch.randn(1, 2, n, 4, generator=generator)
        values = torch.randn(1, 2, n, 4, generator=generator)
        expected = reference.update(keys, values, layer_idx=0)
        got = growing.update(keys, values, layer_idx=0)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))

    for n in (5, 300, 1, 1, 700):  # crosses the initial 256 and a doubling
        feed(n)
    reference.crop(-400)
    growing.crop(-400)
    branch = copy.deepcopy(growing)
    feed(50)
    assert branch.get_seq_length() == 607 and growing.get_seq_length() == 657
    assert torch.equal(branch.layers[0].keys, reference.layers[0].keys[..., :607, :])


def test_suffix_attention_equals_masked_sdpa():
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(1, 3, n, 8, generator=generator) for n in (5, 12, 12))
    past = key.shape[2] - query.shape[2]
    visible = torch.ones(5, 12, dtype=torch.bool).tril(diagonal=past)  # all cached keys + causal suffix
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=visible)
    assert torch.allclose(suffix_attention(query, key, value, None), expected, atol=1e-6)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert (truncated_probs(logits, Sampling(top_k=2)) > 0).tolist() == [True, True, False, False, False]
    probs = torch.softmax(logits, -1)
    nucleus = truncated_probs(logits, Sampling(top_p=float(probs[0] + probs[1] / 2)))
    assert (nucleus > 0).tolist() == [True, True, False, False, False]
    assert float(nucleus.sum()) == pytest.approx(1.0)
    generator = torch.Generator().manual_seed(0)
    draws = {sample_token(logits, Sampling(top_k=2), generator) for _ in range(200)}
    assert draws == {0, 1}
    assert sample_token(logits, Sampling(temperature=0.0), generator) == 0


def test_sampling_params_defaults_and_greedy_mapping():
    params = parse_sampling(None, VOCAB)
    assert params.max_new_tokens == 128 and params.skip_special_tokens is True
    greedy = parse_sampling({"temperature": 0}, VOCAB).sampling
    assert greedy.greedy and greedy.temperature == 1.0
    assert parse_sampling({"stop_token_ids": [5, 6]}, VOCAB).stop_token_ids == {5, 6}


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1"),
        ({"min_p": 2}, "min_p must be in [0, 1]"),
        ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer"),
        ({"stop_token_ids": [VOCAB]}, "out-of-vocabulary token id 1000"),
        ({"ignore_eos": "yes"}, "ignore_eos must be a boolean"),
        ({"stop": ["</tool_call>"]}, "sampling_params stop not supported"),
        ({"n": 2, "regex": "a+"}, "sampling_params regex, n not supported"),
    ],
)
def test_bad_sampling_params_raise_bad_request(sampling, message):
    with pytest.raises(BadRequest, match=re.escape(message)):
        parse_sampling(sampling, VOCAB)


def test_generate_rejects_prompts_beyond_the_context_length():
    with pytest.raises(BadRequest, match="longer than the model's context length"):
        parse_generate({"input_ids": [1] * 8}, VOCAB, context_length=8)
    assert parse_generate({"input_ids": [1] * 7, "rid": "a"}, VOCAB, context_length=8).rid == "a"


def test_script_parsing_and_errors(tmp_path):
    script = parse_script({"turns": ["a", {"text": "b", "complete": False}], "side_text": "s"})
    assert script.turns == (ScriptedTurn("a"), ScriptedTurn("b", complete=False))
    assert script.side_text == "s" and script.subagent_turns == ()
    bad_scripts = [
        {"turn": []},
        {"turns": [3]},
        {"turns": [], "side_text": 1},
        {"turns": [{"text": "x", "complete": 1}]},
    ]
    for bad in bad_scripts:
        with pytest.raises(ValueError):
            parse_script(bad)
    path = tmp_path / "script.json"
    path.write_text("{broken")
    with pytest.raises(ValueError, match="bad script"):
        load_script(path)
    path.write_text(json.dumps({"turns": ["only"]}))
    assert load_script(path).turns == (ScriptedTurn("only"),)


def test_scripted_policy_ends_every_chain_with_the_final_text():
    policy = ScriptedPolicy(parse_script({"turns": ["one"], "final_text": "bye"}))
    main = ChainRoute("r", "c", "main")
    assert [policy.scripted_turn(main).text for _ in range(3)] == ["one", "bye", "bye"]
    assert policy.scripted_turn(ChainRoute("r", "s", "subagent")).text == "bye"


def test_script_dir_picks_a_task_script_by_rollout_prefix_and_a_variant_by_sample():
    solve, fail, other = (parse_script({"turns": [text]}) for text in ("solve", "fail", "other"))
    policy = ScriptedPolicy(other, by_prefix={"task": solve, "task@1": fail, "task-long": other})
    assert policy.script_for("task-ab12-0") is solve
    assert policy.script_for("task-ab12-1") is fail  # sample 1 of every group of `task`
    assert policy.script_for("task-long-ab12-1") is other  # the longest name wins; it has no variant
    assert policy.script_for("unrelated-ab12-1") is other
