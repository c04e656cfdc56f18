"""Speculative decoding methods as plugins of one interface (see ``methods.base``)."""
