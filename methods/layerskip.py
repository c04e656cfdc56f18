"""LayerSkip: early-exit self-speculation (Elhoushi et al. 2024, arXiv 2404.16710).

The target drafts for itself: a draft token comes from the target's layers ``[0, E)``
followed by its own final norm and LM head (``Transformer.__call__(layer_range=(0, E))``),
optionally through a trained exit adapter (``models.heads.EarlyExitHead``, kind
``early_exit``: the target stays frozen). The full target verifies with the shared
lossless verifier. No second model and no second KV cache (methods_reference.md §1.4;
facebookresearch/LayerSkip ``self_speculation/self_speculation_generator.py``).

KV cache: draft and verify share the target's one paged pool
(``Capabilities.drafts_in_target_kv``). At the start of a step row b has ``m`` tokens,
``x_0 .. x_{m-2}`` with KV in every layer (written by the target's prefill and verify
passes) and the pending ``x_{m-1}`` with none. Drafting ``n`` tokens runs ``n``
one-token early-exit forwards over ``x_{m-1}, d_1, .., d_{n-1}`` at positions
``m-1 .. m+n-2``; each reads the committed layer ``< E`` KV of the target and appends
its own layer ``< E`` KV, so nothing is prefilled or caught up for the draft.

  m = 5, n = 3: the draft writes layers < E at positions 4, 5, 6 (x_4, d_1, d_2)
  verify [x_4, d_1, d_2, d_3] at positions 4..7 writes every layer at 4..7

What is reused, exactly: the weights (layers < E, final norm, LM head, embedding), the
KV pool and the committed KV of layers < E (read by every draft forward). What is NOT
reused (the paper's code reuses both): the verify step is the engine's ordinary full
forward, so it recomputes layers ``< E`` for all ``n + 1`` positions (the paper runs
them for ``d_n`` only) and overwrites the draft's layer ``< E`` KV of positions
``m-1 .. m+n-2`` with its own values (equal up to rounding: a different XLA program);
the draft's exit hidden states are not passed to the verify step. Outputs are therefore
the verify pass's alone, as for every other method. Cost per step: ``n`` one-token passes
through E of ``num_layers`` layers, plus one full ``n + 1``-token verify.

Sampling: drafts are sampled from the early-exit distribution after the request's own
temperature / top-k / top-p, and that distribution q goes to the verifier
(``Draft.probs``), so the rejection sampler keeps the target distribution (lossless).
Greedy requests draft the argmax. ``coupled_sampling=True`` draws each draft by the
verifier's Gumbel race over q instead and sends no q (the coupled rule of
``specjax.verify``: seeded requests emit their seeded AR tokens, at a lower acceptance).

``exit_layer = num_layers`` is the oracle: the draft is the full model, so every greedy
draft is accepted (up to rounding ties between the one-token and the verify programs).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from methods.draft_model import continue_chain, draft_pick
from models.heads import EarlyExitHead, HeadConfig, head_class, load_head
from pallas_kernels.paged_attention.metadata import AttentionMetadata
from specjax.method import Capabilities, Draft, Method
from specjax.sampling import is_greedy

__all__ = ["LayerSkip", "early_exit_draft_step"]


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "adapter_graphdef", "exit_layer", "k", "num_steps",
                     "all_greedy", "implementation", "coupled"),
    donate_argnames=("kv_caches",),
)
def early_exit_draft_step(graphdef, params, adapter_graphdef, adapter_state, kv_caches, pending,
                          meta: AttentionMetadata, budgets, temperature, top_k, top_p, keys,
                          positions, *, exit_layer, k, num_steps, all_greedy, implementation,
                          coupled=False):
  """Drafts ``budgets[b]`` tokens for row b with the target's layers ``[0, exit_layer)``.

  Args:
    graphdef, params: the target (split).
    adapter_graphdef, adapter_state: an ``EarlyExitHead`` (split) or None (plain exit:
      the target's final norm and LM head on layer ``exit_layer - 1``'s output).
    kv_caches: the target's KV pool (donated); layers ``< exit_layer`` are written at
      the fed positions, other layers are untouched.
    pending: ``i32[B, 1]`` each row's pending token (no KV yet).
    meta: ``q_lens`` 1 for drafting rows, 0 for padding / budget-0 rows; ``kv_lens`` =
      tokens including the pending one.
    budgets: ``i32[B]`` draft tokens per row (<= num_steps; 0 where q_lens is 0).
      Forward i (0-based) produces draft i + 1 and includes only rows with budget > i.
    temperature, top_k, top_p, keys: ``[B]`` sampling arrays (``u32[B, 2]`` keys).
    positions: ``i32[B]`` absolute position of the first draft token (its key).
    exit_layer: static E, ``1 <= E <= num_layers``.
    k: static width of the outputs.
    num_steps: static number of draft forwards, ``max(budgets)`` (1 <= num_steps <= k).
    all_greedy: static; True drafts the argmax and returns no probabilities.
    implementation: paged-attention implementation(s).
    coupled: static; sampled rows draft with the verifier's noise and no probabilities
      are returned (``methods.draft_model.draft_pick``).

  Returns:
    ``(kv_caches, tokens i32[B, k], probs f32[B, k, V] or None when all_greedy or
    coupled)``; entries at and past a row's budget are garbage (tokens -1 past
    ``num_steps``, probs 0).
  """
  model = nnx.merge(graphdef, params)
  adapter = None if adapter_graphdef is None else nnx.merge(adapter_graphdef, adapter_state)
  batch = pending.shape[0]

  def forward(caches, tok, step_meta):  # tok i32[B, 1] -> (caches, logits f32[B, V])
    if adapter is None:
      caches, out = model(caches, tok, step_meta, logits_indices=jnp.zeros((batch, 1), jnp.int32),
                          implementation=implementation, layer_range=(0, exit_layer))
      return caches, out.logits[:, 0]
    # No logits rows from the model (its LM head would read the unadapted state).
    caches, out = model(caches, tok, step_meta, logits_indices=jnp.zeros((batch, 0), jnp.int32),
                        hidden_layers=(exit_layer,), implementation=implementation,
                        layer_range=(0, exit_layer))
    return caches, adapter.exit_logits(model, out.hidden[0][:, 0])

  pick = draft_pick(temperature, top_k, top_p, keys, all_greedy, coupled)
  kv_caches, logits = forward(kv_caches, pending, meta)
  tok, probs = pick(logits, positions)
  return continue_chain(forward, pick, kv_caches, tok, probs, meta, budgets, positions, k=k,
                        num_steps=num_steps)


@dataclasses.dataclass
class _State:
  runtime: object
  adapter_graphdef: object
  adapter_state: object


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSkip(Method):
  """Early-exit self-speculation: draft k tokens with the target's first E layers.

  Attributes:
    k: draft length.
    exit_layer: E, the layers ``[0, E)`` that draft (``1 <= E <= num_layers`` of the
      target; E = num_layers is the full model, an oracle). Required unless
      ``adapter_path`` is given (then it defaults to, and must equal, the adapter's E).
    adapter_path: an ``early_exit`` head directory (``models.heads.save_head``, or a
      ``methods.training`` run's output dir); None drafts through the plain final norm
      and LM head (what LayerSkip's own checkpoints are trained for).
    coupled_sampling: verify sampled drafts by the coupled rule instead of min(1, p/q)
      (as ``methods.draft_model.DraftModel.coupled_sampling``).

  Raises:
    ValueError: k < 1, a missing or non-positive exit_layer, an adapter of another kind
      or exit layer; (at ``init_state``) exit_layer > the target's num_layers, or an
      adapter that does not fit the target.
  """

  name = "layerskip"
  k: int = 4
  exit_layer: int | None = None
  adapter_path: str | None = None
  coupled_sampling: bool = False

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"num_speculative_tokens k={self.k} must be >= 1")
    if not isinstance(self.coupled_sampling, bool):
      raise ValueError(f"coupled_sampling={self.coupled_sampling!r} must be True (drafts "
                       "verified by the coupled rule) or False (by min(1, p/q))")
    if self.adapter_path is not None:
      from models.zoo import resolve_head_path  # noqa: PLC0415

      object.__setattr__(self, "adapter_path", resolve_head_path(self.adapter_path))
      cfg = self._adapter_config()
      if head_class(cfg.kind) is not EarlyExitHead:
        raise ValueError(f"head at adapter_path={self.adapter_path!r} has kind={cfg.kind!r}; "
                         "layerskip needs an 'early_exit' head")
      exit_of_adapter = cfg.feature_layers[0]
      if self.exit_layer is None:
        object.__setattr__(self, "exit_layer", exit_of_adapter)
      elif self.exit_layer != exit_of_adapter:
        raise ValueError(f"exit_layer={self.exit_layer} must equal the adapter's exit layer "
                         f"{exit_of_adapter} (adapter_path={self.adapter_path!r})")
    if self.exit_layer is None:
      raise ValueError("method 'layerskip' needs exit_layer=E (draft with layers [0, E)) "
                       "or an adapter_path")
    if (isinstance(self.exit_layer, bool) or not isinstance(self.exit_layer, (int, np.integer))
        or self.exit_layer < 1):
      raise ValueError(f"exit_layer={self.exit_layer!r} must be an int in [1, num_layers]")
    object.__setattr__(self, "exit_layer", int(self.exit_layer))

  def _adapter_config(self) -> HeadConfig:
    with open(os.path.join(self.adapter_path, "head_config.json")) as f:
      return HeadConfig.from_json(f.read())

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  def capabilities(self) -> Capabilities:
    return Capabilities(runs_on="device", emits_draft_probs=not self.coupled_sampling,
                        drafts_in_target_kv=True)

  def init_state(self, runtime) -> _State:
    num_layers = runtime.target.config.num_layers
    if self.exit_layer > num_layers:
      raise ValueError(f"exit_layer={self.exit_layer} must be in [1, {num_layers}] (the "
                       "target's num_layers)")
    graphdef = state = None
    if self.adapter_path is not None:
      adapter = load_head(self.adapter_path, runtime.target.config)
      graphdef, state = nnx.split(adapter)
    return _State(runtime, graphdef, state)

  def propose(self, state: _State, ctx):
    rt = state.runtime
    target = rt.target
    rows = len(ctx.request_ids)
    batch = ctx.page_indices.shape[0]
    budgets = np.minimum(np.maximum(np.asarray(ctx.budgets[:rows], np.int32), 0), self.k)
    num_steps = int(budgets.max(initial=0))
    if num_steps == 0:  # nobody drafts: no draft forward, the pool goes back untouched
      return state, Draft(np.full((rows, self.k), -1, np.int32), np.zeros(rows, np.int32),
                          kv_caches=ctx.kv_caches)
    pending = np.zeros((batch, 1), np.int32)
    q_lens = np.zeros(batch, np.int32)
    kv_lens = np.zeros(batch, np.int32)
    positions = np.zeros(batch, np.int32)
    row_budgets = np.zeros(batch, np.int32)
    row_budgets[:rows] = budgets
    for i, t in enumerate(ctx.token_ids):
      if budgets[i] > 0:
        pending[i, 0] = t[-1]
        q_lens[i], kv_lens[i], positions[i] = 1, len(t), len(t)
    all_greedy = bool(np.all(is_greedy(ctx.temperature[:rows])))
    meta = AttentionMetadata(ctx.page_indices, kv_lens, q_lens)
    kv_caches, tokens, probs = early_exit_draft_step(
        target.graphdef, target.params, state.adapter_graphdef, state.adapter_state,
        ctx.kv_caches, pending, meta, row_budgets, ctx.temperature, ctx.top_k, ctx.top_p,
        ctx.keys, positions, exit_layer=self.exit_layer, k=self.k, num_steps=num_steps,
        all_greedy=all_greedy, implementation=rt.attention_implementation,
        coupled=self.coupled_sampling)
    tokens = np.array(tokens)[:rows]
    tokens[np.arange(self.k)[None] >= budgets[:, None]] = -1
    return state, Draft(tokens, budgets, probs=probs, kv_caches=kv_caches)
