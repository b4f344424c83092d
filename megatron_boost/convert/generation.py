"""Token sampling shared by the export check, tools/generate.py and the tests: greedy, or
temperature with nucleus (top-p) filtering, one token at a time from a next-token-logits
function (the megatron model recomputes the whole prefix; HF models use their KV cache), and
the text the new tokens add after a prompt (:func:`continuation_text`)."""

from __future__ import annotations

from typing import Callable, List, Optional

import os

import torch

__all__ = ["next_token", "sample", "continuation_text"]


def next_token(logits: torch.Tensor, temperature: float, top_p: float,
               gen: Optional[torch.Generator]) -> int:
    """One token from [V] logits: argmax at temperature 0, else a draw from the smallest set
    of most likely tokens whose probability reaches ``top_p``."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    # keep a token while the mass before it is below top_p (the first one always stays)
    keep = sorted_probs.cumsum(0) - sorted_probs < top_p
    sorted_probs = sorted_probs * keep
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=gen)
    return int(order[choice])


def sample(next_logits: Callable[[List[int]], torch.Tensor], prompt: List[int],
           max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
           seed: int = 0, stop_id: Optional[int] = None) -> List[int]:
    """The new tokens after ``prompt``; ``next_logits(ids)`` gives the [V] logits after ids."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(max_new_tokens):
        tok = next_token(next_logits(ids), temperature, top_p, gen)
        ids.append(tok)
        if tok == stop_id:
            break
    return ids[len(prompt):]


def continuation_text(decode: Callable[[List[int]], str], prompt: List[int],
                      new: List[int]) -> str:
    """The text ``new`` adds after ``prompt``, its leading space included.

    SentencePiece marks a word's leading space on the word ("▁the") and a decoder drops it at
    the start of a sequence, so decoding the new ids alone turns "Fix" + "▁the" into "Fixthe".
    The whole sequence is decoded instead and the decoded prompt cut off (up to the first
    character that differs: a character split between prompt and continuation by byte
    fallback decodes only in the whole)."""
    before, whole = decode(list(prompt)), decode(list(prompt) + list(new))
    return whole[len(os.path.commonprefix([before, whole])):]
