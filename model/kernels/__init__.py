"""Pallas kernels: one file per kernel."""
