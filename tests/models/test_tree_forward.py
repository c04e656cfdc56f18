"""A tree verify step equals the uncached forward along every root-to-node path.

The step feeds ``[root, nodes..]`` with the tree mask and depth positions of
``specjax.tree``; node j's logits must equal the full forward of the prefix plus the
path to j. Gemma 3's local layers (window 4) check that the sliding window is measured
in positions, not KV slots (a deep node sits several slots past its position). After
the path's KV is moved into place (``move_kv_step``), decoding the next token must
again equal the full forward. Pages are random and unwritten slots NaN
(``models.testing.PagedKV``).
"""

import dataclasses

import jax
import numpy as np
import pytest

from models import testing
from specjax.steps import move_kv_step
from specjax.tree import path_moves, tree_mask, tree_positions

jax.config.update("jax_default_matmul_precision", "highest")

ATOL = 1e-4
# Row 0: root -> 0 -> 2 -> 4 -> {6, 7}, root -> 0 -> 3, root -> 1 -> 5. Row 1: 5 nodes.
PARENTS = np.array([[-1, -1, 0, 0, 2, 1, 4, 4], [-1, 0, -1, 1, 3, -1, -1, -1]], np.int32)
NUM_NODES = np.array([8, 5], np.int32)
PREFIX_LENS = (11, 7)  # committed tokens incl. the pending root
PATHS = ([1, 5], [0, 1, 3])  # accepted paths moved into place after the step


def _path_to(parents, j):
  path = []
  while j >= 0:
    path.append(j)
    j = parents[j]
  return path[::-1]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tree_step_matches_full_forward(family):
  cfg = testing.tiny_config(family)
  model = testing.random_model(cfg, seed=1)
  rng = np.random.default_rng(3)
  batch, length = PARENTS.shape
  prefixes = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in PREFIX_LENS]
  nodes = rng.integers(0, cfg.vocab_size, (batch, length)).astype(np.int32)
  max_len = max(PREFIX_LENS) + length + 2
  kv = testing.PagedKV(cfg, batch, max_len, page_size=4, seed=5)

  width = max(PREFIX_LENS)
  tokens = np.zeros((batch, width), np.int32)
  for b, p in enumerate(prefixes):
    tokens[b, : len(p) - 1] = p[:-1]
  kv.step(model, tokens, [len(p) - 1 for p in prefixes])  # prefill all but the root

  starts = kv.kv_lens.copy()  # root positions
  step_tokens = np.zeros((batch, length + 1), np.int32)
  for b, p in enumerate(prefixes):
    step_tokens[b, 0] = p[-1]
    step_tokens[b, 1:] = nodes[b]
  meta = kv.metadata(1 + NUM_NODES)
  meta = dataclasses.replace(
      meta, tree_mask=tree_mask(PARENTS, NUM_NODES, length + 1),
      positions=tree_positions(PARENTS, NUM_NODES, starts, length + 1))
  kv.caches, out = testing.run_step(model, kv.caches, step_tokens, meta)
  kv.kv_lens = kv.kv_lens + 1 + NUM_NODES
  logits = np.asarray(out.logits)

  seqs, where = [], []
  for b, p in enumerate(prefixes):
    seqs.append(list(p))
    where.append((b, 0))
    for j in range(NUM_NODES[b]):
      seqs.append(list(p) + [int(nodes[b, i]) for i in _path_to(PARENTS[b], j)])
      where.append((b, j + 1))
  pad = np.zeros((len(seqs), max_len), np.int32)
  for i, s in enumerate(seqs):
    pad[i, : len(s)] = s
  ref = np.asarray(testing.full_forward(model, pad, lengths=[len(s) for s in seqs]).logits)
  for i, ((b, t), s) in enumerate(zip(where, seqs)):
    got = logits[b, t]
    assert np.isfinite(got).all(), (b, t)
    np.testing.assert_allclose(got, ref[i, len(s) - 1], rtol=0, atol=ATOL, err_msg=f"{b=} {t=}")

  # Commit each row's path: move its KV to root + depth, roll back, decode one token.
  path_nodes = np.full((batch, length), -1, np.int32)
  for b, path in enumerate(PATHS):
    assert all(PARENTS[b, n] == (path[i - 1] if i else -1) for i, n in enumerate(path))
    path_nodes[b, : len(path)] = path
  num = np.array([len(p) for p in PATHS], np.int32)
  src, dst, any_move = path_moves(path_nodes, num, starts)
  assert any_move
  kv.caches = move_kv_step(kv.caches, kv.page_indices, src, dst, num_layers=cfg.num_layers)
  nxt = rng.integers(0, cfg.vocab_size, batch).astype(np.int32)
  full = []
  for b in range(batch):
    kv.truncate(b, int(starts[b] + 1 + num[b]))
    full.append(list(prefixes[b]) + [int(nodes[b, n]) for n in PATHS[b]] + [int(nxt[b])])
  got = np.asarray(kv.step(model, nxt[:, None], [1, 1]).logits)[:, 0]
  pad = np.zeros((batch, max_len), np.int32)
  for b, s in enumerate(full):
    pad[b, : len(s)] = s
  ref = np.asarray(testing.full_forward(model, pad, lengths=[len(s) for s in full]).logits)
  for b, s in enumerate(full):
    np.testing.assert_allclose(got[b], ref[b, len(s) - 1], rtol=0, atol=ATOL, err_msg=f"{b=}")
