"""Gluon kernels of the package and what they share."""
