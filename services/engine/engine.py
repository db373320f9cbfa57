"""One model, one request at a time: prefill with prefix reuse, then sample or teacher-force.

Torch work runs on the caller's thread (the app's single generation worker) under a lock, so weights
can be swapped between requests and the KV cache is never shared by two forwards. Full-vocabulary
logits are only ever computed for positions that need them (``logits_to_keep``): the last prompt token
and, for scripted outputs, the forced tokens. Aborts are honoured between prefill chunks and between
decode steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from rollbus.services.engine.model import context_length, load_model, new_kv
from rollbus.services.engine.policies import ChainRoute, Policy, ScriptedTurn
from rollbus.services.engine.prefix_cache import CacheEntry, PrefixCache
from rollbus.services.engine.protocol import (
    GenerateRequest,
    Generation,
    abort_reason,
    length_reason,
    stop_reason,
    text_ids,
)
from rollbus.services.engine.routes import RouteRecorder
from rollbus.services.engine.sampling import logprob_temperature, sample_token, token_logprobs, top_logprobs
from rollbus.tokenizer import SpecialIds, one_text

TokenCallback = Callable[[Generation], object]
FORCED_CHUNK = 64  # scripted tokens scored per forward: 64 x vocab float32 logits, ~64 MB


@dataclass
class Counters:
    """Totals since start, served on ``/get_server_info`` and ``/metrics``."""

    requests: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0


@dataclass
class _Decode:
    """The state of one request's output as it grows."""

    request: GenerateRequest
    stop_ids: frozenset[int]
    budget: int
    temperature: float
    on_token: TokenCallback | None
    weight_version: str
    cached: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[float, int]]] = field(default_factory=list)  # with top_logprobs_num

    def snapshot(self, finish: dict | None, routes: np.ndarray | None = None) -> Generation:
        return Generation(
            output_ids=list(self.output_ids),
            output_logprobs=list(self.logprobs),
            finish_reason=finish,
            prompt_tokens=len(self.request.input_ids),
            cached_tokens=self.cached,
            weight_version=self.weight_version,
            routed_experts=routes,
            output_top_logprobs=list(self.top) if self.request.top_logprobs_num else None,
        )

    def alternatives(self, logits: torch.Tensor) -> list[list[tuple[float, int]]] | None:
        """Each logits row's top-k; None unless the request asked for them."""
        k = self.request.top_logprobs_num
        if not k:
            return None
        values, ids = top_logprobs(logits, self.temperature, k)
        return [list(zip(v, i, strict=True)) for v, i in zip(values, ids, strict=True)]

    def emit(self, token_id: int, logprob: float, top: list[tuple[float, int]] | None = None) -> dict | None:
        """Record one output token (and its top-k alternatives); the finish reason if it ends the output."""
        self.output_ids.append(token_id)
        self.logprobs.append(logprob)
        if top is not None:
            self.top.append(top)
        if self.on_token is not None:
            self.on_token(self.snapshot(None))
        if token_id in self.stop_ids:
            return stop_reason(token_id)
        if len(self.output_ids) >= self.budget:
            return length_reason(self.budget)
        return None


def older(version: str | None, served: str) -> bool:
    """Whether ``version`` is a number below the served one (labels that are not numbers are never older)."""
    return version is not None and version.isdigit() and served.isdigit() and int(version) < int(served)


def next_version(version: str) -> str:
    return str(int(version) + 1) if version.isdigit() else f"{version}+1"


