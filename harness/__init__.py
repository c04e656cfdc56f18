"""Measurements composed from models, methods and the runtime: evaluation and divergence."""
