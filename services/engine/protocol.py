"""The wire shapes of SGLang's ``/generate``: request validation in, ``meta_info`` out.

Field names mirror ``sglang.srt.managers.io_struct.GenerateReqInput`` and the tokenizer manager's
``meta_info`` so the adapter cannot tell this engine from a real SGLang server. Only the subset the
adapter uses is accepted; bodies are validated with pydantic (strict types, as the adapter validates
its own requests) and anything malformed raises :class:`BadRequest` with one sentence naming the field
(served as HTTP 400 with SGLang's ``{"error": {"message": ...}}`` body), never a 500.

Stop-token convention (checked in ``schedule_batch.Req.output_ids_through_stop``, "Stop position is
included", and ``DetokenizerManager.trim_matched_stop``): a matched stop token IS the last entry of
``output_ids`` and of ``output_token_logprobs`` and counts in ``completion_tokens``, but is trimmed
from ``text`` unless ``no_stop_trim`` is set.
"""

from __future__ import annotations

import base64
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rollbus.services.engine.sampling import SAMPLING_EPS, TOP_K_ALL, Sampling


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
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0  # rows of positions [start, seqlen - 1), as SGLang's
    top_logprobs_num: int = 0  # each output token's top-k alternatives, with return_logprob


@dataclass(frozen=True)
class Generation:
    """What the engine produced for one request, before it is put on the wire."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict[str, Any] | None  # None while streaming, before the finish
    prompt_tokens: int
    cached_tokens: int
    weight_version: str
    routed_experts: np.ndarray | None = None  # [rows, layers x top_k] int32, when asked for and recorded
    output_top_logprobs: list[list[tuple[float, int]]] | None = None  # per output token, when asked for


_STRICT = ConfigDict(strict=True, extra="ignore", frozen=True)
UNSUPPORTED_SAMPLING = ("stop", "stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "logit_bias")


def _without_nulls(data: Any) -> Any:
    """SGLang treats an explicit ``null`` as "the default": drop them before validation."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def _check_token_ids(ids: list[int], name: str, info: ValidationInfo) -> list[int]:
    vocab_size = (info.context or {}).get("vocab_size")
    for position, token in enumerate(ids):
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise ValueError(
                f"{name}[{position}] is out-of-vocabulary token id {token}; valid range is [0, {vocab_size})."
            )
    return ids


