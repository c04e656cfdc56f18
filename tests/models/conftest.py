"""Model tests run in f32 with exact matmuls so 1e-4 tolerances are meaningful."""

import jax

jax.config.update("jax_default_matmul_precision", "highest")
