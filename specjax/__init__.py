"""specjax: speculative decoding, run and measured under one JAX runtime."""
