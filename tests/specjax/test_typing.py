"""The jaxtyping aliases of the axis glossary accept and refuse the right arrays."""

import jax.numpy as jnp

from specjax.typing import DraftTokens, Keys, Logits


def test_aliases_check_rank_and_dtype():
  assert isinstance(jnp.zeros((2, 4, 8)), Logits)
  assert not isinstance(jnp.zeros((2, 4)), Logits)  # rank
  assert not isinstance(jnp.zeros((2, 4, 8), jnp.int32), Logits)  # dtype
  assert isinstance(jnp.full((2, 3), -1, jnp.int32), DraftTokens)
  assert isinstance(jnp.zeros((5, 2), jnp.uint32), Keys)
  assert not isinstance(jnp.zeros((5, 3), jnp.uint32), Keys)  # a key is 2 words
