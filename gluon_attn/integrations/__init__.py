"""Adapters that plug gluon-attn into other libraries (each imports its library lazily; none is required)."""
