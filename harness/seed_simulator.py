"""The seed paper's simulation semantics (SpecDecode-Bench/simulator, the simulator behind
"Speculative Decoding: Performance or Illusion?", arXiv 2601.11580), written from its
documented behaviour so that its published numbers can be reproduced from its own trace
files (``../shared/seed_traces/README.md``; ``docs/simulator.md`` lists every difference
from ``harness.simulator``'s semantics and what it changes).

The rules, per trace method m with ``acc_len[m]`` (tokens a step commits, drafts + 1):

  * a request's output length n is the length of the policy method's ``acc_len`` list
    (the combination: the shorter of its methods' lists); requests with n = 0 are
    dropped, then ``num_requests`` (300) are drawn with Python's
    ``random.Random(seed).sample`` (seed 42) and simulated one at a time;
  * a batch of size B is B copies of the request; prefill is one target forward over
    the B prompts plus one step overhead, and leaves output length g = 1 and B * (P + 1)
    KV tokens;
  * AR: n - 1 decode steps, each one target forward over the running rows plus the
    overhead;
  * SD step at output length g reads ``a = acc_len[g - 1]`` (the combination: the
    largest over its methods) and verifies ``v`` tokens: ``k + 1`` for a fixed k,
    ``a`` for the oracle and the combination; for n-gram with a fixed k, a row with
    ``a == 1`` finds no match with probability ``1 - match_probability`` (one uniform
    draw from the same ``random.Random`` stream per such row, in row order) and then
    verifies 1 token; it commits ``min(a, v)`` and g grows by that, past n if the last
    step overshoots (no cap at the tokens left);
  * step cost: one target forward (KV tokens of every running row, ``sum v`` query
    tokens), then per row its draft time and the overhead; a row's draft time uses the
    KV count as it stands when the row is reached (earlier rows of the step have
    already added their commits and released their finished KV). n-gram drafting is
    ``verify_fraction`` of the forward, free for a row verifying 1 token; EAGLE drafting
    is linear in KV tokens and in v (``num_spec_tokens``) and charged on every step,
    also where v = 1; the combination is charged n-gram's cost, no switching cost;
  * per request: latency = mean over the B copies of their summed step times;
    throughput = B n / latency; speedup = mean SD throughput / mean AR throughput over
    the sampled requests.

Only the ``seed-llama8b-h100`` cost model's shape is assumed: a ``specjax.cost_model``
whose target is linear and whose draft costs for the policy's method (n-gram for the
combination) are ``DraftCost`` objects, charged without their zero-when-idle guard
(``charge_idle=True``; the draft "row" is one copy, ``v - 1`` its draft length).
"""

from __future__ import annotations

import random

import numpy as np

from specjax.cost_model import CostModel, DraftCost

__all__ = ["MATCH_PROBABILITY", "simulate_seed"]

# The seed's n-gram match probability for a position whose acc_len is 1, per data set.
MATCH_PROBABILITY = {"sharegpt": 0.2, "cnn": 0.4, "gsm8k": 0.2, "instructcoder": 0.8}
NGRAM = "ngram"


def _lengths(record, methods) -> int:
  missing = [m for m in methods if m not in record.methods]
  if missing:
    raise ValueError(f"request {record.request_id!r} has no trace for methods {missing}; it "
                     f"has {sorted(record.methods)}")
  return min(len(record.methods[m].acc_len) for m in methods)


def _ar_latency(cost: CostModel, prompt: int, n: int, copies: int) -> float:
  """Mean latency of one copy under AR (every copy runs the same steps)."""
  ovh = cost.overhead.ar(1)
  t = cost.target.time(0, copies * prompt) + ovh
  steps = np.arange(max(n - 1, 0))
  kv = copies * (prompt + 1) + copies * steps
  return t + float(np.sum(cost.target.time(kv, copies) + ovh))


def _sd_run(cost: CostModel, policy, acc: np.ndarray, prompt: int, n: int, copies: int,
            draft: DraftCost, is_ngram: bool, match_p: float | None, rng: random.Random):
  """Mean SD latency over the copies, steps, row-steps and committed tokens.
  ``is_ngram``: the policy's one method is n-gram (match draws for a fixed k, free
  drafting for a row verifying one token); not for the combination."""
  ovh = cost.overhead.sd(1, 0)
  lat = np.full(copies, cost.target.time(0, copies * prompt) + ovh)
  g = np.ones(copies, np.int64)
  alive = np.ones(copies, bool)
  kv = copies * (prompt + 1)
  steps = row_steps = committed = 0
  while alive.any():
    idx = np.flatnonzero(alive)
    a = acc[g[idx] - 1]
    if policy.kind == "fixed":
      v = np.full(idx.size, policy.k + 1, np.int64)
      if is_ngram:
        for j in np.flatnonzero(a == 1):  # row order, as the seed draws
          if not rng.random() < match_p:
            v[j] = 1
    else:
      v = a.copy()
      if policy.k:
        v = np.minimum(v, policy.k + 1)
    verify = cost.target.time(kv, int(v.sum()))
    commit = np.minimum(a, v)
    g_new = g[idx] + commit
    done = g_new >= n
    delta = commit - np.where(done, g_new + prompt, 0)
    seen = kv + np.concatenate([[0], np.cumsum(delta)[:-1]])  # KV when each row drafts
    d = draft.time(1, v - 1, seen, verify, charge_idle=True)
    if is_ngram:
      d = np.where(v == 1, 0.0, d)
    lat[idx] += verify + d + ovh
    g[idx] = g_new
    kv += int(delta.sum())
    alive[idx[done]] = False
    steps += 1
    row_steps += idx.size
    committed += int(commit.sum())
  return float(lat.mean()), steps, row_steps, committed


