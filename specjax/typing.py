"""The axis-letter glossary (ARCHITECTURE §2) as jaxtyping aliases for annotations.

``B`` sequences in the step, ``T`` query tokens, ``S`` KV positions, ``N`` query heads,
``K`` KV heads, ``G`` = N/K, ``H`` head dim, ``D`` model dim, ``F`` ffn dim, ``V``
vocabulary, ``L`` draft length (a chain verify step has ``T = L + 1``). Shapes are
checked only where a caller asks (``jaxtyping.jaxtyped`` + a type checker); the aliases
document shapes and dtypes in signatures, e.g. ``def f(logits: Logits) -> TokenIds``.
"""

from __future__ import annotations

from jaxtyping import Array, Float, Int, UInt32

__all__ = [
    "AcceptedCounts", "DraftProbs", "DraftTokens", "Hidden", "Keys", "KvLens", "Logits",
    "PageIndices", "Positions", "QueryLens", "TokenIds",
]

Logits = Float[Array, "B T V"]  # f32 target logits per query token
Hidden = Float[Array, "B T D"]  # hidden states, model dtype
TokenIds = Int[Array, "B T"]  # i32 token ids per query token
DraftTokens = Int[Array, "B L"]  # i32 draft ids, -1 padded
DraftProbs = Float[Array, "B L V"]  # f32 draft distributions q
AcceptedCounts = Int[Array, " B"]  # i32 leading accepted drafts per row
KvLens = Int[Array, " B"]  # i32 KV positions per row after the step
QueryLens = Int[Array, " B"]  # i32 query tokens per row
Positions = Int[Array, "B T"]  # i32 absolute positions of the query tokens
PageIndices = Int[Array, "B pages_per_seq"]  # i32 page table, -1 padded
Keys = UInt32[Array, "B 2"]  # u32 per-request PRNG keys
