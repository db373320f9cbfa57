"""Choosing the next token and scoring it, with SGLang's conventions.

Sampling follows SGLang's sampler: divide the logits by the temperature, softmax, keep the top-k /
top-p (nucleus) support, renormalise, draw. A temperature below 1e-6 means greedy (SGLang turns it
into ``top_k=1`` at temperature 1).

The returned logprob mirrors SGLang's default (``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset): the
log-softmax of the temperature-scaled logits, taken *before* the top-k/top-p truncation; greedy
requests get the log-softmax of the raw logits. With ``original=True`` (the env var set) it is always
the log-softmax of the raw logits, i.e. temperature 1. At temperature 1 the two agree, which is what a
trainer recomputing logprobs from the same weights sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30


@dataclass(frozen=True)
class Sampling:
    """The knobs that shape the next-token distribution (already validated)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


def logprob_temperature(sampling: Sampling, *, original: bool) -> float:
    """The temperature whose log-softmax SGLang reports for a sampled token."""
    if original or sampling.greedy:
        return 1.0
    return sampling.temperature


def top_logprobs(
    logits: torch.Tensor, temperature: float, k: int
) -> tuple[list[list[float]], list[list[int]]]:
    """Each row's ``k`` best log-probabilities and their token ids at ``temperature`` (the one the sampled
    token's logprob is reported at, so the sampled token's entry matches it when it is among them)."""
    logprobs = torch.log_softmax(logits.float().reshape(-1, logits.shape[-1]) / temperature, dim=-1)
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return values.tolist(), ids.tolist()


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probabilities of ``token_ids`` under ``logits`` (rows align) at ``temperature``."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


def truncated_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Renormalised probabilities over the top-k / top-p / min-p support of one logits row."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if sampling.top_k < probs.shape[-1]:
        kth = torch.topk(probs, sampling.top_k).values[-1]
        keep &= probs >= kth
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        in_nucleus = torch.zeros_like(keep)
        in_nucleus[order] = mass_before < sampling.top_p
        keep &= in_nucleus
    if sampling.min_p > 0.0:
        keep &= probs >= sampling.min_p * probs.max()
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def sample_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """Draw the next token id from one row of logits."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    probs = truncated_probs(logits, sampling)
    return int(torch.multinomial(probs, 1, generator=generator))