def _sd_run_identical(cost: CostModel, policy, acc: np.ndarray, prompt: int, n: int,
                      copies: int, draft: DraftCost, is_ngram: bool, match_p=None, rng=None):
  """``_sd_run`` for copies that stay identical (no match draws, or one copy): one row's
  trajectory; copy j drafts with the KV count moved by j times a row's KV change, and a
  linear draft cost averages to the middle copy's."""
  ovh = cost.overhead.sd(1, 0)
  lat = cost.target.time(0, copies * prompt) + ovh
  g, kv = 1, copies * (prompt + 1)
  steps = committed = 0
  cap = policy.k + 1 if policy.kind == "fixed" else None
  while True:
    a = int(acc[g - 1])
    v = cap if cap is not None else (min(a, policy.k + 1) if policy.k else a)
    if rng is not None and a == 1 and not rng.random() < match_p:  # one copy's draw
      v = 1
    verify = cost.target.time(kv, copies * v)
    commit = min(a, v)
    g += commit
    done = g >= n
    delta = commit - (g + prompt if done else 0)
    d = 0.0 if is_ngram and v == 1 else draft.time(
        1, v - 1, kv + delta * (copies - 1) / 2, verify, charge_idle=True)
    lat += verify + d + ovh
    kv += copies * delta
    steps += 1
    committed += copies * commit
    if done:
      return lat, steps, steps * copies, committed


def simulate_seed(records, cost: CostModel, policy, batch_size: int, *,
                  match_probability: float | None = None, num_requests: int = 300,
                  seed: int = 42) -> dict:
  """One (policy, batch size) row under the seed's semantics (module docstring).

  Args:
    records: ``harness.traces.TraceRecord`` list, in file order.
    cost: the cost model (``seed-llama8b-h100`` for the seed's numbers).
    policy: ``harness.simulator.Policy`` ("fixed", "oracle" or "combine"; the combination
      must include "ngram", whose cost it is charged).
    batch_size: B, copies of each request.
    match_probability: n-gram match probability where acc_len is 1 (fixed k only;
      ``MATCH_PROBABILITY`` has the seed's per data set). Required for a fixed-k n-gram
      policy.
    num_requests: requests drawn (at most the records with output).
    seed: the ``random.Random`` seed of the draw and of the n-gram match draws.

  Returns:
    dict: policy, kind, methods, k, batch_size, semantics "seed", tau, speedup, the mean
    SD and AR throughputs, SD steps.

  Raises:
    ValueError: an "ar" policy, a combination without "ngram", a missing match
      probability, batch size < 1, or no request with output.
  """
  if policy.kind == "ar":
    raise ValueError("policy 'ar' is the baseline of every seed-semantics row, not a row")
  if policy.kind == "combine" and NGRAM not in policy.methods:
    raise ValueError(f"seed semantics charge a combination n-gram's draft cost: methods="
                     f"{policy.methods} must include {NGRAM!r}")
  if batch_size < 1:
    raise ValueError(f"{batch_size=} must be >= 1")
  is_ngram = policy.kind != "combine" and policy.methods[0] == NGRAM
  if is_ngram and policy.kind == "fixed" and match_probability is None:
    raise ValueError("a fixed-k n-gram policy under seed semantics needs match_probability "
                     f"(the seed's per data set: {MATCH_PROBABILITY})")
  if match_probability is not None and not 0.0 <= match_probability <= 1.0:
    raise ValueError(f"match_probability={match_probability} must be in [0, 1]")
  cost_method = NGRAM if policy.kind == "combine" else policy.methods[0]
  draft = cost.draft(cost_method)
  data = [r for r in records if _lengths(r, policy.methods) > 0]
  if not data:
    raise ValueError(f"no request has output for methods {policy.methods}")
  rng = random.Random(seed)
  chosen = rng.sample(data, k=min(num_requests, len(data)))
  sd_tpt, ar_tpt = [], []
  steps = row_steps = committed = 0
  for r in chosen:
    n = _lengths(r, policy.methods)
    acc = np.max([np.asarray(r.methods[m].acc_len[:n], np.int64) for m in policy.methods], 0)
    prompt = len(r.prompt_token_ids)
    draws = is_ngram and policy.kind == "fixed"
    if draws and batch_size > 1:  # copies draw their own matches
      sd, s, rs, c = _sd_run(cost, policy, acc, prompt, n, batch_size, draft, is_ngram,
                             match_probability, rng)
    else:
      sd, s, rs, c = _sd_run_identical(cost, policy, acc, prompt, n, batch_size, draft,
                                       is_ngram, match_probability, rng if draws else None)
    ar = _ar_latency(cost, prompt, n, batch_size)
    sd_tpt.append(batch_size * n / sd)
    ar_tpt.append(batch_size * n / ar)
    steps, row_steps, committed = steps + s, row_steps + rs, committed + c
  return {
      "policy": policy.label, "kind": policy.kind, "methods": "+".join(policy.methods),
      "k": policy.k, "batch_size": batch_size, "batching": "copies", "semantics": "seed",
      "cost_model": cost.name, "tau": committed / row_steps if row_steps else float("nan"),
      "speedup": float(np.mean(sd_tpt) / np.mean(ar_tpt)),
      "sd_tokens_per_s": float(np.mean(sd_tpt)), "ar_tokens_per_s": float(np.mean(ar_tpt)),
      "sd_steps": steps, "num_requests": len(chosen),
  }
