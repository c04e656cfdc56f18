"""Pure host commit of one step's results: tokens appended with the stop rules in AR
order, per-step counters. No device access: ``result`` is the step's numpy output."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from specjax.request import RequestState

__all__ = ["CommitResult", "commit_rows"]


@dataclasses.dataclass
class CommitResult:
  """What one step committed.

  Attributes:
    emitted: per row, the tokens committed (after stop truncation; [] for skipped rows).
    finished: the rows that ended in this step.
    num_accepted: accepted drafts counted (drafts after a stop are not counted).
    num_emitted: tokens committed.
    accepted_per_position: ``i32[k]`` rows whose draft j (tree: depth j+1) was accepted.
    drafted_per_position: ``i32[k]`` rows with a draft at position j (tree: depth j+1).
  """

  emitted: list[list[int]]
  finished: list[RequestState]
  num_accepted: int
  num_emitted: int
  accepted_per_position: np.ndarray
  drafted_per_position: np.ndarray


def commit_rows(
    rows: Sequence[RequestState],
    result: np.ndarray,
    num_draft: np.ndarray,
    *,
    k: int,
    eos_ids: frozenset[int],
    max_model_len: int,
    decode: Callable[[list[int]], str] | None,
    now: float,
    reach: np.ndarray | None = None,
    skip: Sequence[bool] | None = None,
) -> CommitResult:
  """Commits ``result`` (the step's ``i32[B, L+2]``: tokens then accepted count).

  Row i emits ``result[i, :a+1]`` token by token through ``RequestState.append`` (EOS,
  stop ids, stop strings, max_tokens, max_model_len, in that order), so a stop inside
  an accepted run ends the request exactly where plain decoding would. Example: result
  row ``[5, 9, 2, -1, 2]`` (a = 2) with EOS 9 commits [5, 9], both accepted drafts (the
  recovered token 2 after them is dropped).

  Args:
    rows: the step's real rows (result rows beyond them are padding).
    num_draft: ``i32[>= rows]`` drafts verified per row (trees: nodes).
    k: num_speculative_tokens (length of the per-position counters; >= 1 used).
    reach: optional ``i32[rows]`` deepest tree depth per row (trees), else num_draft.
    skip: rows not to commit (already finished while the step was in flight).
  """
  width = max(k, 1)
  acc_pos = np.zeros(width, np.int32)
  drafted_pos = np.zeros(width, np.int32)
  emitted_rows, finished = [], []
  n_acc = n_emitted = 0
  for i, st in enumerate(rows):
    if skip is not None and skip[i]:
      emitted_rows.append([])
      continue
    a, n = int(result[i, -1]), int(num_draft[i])
    drafted_pos[: n if reach is None else int(reach[i])] += 1
    emitted = []
    for tok in result[i, : a + 1]:
      emitted.append(int(tok))
      if st.append(int(tok), eos_ids=eos_ids, max_model_len=max_model_len, decode=decode):
        break
    if st.first_token_at is None:
      st.first_token_at = now
    st.num_computed = len(st.tokens) - 1
    st.num_steps += 1
    st.num_draft_tokens += n
    accepted = min(a, len(emitted))
    st.num_accepted_tokens += accepted
    acc_pos[:accepted] += 1
    n_acc += accepted
    n_emitted += len(emitted)
    emitted_rows.append(emitted)
    if st.finish_reason is not None:
      st.finished_at = now
      finished.append(st)
  return CommitResult(emitted_rows, finished, n_acc, n_emitted, acc_pos[:k] if k else acc_pos[:0],
                      drafted_pos[:k] if k else drafted_pos[:0])
