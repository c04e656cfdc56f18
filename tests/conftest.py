"""Test-wide setup: f32 matmuls at highest precision so exact comparisons are meaningful."""

import jax

jax.config.update("jax_default_matmul_precision", "highest")
