"""``rollbus engine``: the local SGLang-compatible model server (CPU, no weights needed).

Serves a small Qwen3-architecture model over the Qwen3.6 tokenizer: random weights from ``--seed`` and
the shape flags, or a ``save_pretrained`` checkpoint from ``--model-path``. ``--save-checkpoint DIR``
writes the model it would serve (e.g. the trainer's initial policy) and exits.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import AliasChoices, Field, model_validator

from rollbus.policy_model import DEFAULT_TOKENIZER, ModelSettings
from rollbus.settings import ENGINE_PORT

if TYPE_CHECKING:  # torch and transformers load when the engine runs, not for --help
    from rollbus.services.engine.engine import Engine
    from rollbus.services.engine.policies import Policy


class EngineSettings(ModelSettings):
    """Settings of ``rollbus engine`` (flags ``--x-y``, variables ``ROLLBUS_ENGINE_X_Y``)."""

    model_config = ModelSettings.scoped("engine")

    host: str = Field("127.0.0.1", min_length=1, description="address to listen on")
    port: int = Field(ENGINE_PORT, ge=0, le=65535, description="port to listen on (SGLang's default)")
    policy: Literal["sample", "scripted"] = Field(
        "sample", description="sample from the weights, or replay --script with real logprobs"
    )
    script: Path | None = Field(
        None,
        description='scripted policy: JSON file {"turns": [...]}, or a directory of NAME.json replayed to '
        "rollouts whose id starts with NAME-",
    )
    codex_script: Path | None = Field(
        None,
        description="scripted policy for the Codex CLI's requests (the adapter's Responses route): a file or "
        "directory as --script; unset: --script serves them too",
    )
    weight_version: str = Field("0", description="weight_version reported before any update")
    prefix_cache_size: int = Field(8, ge=0, description="KV cache entries kept (LRU)")
    prefill_chunk: int = Field(
        4096, ge=1, description="suffix tokens per prefill forward after a cache hit (abort granularity)"
    )
    threads: int = Field(0, ge=0, description="torch CPU threads (0: all cores)")
    return_original_logprob: bool = Field(
        False,
        validation_alias=AliasChoices(
            "return_original_logprob",
            "SGLANG_RETURN_ORIGINAL_LOGPROB",
            "ROLLBUS_ENGINE_RETURN_ORIGINAL_LOGPROB",
        ),
        description="logprobs at temperature 1 whatever the request's temperature "
        "(SGLang's SGLANG_RETURN_ORIGINAL_LOGPROB is read too)",
    )
    api_key: str | None = Field(
        None,
        repr=False,
        description="bearer key every route but /health requires, as SGLang's (give it to the adapter only)",
    )
    enable_return_routed_experts: bool = Field(
        False, description="record each MoE layer's experts per position and return them to requests with "
        "return_routed_experts (SGLang's flag; routing replay needs it)"
    )
    save_checkpoint: Path | None = Field(
        None, description="write the model to this directory and exit instead of serving"
    )

    @model_validator(mode="after")
    def _script_for_scripted(self) -> EngineSettings:
        if self.policy == "scripted" and self.script is None:
            raise ValueError("--policy scripted needs --script FILE")
        return self


add_arguments = EngineSettings.add_arguments


def build_policy(settings: EngineSettings) -> Policy:
    from rollbus.services.engine.policies import (
        CODEX,
        DEFAULT,
        NO_SCRIPT,
        SamplePolicy,
        ScriptedPolicy,
        load_scripts,
    )

    if settings.policy == "sample" or settings.script is None:
        return SamplePolicy()
    # one script per task (a directory); rollouts of no task get default.json or nothing
    scripts = load_scripts(settings.script)
    by_harness = {CODEX: load_scripts(settings.codex_script)} if settings.codex_script else {}
    return ScriptedPolicy(scripts.get(DEFAULT, NO_SCRIPT), by_prefix=scripts, by_harness=by_harness)


def build_engine(settings: EngineSettings) -> Engine:
    from rollbus.services.engine.engine import Engine
    from rollbus.services.engine.model import load_model, random_model
    from rollbus.tokenizer import SpecialIds, load_tokenizer

    tokenizer = load_tokenizer(settings.tokenizer)
    if settings.model_path:
        model, model_path = load_model(settings.model_path, len(tokenizer)), str(settings.model_path)
    else:
        spec, moe = settings.model_spec(), settings.moe_spec()
        stops = SpecialIds.from_tokenizer(tokenizer).stop_token_ids
        model = random_model(spec, len(tokenizer), stops, settings.seed, moe)
        model_path = f"random-qwen3(seed={settings.seed},hidden={spec.hidden_size},layers={spec.layers})"
        if moe is not None:
            model_path = f"random-qwen3-moe(seed={settings.seed},hidden={spec.hidden_size},layers=" \
                f"{spec.layers},experts={moe.experts},top_k={moe.top_k})"
    return Engine(
        model,
        tokenizer,
        build_policy(settings),
        model_path=model_path,
        weight_version=settings.weight_version,
        cache_capacity=settings.prefix_cache_size,
        prefill_chunk=settings.prefill_chunk,
        seed=settings.seed,
        original_logprob=settings.return_original_logprob,
        return_routed_experts=settings.enable_return_routed_experts,
    )


def tokenizer_path(name_or_path: str) -> str:
    from rollbus.tokenizer import tokenizer_dir

    return str(tokenizer_dir()) if name_or_path == DEFAULT_TOKENIZER else str(name_or_path)


def run(parsed: argparse.Namespace) -> int:
    import uvicorn

    from rollbus.services.engine.app import create_app

    settings = EngineSettings.from_args(parsed)  # a bad value: one line, exit 2, before torch or a port
    import torch
    import transformers

    torch.set_num_threads(settings.threads or os.cpu_count() or 1)
    transformers.utils.logging.disable_progress_bar()
    engine = build_engine(settings)
    if settings.save_checkpoint:
        engine.model.save_pretrained(settings.save_checkpoint)
        engine.tokenizer.save_pretrained(settings.save_checkpoint)
        print(f"saved {engine.model_path} to {settings.save_checkpoint}")
        return 0
    path = tokenizer_path(settings.tokenizer)
    app = create_app(engine, tokenizer_path=path, api_key=settings.api_key or None)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
    return 0
