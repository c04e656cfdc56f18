"""``models.layers.project``: the GPU one-row padding path equals the plain einsum.

The padded path only runs on GPU (where it was measured); here it is forced by making
``jax.default_backend`` report "gpu", so CI checks that padding a one-row input to two
rows and keeping the first never changes a value or a shape.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import layers

SPECS = [  # (spec, x shape, w shape), as used by models.llama
    ("BTD,DNH->BTNH", (1, 1, 8), (8, 2, 4)),
    ("BTE,ED->BTD", (1, 1, 8), (8, 6)),
    ("BTD,DF->BTF", (1, 1, 8), (8, 16)),
    ("...D,VD->...V", (1, 1, 8), (32, 8)),
    ("...D,DV->...V", (1, 8), (8, 32)),
]


@pytest.mark.parametrize("spec,x_shape,w_shape", SPECS)
@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_project_matches_einsum(monkeypatch, spec, x_shape, w_shape, backend):
  monkeypatch.setattr(layers.jax, "default_backend", lambda: backend)
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, x_shape, jnp.float32)
  w = jax.random.normal(kw, w_shape, jnp.float32)
  want = jnp.einsum(spec, x, w, precision="highest")
  got = layers.project(spec, x, w, precision="highest")
  assert got.shape == want.shape
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_project_pads_only_single_rows_on_gpu(monkeypatch):
  seen = []
  real_einsum = jnp.einsum

  def spy(spec, x, w, **kwargs):
    seen.append(x.shape)
    return real_einsum(spec, x, w, **kwargs)

  monkeypatch.setattr(layers.jnp, "einsum", spy)
  monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(layers, "_SMALL_F32", {"implementation": "dot", "max_rows": 4})
  w = jnp.ones((8, 4))
  layers.project("BTD,DF->BTF", jnp.ones((1, 1, 8)), w)  # batch-1 decode: two rows
  layers.project("BTD,DF->BTF", jnp.ones((1, 3, 8)), w)  # verify: unchanged
  layers.project("BTD,DF->BTF", jnp.ones((2, 1, 8)), w)  # batch-2 decode: unchanged
  layers.project("D,DF->F", jnp.ones((8,)), w)  # no row axis: unchanged
  monkeypatch.setattr(layers.jax, "default_backend", lambda: "cpu")
  layers.project("BTD,DF->BTF", jnp.ones((1, 1, 8)), w)  # CPU: unchanged
  assert seen == [(2, 1, 8), (1, 3, 8), (2, 1, 8), (8,), (1, 1, 8)]


ROWS_SPECS = [  # multi-row shapes of the same specs
    ("BTD,DNH->BTNH", (2, 3, 8), (8, 2, 4)),
    ("BTE,ED->BTD", (1, 5, 8), (8, 6)),
    ("BTD,DF->BTF", (4, 1, 8), (8, 16)),
    ("...D,VD->...V", (3, 2, 8), (32, 8)),
    ("...D,DV->...V", (5, 8), (8, 32)),
]


@pytest.mark.parametrize("form", ["middle", "rows", "leading"])
@pytest.mark.parametrize("spec,x_shape,w_shape", ROWS_SPECS + SPECS)
def test_rows_reduce_matches_einsum(spec, x_shape, w_shape, form):
  kx, kw = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, x_shape, jnp.float32)
  w = jax.random.normal(kw, w_shape, jnp.float32)
  want = jnp.einsum(spec, x, w, precision="highest")
  got = layers.rows_reduce(spec, x, w, form)
  assert got.shape == want.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_rows_reduce_rejects_other_specs():
  with pytest.raises(ValueError, match="spec='BTD,DF->BFT'"):
    layers.rows_reduce("BTD,DF->BFT", jnp.ones((1, 1, 8)), jnp.ones((8, 4)))
  with pytest.raises(ValueError, match="form='columns' must be"):
    layers.rows_reduce("BTD,DF->BTF", jnp.ones((1, 1, 8)), jnp.ones((8, 4)), "columns")


def test_project_row_reduce_only_for_small_full_f32_on_gpu(monkeypatch):
  used = []
  real = layers.rows_reduce
  monkeypatch.setattr(layers, "rows_reduce", lambda *a: used.append(a[1].shape) or real(*a))
  monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
  w = jnp.ones((8, 4))
  x = jnp.ones((1, 4, 8))
  layers.project("BTD,DF->BTF", x, w, precision="highest")  # full f32, 4 rows: reduce
  with jax.default_matmul_precision("float32"):
    layers.project("BTD,DF->BTF", x, w)  # from the context: reduce
  with jax.default_matmul_precision("default"):
    layers.project("BTD,DF->BTF", x, w)  # JAX's default precision: a dot
  layers.project("BTD,DF->BTF", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                 precision="highest")  # bf16: a dot
  layers.project("BTD,DF->BTF", jnp.ones((1, 5, 8)), w, precision="highest")  # 5 rows
  layers.project("BTD,DF->BTF", x, jnp.ones((8, (1 << 19) + 1)), precision="highest")  # big w
  monkeypatch.setattr(layers.jax, "default_backend", lambda: "cpu")
  layers.project("BTD,DF->BTF", x, w, precision="highest")  # CPU: a dot
  assert used == [(1, 4, 8), (1, 4, 8)]
  monkeypatch.setattr(layers, "_SMALL_F32", {"implementation": "reduce", "max_rows": 4})
  layers.set_small_f32_matmul(max_rows=0)
  monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
  layers.project("BTD,DF->BTF", x, w, precision="highest")  # off
  assert len(used) == 2 and layers.small_f32_matmul() == ("reduce", 0)
  with pytest.raises(ValueError, match="max_rows=-1"):
    layers.set_small_f32_matmul(max_rows=-1)
  with pytest.raises(ValueError, match="implementation='cublas' must be one of"):
    layers.set_small_f32_matmul("cublas")
  with pytest.raises(ValueError, match="max_rows=17"):
    layers.set_small_f32_matmul("pallas_triton", 17)


def test_project_pallas_small_matmul_matches_einsum(monkeypatch):
  """The Pallas Triton path of ``project`` (interpret mode here) equals the einsum."""
  from pallas_kernels import small_matmul as sm  # noqa: PLC0415

  real = sm.small_matmul
  monkeypatch.setattr(sm, "small_matmul", lambda x, w, **kw: real(x, w, **kw, interpret=True))
  monkeypatch.setattr(layers, "_SMALL_F32", {"implementation": "pallas_triton", "max_rows": 16})
  monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
  for spec, x_shape, w_shape in [("BTD,DNH->BTNH", (1, 5, 64), (64, 2, 16)),
                                 ("BTE,ED->BTD", (4, 1, 32), (32, 48)),
                                 ("BTD,DF->BTF", (1, 1, 24), (24, 16))]:  # D=24: XLA's dot
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, x_shape, jnp.float32)
    w = jax.random.normal(kw, w_shape, jnp.float32)
    want = jnp.einsum(spec, x, w, precision="highest")
    got = layers.project(spec, x, w, precision="highest")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert "pallas_triton" in sm.implementations_used() and "reference" in sm.implementations_used()


def test_project_passes_the_reduce_form_of_the_implementation(monkeypatch):
  forms = []
  real = layers.rows_reduce
  monkeypatch.setattr(layers, "rows_reduce", lambda *a: forms.append(a[3]) or real(*a))
  monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(layers, "_SMALL_F32", {"implementation": "reduce", "max_rows": 4})
  x, w = jnp.ones((1, 4, 8)), jnp.ones((8, 4))
  for impl in ("reduce", "reduce_rows", "reduce_leading"):
    layers.set_small_f32_matmul(impl)
    got = layers.project("BTD,DF->BTF", x, w, precision="highest")
    np.testing.assert_allclose(np.asarray(got), 8.0)
  assert forms == ["middle", "rows", "leading"]
