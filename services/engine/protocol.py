"""The wire shapes of SGLang's ``/generate``: request validation in, ``meta_info`` out.

Field names mirror ``sglang.srt.managers.io_struct.GenerateReqInput`` and the tokenizer manager's
``meta_info`` so the adapter cannot tell this engine from a real SGLang server. Only the subset the
adapter uses is accepted; anything malformed raises :class:`BadRequest` (served as HTTP 400 with
SGLang's ``{"error": {"message": ...}}`` body), never a 500.

Stop-token convention (checked in ``schedule_batch.Req.output_ids_through_stop``, "Stop position is
included", and ``DetokenizerManager.trim_matched_stop``): a matched stop token IS the last entry of
``output_ids`` and of ``output_token_logprobs`` and counts in ``completion_tokens``, but is trimmed
from ``text`` unless ``no_stop_trim`` is set.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.engine.sampling import SAMPLING_EPS, TOP_K_ALL, Sampling


class BadRequest(ValueError):
    """A request the engine refuses, with a message meant for the caller."""


@dataclass(frozen=True)
class SamplingParams:
    """The validated ``sampling_params`` of one request."""

    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: int | None = 128
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None


@dataclass(frozen=True)
class GenerateRequest:
    """One validated ``/generate`` call (single prompt, token ids in)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    stream: bool = False


@dataclass(frozen=True)
class Generation:
    """What the engine produced for one request, before it is put on the wire."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict[str, Any] | None  # None while streaming, before the finish
    prompt_tokens: int
    cached_tokens: int
    weight_version: str


def _number(params: dict[str, Any], name: str, default: float) -> float:
    value = params.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"sampling_params.{name} must be a number, got {value!r}.")
    return float(value)


def _integer(params: dict[str, Any], name: str, default: int | None) -> int | None:
    value = params.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"sampling_params.{name} must be an integer, got {value!r}.")
    return value


def _flag(params: dict[str, Any], name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean, got {value!r}.")
    return value


def _token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list of token ids, got {type(value).__name__}.")
    for position, token in enumerate(value):
        if isinstance(token, list):
            raise BadRequest(f"{name}: batched requests are not supported; send one prompt per call.")
        if isinstance(token, bool) or not isinstance(token, int):
            raise BadRequest(f"{name}[{position}] must be an integer token id, got {token!r}.")
        if not 0 <= token < vocab_size:
            raise BadRequest(
                f"{name}[{position}] is out-of-vocabulary token id {token}; valid range is [0, {vocab_size})."
            )
    return list(value)


UNSUPPORTED_SAMPLING = ("stop", "stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "logit_bias")


def parse_sampling(raw: Any, vocab_size: int) -> SamplingParams:
    """Validate ``sampling_params`` with SGLang's rules and messages (``SamplingParams.verify``).

    Options this engine cannot honour (stop strings, grammars, ``n > 1``) are refused rather than
    silently ignored; unknown keys are ignored, as they change nothing here.
    """
    params = {} if raw is None else raw
    if not isinstance(params, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(raw).__name__}.")
    unsupported = [name for name in UNSUPPORTED_SAMPLING if params.get(name)]
    if params.get("n", 1) not in (1, None):
        unsupported.append("n")
    if unsupported:
        names = ", ".join(unsupported)
        raise BadRequest(f"sampling_params {names} not supported by this engine (stop with stop_token_ids).")
    temperature = _number(params, "temperature", 1.0)
    top_p = _number(params, "top_p", 1.0)
    top_k = _integer(params, "top_k", -1)
    min_p = _number(params, "min_p", 0.0)
    max_new_tokens = _integer(params, "max_new_tokens", 128)
    if not math.isfinite(temperature) or temperature < 0.0:
        raise BadRequest(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise BadRequest(f"min_p must be in [0, 1], got {min_p}.")
    if top_k != -1 and top_k < 1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if max_new_tokens is not None and max_new_tokens < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
    if temperature < SAMPLING_EPS:
        temperature, top_k = 1.0, 1
    stop_ids = params.get("stop_token_ids") or []
    seed = _integer(params, "sampling_seed", None)
    return SamplingParams(
        sampling=Sampling(temperature, top_p, TOP_K_ALL if top_k == -1 else top_k, min_p),
        max_new_tokens=max_new_tokens,
        stop_token_ids=frozenset(_token_ids(stop_ids, "sampling_params.stop_token_ids", vocab_size)),
        ignore_eos=_flag(params, "ignore_eos", False),
        skip_special_tokens=_flag(params, "skip_special_tokens", True),
        no_stop_trim=_flag(params, "no_stop_trim", False),
        sampling_seed=seed,
    )


def parse_generate(body: Any, vocab_size: int, context_length: int) -> GenerateRequest:
    """Validate a ``/generate`` JSON body into a :class:`GenerateRequest`."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object.")
    if body.get("input_ids") is None:
        hint = " (this engine is token-in only: render and tokenize the prompt, send input_ids)"
        raise BadRequest("input_ids is required" + (hint if body.get("text") is not None else "") + ".")
    input_ids = _token_ids(body["input_ids"], "input_ids", vocab_size)
    if not input_ids:
        raise BadRequest("input_ids must not be empty.")
    if len(input_ids) >= context_length:
        raise BadRequest(
            f"The input ({len(input_ids)} tokens) is longer than the model's context length "
            f"({context_length} tokens)."
        )
    if body.get("logprob_start_len") not in (None, -1):
        raise BadRequest("logprob_start_len is not supported: this engine returns output logprobs only.")
    params = parse_sampling(body.get("sampling_params"), vocab_size)
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
        raise BadRequest(f"rid must be a string, got {rid!r}.")
    return GenerateRequest(
        rid=rid,
        input_ids=input_ids,
        params=params,
        return_logprob=_flag(body, "return_logprob", False),
        stream=_flag(body, "stream", False),
    )


