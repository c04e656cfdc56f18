"""SVIP: entropy-stopped draft length (Zhang et al. 2024, "Draft Model Knows When to
Stop: Self-Verification Length Policy for Speculative Decoding", arXiv 2411.18462;
official code Geralt-Targaryen/SVIP ``vanilla-sd/eval_specbench.py``).

Wraps an autoregressive drafter (``draft_model``, ``eagle`` or ``eagle3`` chains). At
draft step t the drafter's distribution ``q_t`` (softmax of its untempered logits) has
entropy ``H_t`` in nats; drafting stops when ``sqrt(0.15 * H_t) > h`` (h = 0.3: ``H_t >
0.6`` nats) or at the row's budget (<= k). As in the official code the stop test comes
AFTER emitting token t: ``x_t`` is drawn from ``q_t``, appended to the draft (and
verified), and only then does drafting end, so a row drafts ``min(budget, first t with
sqrt(0.15 H_t) > h)`` tokens. Rows differ in length; the engine verifies at the bucket of
the longest (ragged width).

The test runs on the device inside the drafter's loop (``DraftModel.stop_entropy``: a
``lax.while_loop`` that also ends the draft forwards once every row has stopped;
``LearnedHeadMethod.stop_entropy``: the head runs its ``max(budgets)`` steps and only the
count is cut), so there is no host round trip per position: ``num_tokens`` comes back
with the draft tokens. The entropy is that of the raw logits (the code's
``calc_entropy``), independent of temperature / top-k / top-p.

Lossless: whether ``x_{t+1}`` is drafted depends on ``H_1 .. H_t``, computed before
``x_t`` is drawn (pre-token), so admission never depends on a token's own value; the
verification is the shared rejection sampler. Unlike the code we do not stop at a
drafted EOS (the engine's stop rules cut at EOS anyway).

Runs on the host-called path (``Capabilities.runs_on`` "device"), one synchronous engine
step each: the entropy stop is a ``lax.while_loop`` over draft forwards, and on the H200
any device-side loop condition makes the dispatch wait for the device
(``benchmarks/dispatch_probe.py``), so fusing it would not overlap anyway; the cost is
the synchronous step's host time (propose call, read, commit) on top of the device time.
"""

from __future__ import annotations

import dataclasses
import math

from methods.wrapped import WrappedDrafter

__all__ = ["Svip", "svip_stop_entropy"]

ENTROPY_SCALE = 0.15  # hard-coded in the official code: stop when sqrt(0.15 * H) > h


def svip_stop_entropy(h: float) -> float | None:
  """The entropy (nats) above which SVIP stops: ``h**2 / 0.15`` (h = 0.3 -> 0.6);
  None for ``h = inf`` (never stop: the wrapped drafter's fixed-k behaviour)."""
  return None if math.isinf(h) else h * h / ENTROPY_SCALE


@dataclasses.dataclass(frozen=True, kw_only=True)
class Svip(WrappedDrafter):
  """Entropy-stopped drafting around ``drafter`` (see the module docstring).

  Attributes:
    k: most draft tokens per row.
    h: threshold on ``sqrt(0.15 * H)`` (H in nats); >= 0; ``inf`` never stops.
    drafter: a "draft_model", "eagle" or "eagle3" chain method (through the registry: its
      name, with ``drafter_options``, e.g. ``head_path``).

  Raises:
    ValueError: ``h`` negative or NaN; a drafter without an entropy stop.
  """

  name = "svip"
  h: float = 0.3

  def __post_init__(self):
    if not self.h >= 0:
      raise ValueError(f"h={self.h} must be >= 0 (inf never stops)")
    super().__post_init__()
    if not any(f.name == "stop_entropy" for f in dataclasses.fields(self.inner)):
      raise ValueError(f"drafter={self.inner.name!r} has no entropy stop; SVIP wraps "
                       "'draft_model', 'eagle' or 'eagle3' chains")
    object.__setattr__(self, "inner", dataclasses.replace(
        self.inner, stop_entropy=svip_stop_entropy(self.h)))
