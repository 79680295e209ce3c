"""Karotte: robust RL environments on a kernel-enforced Linux sandbox."""

__version__ = "0.1.0"