def abort_reason(message: str = "Aborted") -> dict[str, Any]:
    """SGLang's ``FINISH_ABORT.to_json()``."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def stop_reason(token_id: int) -> dict[str, Any]:
    """SGLang's ``FINISH_MATCHED_TOKEN.to_json()``."""
    return {"type": "stop", "matched": token_id}


def length_reason(length: int) -> dict[str, Any]:
    """SGLang's ``FINISH_LENGTH.to_json()``."""
    return {"type": "length", "length": length}


def text_ids(generation: Generation, no_stop_trim: bool) -> list[int]:
    """The output ids that make up ``text``: the matched stop token is trimmed, as SGLang does."""
    matched = (generation.finish_reason or {}).get("matched")
    if isinstance(matched, int) and not no_stop_trim and generation.output_ids:
        return generation.output_ids[:-1]
    return generation.output_ids


class IncrementalText:
    """The text of a growing output, decoding only the tokens added since the last call.

    Decoding the whole output on every streamed token is quadratic. Byte-level BPE decodes a
    concatenation to the concatenation of the decodes at character boundaries, so tokens are decoded
    once their characters are complete; a piece ending in U+FFFD (a character split across tokens)
    waits for the next token.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.text = ""
        self.decoded = 0  # output tokens already in ``text``

    def feed(self, output_ids: list[int]) -> str:
        """The text of ``output_ids`` (which extend every list fed before)."""
        piece = self.decode(output_ids[self.decoded :])
        if not piece.endswith("\ufffd"):
            self.text += piece
            self.decoded = len(output_ids)
        return self.text


def response_body(
    request: GenerateRequest, generation: Generation, text: str | None, e2e_latency: float | None
) -> dict[str, Any]:
    """The ``/generate`` response: ``text``, ``output_ids`` and SGLang's ``meta_info``."""
    meta_info: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": generation.finish_reason,
        "prompt_tokens": generation.prompt_tokens,
        "weight_version": generation.weight_version,
        "num_retractions": 0,
    }
    if request.return_logprob:
        meta_info["input_token_logprobs"] = []
        meta_info["output_token_logprobs"] = [
            [logprob, token_id, None]
            for logprob, token_id in zip(generation.output_logprobs, generation.output_ids, strict=True)
        ]
        meta_info["output_token_logprobs_length"] = len(generation.output_ids)
    meta_info["reasoning_tokens"] = 0
    meta_info["completion_tokens"] = len(generation.output_ids)
    meta_info["cached_tokens"] = generation.cached_tokens
    if e2e_latency is not None:
        meta_info["e2e_latency"] = e2e_latency
    return {"text": text, "output_ids": list(generation.output_ids), "meta_info": meta_info}