class Engine:
    """The model server's core, independent of HTTP."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerFast,
        policy: Policy,
        *,
        model_path: str,
        weight_version: str = "0",
        cache_capacity: int = 8,
        prefill_chunk: int = 4096,
        seed: int = 0,
        original_logprob: bool = False,
        return_routed_experts: bool = False,
    ) -> None:
        """``return_routed_experts``: record each MoE layer's experts per position and answer requests that
        ask for them (SGLang's ``--enable-return-routed-experts``; without it they get none, as there)."""
        if len(tokenizer) > model.config.vocab_size:
            raise ValueError(f"model vocab {model.config.vocab_size} < tokenizer's {len(tokenizer)} ids")
        self.model = model
        self.tokenizer = tokenizer
        self.special = SpecialIds.from_tokenizer(tokenizer)
        self.vocab_size = len(tokenizer)
        self.policy = policy
        self.model_path = model_path
        self.weight_version = weight_version
        self.prefill_chunk = prefill_chunk
        self.original_logprob = original_logprob
        self.return_routed_experts = return_routed_experts
        self.recorder = RouteRecorder.of(model) if return_routed_experts else None
        self.prefix_cache = PrefixCache(cache_capacity, lambda: new_kv(self.model))
        self.counters = Counters()
        self._generator = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()
        self._requests_lock = threading.Lock()
        self._active: set[str] = set()
        self._aborted: set[str] = set()

    @property
    def context_length(self) -> int:
        return context_length(self.model)

    # ------------------------------------------------------------ request lifecycle

    def admit(self, rid: str) -> None:
        """Register ``rid`` as queued, so an abort can reach it before it runs."""
        with self._requests_lock:
            self._active.add(rid)

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Mark in-flight/queued requests aborted; returns how many were found."""
        with self._requests_lock:
            targets = set(self._active) if abort_all else {rid} & self._active
            self._aborted |= targets
            return len(targets)

    def _is_aborted(self, rid: str) -> bool:
        with self._requests_lock:
            return rid in self._aborted

    def _retire(self, rid: str) -> None:
        with self._requests_lock:
            self._active.discard(rid)
            self._aborted.discard(rid)

    # ------------------------------------------------------------ generation

    def generate(
        self, request: GenerateRequest, route: ChainRoute, on_token: TokenCallback | None = None
    ) -> Generation:
        """Run one request to its finish (stop, length or abort)."""
        self.admit(request.rid)  # idempotent: the app admits at arrival already
        try:
            with self._lock, torch.inference_mode():
                return self._generate_locked(request, route, on_token)
        finally:
            self._retire(request.rid)

    def _generate_locked(
        self, request: GenerateRequest, route: ChainRoute, on_token: TokenCallback | None
    ) -> Generation:
        prompt = request.input_ids
        self.counters.requests += 1
        decode = self._decode_state(request, on_token)
        if self._is_aborted(request.rid):
            return self._result(decode, abort_reason())
        turn = self.policy.scripted_turn(route)
        if turn is not None and turn.fill:
            turn = turn.filled(one_text(self.tokenizer.decode(prompt, skip_special_tokens=False)))
        entry = self.prefix_cache.acquire(prompt)
        decode.cached = len(entry.token_ids)
        logits = self._prefill(entry, prompt, request.rid)
        if logits is None:
            finish = abort_reason()
        elif turn is None:
            finish = self._sample(entry, logits, decode)
        else:
            finish = self._teacher_force(entry, logits, self.scripted_ids(turn), decode)
        routes = self._routes(entry, request, decode) if finish["type"] != "abort" else None
        self.prefix_cache.release(entry)
        return self._result(decode, finish, routes)

    def _routes(self, entry: CacheEntry, request: GenerateRequest, decode: _Decode) -> np.ndarray | None:
        """The rows SGLang would answer: positions ``[start, seqlen - 1)`` of prompt + output, as recorded
        when each position's KV was computed (by this request or, on a cache hit, an earlier one)."""
        if not request.return_routed_experts or entry.routes is None:
            return None
        end = len(request.input_ids) + len(decode.output_ids) - 1
        if len(entry.routes) < end:  # cannot happen: every position before the last was forwarded
            return None
        return entry.routes[request.routed_experts_start_len : end].copy()

    def _decode_state(self, request: GenerateRequest, on_token: TokenCallback | None) -> _Decode:
        params = request.params
        stop_ids = params.stop_token_ids
        if not params.ignore_eos:
            stop_ids = stop_ids | frozenset(self.special.stop_token_ids)
        budget = params.max_new_tokens
        if budget is None:
            budget = self.context_length - len(request.input_ids)
        temperature = logprob_temperature(params.sampling, original=self.original_logprob)
        return _Decode(request, stop_ids, budget, temperature, on_token, self.weight_version)

    def _result(self, decode: _Decode, finish: dict, routes: np.ndarray | None = None) -> Generation:
        self.counters.aborted += finish["type"] == "abort"
        self.counters.prompt_tokens += len(decode.request.input_ids)
        self.counters.cached_tokens += decode.cached
        self.counters.generated_tokens += len(decode.output_ids)
        return decode.snapshot(finish, routes)

    def _forward(self, entry: CacheEntry, tokens: list[int], keep: int) -> torch.Tensor:
        """Extend ``entry`` by ``tokens``; logits of the last ``keep`` positions, shape (keep, vocab)."""
        out = self.model(
            input_ids=torch.tensor([tokens], dtype=torch.long),
            past_key_values=entry.kv,
            use_cache=True,
            logits_to_keep=keep,
        )
        if self.recorder is not None:
            rows = self.recorder.take(len(tokens))
            fresh = entry.routes is None and not len(entry.token_ids)
            if fresh or entry.routes is not None:
                entry.routes = rows if fresh else np.concatenate([entry.routes, rows])
        entry.token_ids = np.concatenate([entry.token_ids, np.asarray(tokens, dtype=np.int64)])
        return out.logits[0]

    def _prefill(self, entry: CacheEntry, prompt: list[int], rid: str) -> torch.Tensor | None:
        """Forward the uncached prompt suffix; the last position's logits (None if aborted).

        A cold prompt goes in one forward: with no past, attention takes SDPA's causal kernel, several
        times faster on CPU than chunks. A suffix after cached tokens goes in ``prefill_chunk`` pieces
        (mask-free, see :mod:`rollbus.services.engine.attention`) so an abort is seen between them.
        """
        suffix = prompt[len(entry.token_ids) :]
        chunk = self.prefill_chunk if len(entry.token_ids) else len(suffix)
        logits = None
        for start in range(0, len(suffix), chunk):
            if self._is_aborted(rid):
                return None
            logits = self._forward(entry, suffix[start : start + chunk], keep=1)[-1]
        return logits

    def _sample(self, entry: CacheEntry, logits: torch.Tensor, decode: _Decode) -> dict:
        """Autoregressive sampling; the cache ends holding prompt + output[:-1]."""
        params = decode.request.params
        generator = self._generator
        if params.sampling_seed is not None:
            generator = torch.Generator().manual_seed(params.sampling_seed)
        if decode.budget <= 0:
            return length_reason(decode.budget)
        while True:
            token = sample_token(logits, params.sampling, generator)
            logprob = float(token_logprobs(logits, torch.tensor(token), decode.temperature))
            top = decode.alternatives(logits)
            finish = decode.emit(token, logprob, top[0] if top is not None else None)
            if finish is not None:
                return finish
            if self._is_aborted(decode.request.rid):
                return abort_reason()
            logits = self._forward(entry, [token], keep=1)[-1]

    def scripted_ids(self, turn: ScriptedTurn) -> list[int]:
        """Token ids of a scripted output (``<|im_end|>`` appended to a complete turn)."""
        ids = self.tokenizer.encode(turn.text, add_special_tokens=False)
        return ids + [self.special.im_end] if turn.complete else ids

    def _teacher_force(
        self, entry: CacheEntry, logits: torch.Tensor, forced: list[int], decode: _Decode
    ) -> dict:
        """Score ``forced`` as if it had been sampled: same finish rules, logprobs under the weights.

        ``scores`` holds the logits for ``forced[position:]``; each forward feeds the tokens whose
        successors need scoring (never the last forced token), at most :data:`FORCED_CHUNK` at a time so
        the full-vocabulary logits stay small.
        """
        if decode.budget <= 0:
            return length_reason(decode.budget)
        scores, position = logits.unsqueeze(0), 0
        while True:
            chunk = forced[position : position + len(scores)]
            chunk_ids = torch.tensor(chunk, dtype=torch.long)
            logprobs = token_logprobs(scores[: len(chunk)], chunk_ids, decode.temperature).tolist()
            tops: Sequence[list[tuple[float, int]] | None] = (
                decode.alternatives(scores[: len(chunk)]) or [None] * len(chunk)
            )
            for token, logprob, top in zip(chunk, logprobs, tops, strict=True):
                finish = decode.emit(token, logprob, top)
                if finish is not None:
                    return finish
            position += len(chunk)
            if position == len(forced):
                return length_reason(len(decode.output_ids))
            if self._is_aborted(decode.request.rid):
                return abort_reason()
            feed = forced[position - 1 : min(position - 1 + FORCED_CHUNK, len(forced) - 1)]
            scores = self._forward(entry, feed, keep=len(feed))

    def text(self, request: GenerateRequest, generation: Generation) -> str:
        """``text`` of the response, decoded as SGLang's detokenizer does (matched stop trimmed)."""
        params = request.params
        return self.decode(request, text_ids(generation, params.no_stop_trim))

    def decode(self, request: GenerateRequest, ids: list[int]) -> str:
        """``ids`` as text, with the request's special-token setting."""
        return one_text(self.tokenizer.decode(ids, skip_special_tokens=request.params.skip_special_tokens))

    # ------------------------------------------------------------ weights and cache

    def update_weights(self, model_path: str, weight_version: str | None = None) -> str:
        """Load a checkpoint, swap it in between requests, flush the prefix cache; the new version.

        A numbered version older than the one served is refused (ValueError) even after its load: a push the
        trainer gave up on, finishing after a newer one, must not roll the weights back.
        """
        model = load_model(model_path, self.vocab_size)
        with self._lock:
            if older(weight_version, self.weight_version):
                served = self.weight_version
                raise ValueError(f"weight version {weight_version} is older than the served {served}")
            if self.recorder is not None:
                self.recorder.close()
            self.recorder = RouteRecorder.of(model) if self.return_routed_experts else None
            self.model = model
            self.model_path = str(model_path)
            self.weight_version = weight_version or next_version(self.weight_version)
            self.prefix_cache.clear()
            return self.weight_version

    def flush_cache(self) -> None:
        with self._lock:
            self.prefix_cache.clear()
