"""``rollbus engine``: the local SGLang-compatible model server (CPU, no weights needed).

Serves a small Qwen3-architecture model over the Qwen3.6 tokenizer: random weights from ``--seed`` and
the shape flags, or a ``save_pretrained`` checkpoint from ``--model-path``. ``--save-checkpoint DIR``
writes the model it would serve (e.g. the trainer's initial policy) and exits.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import transformers

from rollbus.config import add_option, parse_bool
from rollbus.tokenizer import DEFAULT_TOKENIZER, SpecialIds, load_tokenizer, tokenizer_dir
from services.engine.engine import Engine
from services.engine.model import ModelSpec, load_model, random_model
from services.engine.policies import (
    Policy,
    SamplePolicy,
    Script,
    ScriptedPolicy,
    load_script,
    load_script_dir,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_option(parser, "--host", default="127.0.0.1", help="address to listen on")
    add_option(parser, "--port", default=30000, type=int, help="port to listen on (SGLang's default)")
    add_option(parser, "--policy", default="sample", choices=["sample", "scripted"],
               help="sample from the weights, or replay --script with real logprobs")
    add_option(parser, "--script", default=None,
               help='scripted policy: JSON file {"turns": [...]}, or a directory of NAME.json replayed to '
               "rollouts whose id starts with NAME-")
    add_option(parser, "--tokenizer", default=DEFAULT_TOKENIZER, help="built-in tokenizer name or directory")
    add_option(parser, "--model-path", default=None, help="save_pretrained checkpoint dir (else random)")
    add_option(parser, "--seed", default=0, type=int, help="seed of the random weights and of sampling")
    add_option(parser, "--hidden-size", default=ModelSpec.hidden_size, type=int, help="random model width")
    add_option(parser, "--layers", default=ModelSpec.layers, type=int, help="random model depth")
    add_option(parser, "--heads", default=ModelSpec.heads, type=int, help="attention heads")
    add_option(parser, "--kv-heads", default=ModelSpec.kv_heads, type=int, help="key/value heads")
    add_option(parser, "--head-dim", default=ModelSpec.head_dim, type=int, help="attention head size")
    add_option(parser, "--intermediate-size", default=ModelSpec.intermediate_size, type=int, help="MLP width")
    add_option(parser, "--context-length", default=ModelSpec.context_length, type=int, help="max tokens")
    add_option(parser, "--weight-version", default="0", help="weight_version reported before any update")
    add_option(parser, "--prefix-cache-size", default=8, type=int, help="KV cache entries kept (LRU)")
    add_option(parser, "--prefill-chunk", default=4096, type=int,
               help="suffix tokens per prefill forward after a cache hit (abort granularity)")
    add_option(parser, "--threads", default=0, type=int, help="torch CPU threads (0: all cores)")
    add_option(parser, "--return-original-logprob", default=parse_bool(os.environ.get(
        "SGLANG_RETURN_ORIGINAL_LOGPROB", "false")), type=parse_bool, nargs="?", const=True,
        help="logprobs at temperature 1 whatever the request's temperature (SGLANG_RETURN_ORIGINAL_LOGPROB)")
    add_option(parser, "--api-key", default=None,
               help="bearer key every route but /health requires, as SGLang's (give it to the adapter only)")
    add_option(parser, "--save-checkpoint", default=None, type=Path,
               help="write the model to this directory and exit instead of serving")


def model_spec(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(
        hidden_size=args.hidden_size,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        context_length=args.context_length,
    )


def build_policy(args: argparse.Namespace) -> Policy:
    if args.policy == "sample":
        return SamplePolicy()
    if not args.script:
        raise SystemExit("--policy scripted needs --script FILE")
    if Path(args.script).is_dir():  # one script per task; rollouts of no task get default.json or nothing
        scripts = load_script_dir(args.script)
        return ScriptedPolicy(scripts.get("default", Script(turns=())), by_prefix=scripts)
    return ScriptedPolicy(load_script(args.script))


def build_engine(args: argparse.Namespace) -> Engine:
    tokenizer = load_tokenizer(args.tokenizer)
    if args.model_path:
        model, model_path = load_model(args.model_path, len(tokenizer)), str(args.model_path)
    else:
        spec = model_spec(args)
        stops = SpecialIds.from_tokenizer(tokenizer).stop_token_ids
        model = random_model(spec, len(tokenizer), stops, args.seed)
        model_path = f"random-qwen3(seed={args.seed},hidden={spec.hidden_size},layers={spec.layers})"
    return Engine(
        model,
        tokenizer,
        build_policy(args),
        model_path=model_path,
        weight_version=args.weight_version,
        cache_capacity=args.prefix_cache_size,
        prefill_chunk=args.prefill_chunk,
        seed=args.seed,
        original_logprob=args.return_original_logprob,
    )


def tokenizer_path(name_or_path: str) -> str:
    return str(tokenizer_dir()) if name_or_path == DEFAULT_TOKENIZER else str(name_or_path)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from services.engine.app import create_app

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    transformers.utils.logging.disable_progress_bar()
    engine = build_engine(args)
    if args.save_checkpoint:
        engine.model.save_pretrained(args.save_checkpoint)
        engine.tokenizer.save_pretrained(args.save_checkpoint)
        print(f"saved {engine.model_path} to {args.save_checkpoint}")
        return 0
    app = create_app(engine, tokenizer_path=tokenizer_path(args.tokenizer), api_key=args.api_key or None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
