"""Draft-head training: data (``data``), the optax loop (``trainer``), the job (``pipeline``)."""
