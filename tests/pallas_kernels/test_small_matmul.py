"""``pallas_kernels.small_matmul``: the Pallas Triton kernel (interpret mode on CPU)
equals the full-f32 reference, and bad input is refused with the value named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.small_matmul import implementations_used, small_matmul
from pallas_kernels.small_matmul.triton import block_size

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.mark.parametrize("rows,depth,n", [(1, 576, 192), (4, 64, 96), (5, 576, 64),
                                          (16, 128, 1536)])
def test_triton_matches_reference(rows, depth, n):
  kx, kw = jax.random.split(jax.random.key(rows))
  x = jax.random.normal(kx, (rows, depth), jnp.float32)
  w = jax.random.normal(kw, (depth, n), jnp.float32)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  got = small_matmul(x, w, implementation="pallas_triton", interpret=True)
  ref = small_matmul(x, w)
  assert got.shape == (rows, n) and got.dtype == jnp.float32
  # Both are f32 sums of `depth` products: within f32 rounding of the f64 result.
  tol = 1e-6 * np.sqrt(depth) * np.abs(want).max()
  np.testing.assert_allclose(np.asarray(got), want, atol=tol)
  np.testing.assert_allclose(np.asarray(ref), want, atol=tol)
  assert "pallas_triton" in implementations_used()


def test_block_size():
  assert [block_size(n, 64) for n in (576, 192, 1536, 48, 200)] == [64, 64, 64, 16, 0]


def test_shapes_the_kernel_does_not_take_move_on_or_raise():
  x, w = jnp.ones((17, 64)), jnp.ones((64, 32))
  with pytest.raises(NotImplementedError, match="<= 16 rows, got 17"):
    small_matmul(x, w, implementation="pallas_triton", interpret=True)
  out = small_matmul(x, w, implementation=("pallas_triton", "reference"), interpret=True)
  np.testing.assert_allclose(np.asarray(out), 64.0)


def test_bad_input_is_named():
  with pytest.raises(ValueError, match="implementation='cuda' must be one of"):
    small_matmul(jnp.ones((1, 16)), jnp.ones((16, 16)), implementation="cuda")
  with pytest.raises(ValueError, match=r"x \(1, 16\) and w \(8, 16\)"):
    small_matmul(jnp.ones((1, 16)), jnp.ones((8, 16)))
  with pytest.raises(ValueError, match="must be float32"):
    small_matmul(jnp.ones((1, 16), jnp.bfloat16), jnp.ones((16, 16), jnp.bfloat16))