class SamplingBody(BaseModel):
    """``sampling_params`` on the wire, with SGLang's ranges (``SamplingParams.verify``) and messages.

    Options this engine cannot honour (stop strings, grammars, ``n > 1``) are refused rather than
    silently ignored; unknown keys are ignored, as they change nothing here."""

    model_config = _STRICT
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    n: int = 1
    stop: Any = None
    stop_regex: Any = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    logit_bias: Any = None

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _without_nulls(data)

    @field_validator("stop_token_ids")
    @classmethod
    def _in_vocab(cls, ids: list[int], info: ValidationInfo) -> list[int]:
        return _check_token_ids(ids, "sampling_params.stop_token_ids", info)

    @model_validator(mode="after")
    def _ranges(self) -> SamplingBody:
        unsupported = [name for name in UNSUPPORTED_SAMPLING if getattr(self, name)]
        if self.n != 1:
            unsupported.append("n")
        if unsupported:
            names = ", ".join(unsupported)
            raise ValueError(
                f"sampling_params {names} not supported by this engine (stop with stop_token_ids)."
            )
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        return self

    def params(self) -> SamplingParams:
        temperature, top_k = self.temperature, self.top_k
        if temperature < SAMPLING_EPS:
            temperature, top_k = 1.0, 1
        return SamplingParams(
            sampling=Sampling(temperature, self.top_p, TOP_K_ALL if top_k == -1 else top_k, self.min_p),
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=frozenset(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim,
            sampling_seed=self.sampling_seed,
        )


class GenerateBody(BaseModel):
    """A ``/generate`` body: one prompt as token ids (this engine is token-in only)."""

    model_config = _STRICT
    input_ids: list[int]
    sampling_params: SamplingBody = SamplingBody()
    rid: str | None = None
    return_logprob: bool = False
    stream: bool = False
    logprob_start_len: int = -1
    text: Any = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    top_logprobs_num: int = Field(0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        data = _without_nulls(data)
        if isinstance(data, dict) and "input_ids" not in data:
            hint = " (this engine is token-in only: render and tokenize the prompt, send input_ids)"
            raise ValueError("input_ids is required" + (hint if "text" in data else "") + ".")
        if isinstance(data, dict) and isinstance(data["input_ids"], list):
            if any(isinstance(token, list) for token in data["input_ids"]):
                raise ValueError("input_ids: batched requests are not supported; send one prompt per call.")
        return data

    @field_validator("input_ids")
    @classmethod
    def _prompt(cls, ids: list[int], info: ValidationInfo) -> list[int]:
        if not ids:
            raise ValueError("input_ids must not be empty.")
        context_length = (info.context or {}).get("context_length")
        if context_length is not None and len(ids) >= context_length:
            raise ValueError(
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({context_length} tokens)."
            )
        return _check_token_ids(ids, "input_ids", info)

    @field_validator("logprob_start_len")
    @classmethod
    def _output_logprobs_only(cls, start: int) -> int:
        if start != -1:
            raise ValueError("logprob_start_len is not supported: this engine returns output logprobs only.")
        return start


_PHRASES = {
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be a boolean",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "dict_type": "must be an object",
    "missing": "is required",
}


def describe(error: ValidationError) -> str:
    """The first problem of a validation error as one sentence: ``sampling_params.top_k must be an
    integer, got 1.5.``, or the validator's own message."""
    item = error.errors(include_url=False)[0]
    if item["type"] == "value_error":
        return str(item["ctx"]["error"])
    where = ".".join(str(part) for part in item["loc"]) or "the request body"
    phrase = _PHRASES.get(item["type"], item["msg"])
    return f"{where} {phrase}, got {item['input']!r}."


def _validate(model: type[BaseModel], data: Any, context: dict[str, int]) -> Any:
    if model is GenerateBody and not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object.")
    try:
        return model.model_validate(data, context=context)
    except ValidationError as error:
        raise BadRequest(describe(error)) from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply.") from None


def parse_sampling(raw: Any, vocab_size: int) -> SamplingParams:
    """Validate ``sampling_params`` with SGLang's rules and messages."""
    if raw is not None and not isinstance(raw, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(raw).__name__}.")
    return _validate(SamplingBody, raw or {}, {"vocab_size": vocab_size}).params()


def parse_generate(body: Any, vocab_size: int, context_length: int) -> GenerateRequest:
    """Validate a ``/generate`` JSON body into a :class:`GenerateRequest`."""
    request: GenerateBody = _validate(
        GenerateBody, body, {"vocab_size": vocab_size, "context_length": context_length}
    )
    start = request.routed_experts_start_len
    if not 0 <= start <= len(request.input_ids):
        raise BadRequest(
            f"routed_experts_start_len ({start}) must be within [0, {len(request.input_ids)}] (the prompt)."
        )
    return GenerateRequest(
        rid=request.rid or uuid.uuid4().hex,
        input_ids=list(request.input_ids),
        params=request.sampling_params.params(),
        return_logprob=request.return_logprob,
        stream=request.stream,
        return_routed_experts=request.return_routed_experts,
        routed_experts_start_len=start,
        top_logprobs_num=request.top_logprobs_num,
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
        if request.top_logprobs_num and generation.output_top_logprobs is not None:
            meta_info["output_top_logprobs"] = [
                [[logprob, token_id, None] for logprob, token_id in row]
                for row in generation.output_top_logprobs
            ]
    meta_info["reasoning_tokens"] = 0
    meta_info["completion_tokens"] = len(generation.output_ids)
    meta_info["cached_tokens"] = generation.cached_tokens
    if e2e_latency is not None:
        meta_info["e2e_latency"] = e2e_latency
    if request.return_routed_experts and generation.routed_experts is not None:
        ids = generation.routed_experts.astype("<i4").tobytes()  # SGLang's: base64 of int32, C order
        meta_info["routed_experts"] = base64.b64encode(ids).decode()
    return {"text": text, "output_ids": list(generation.output_ids), "meta_info": meta_info}
