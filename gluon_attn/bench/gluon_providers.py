"""Registers the project's Gluon attention kernels as benchmark providers (none yet)."""
