"""Fusion patterns: one file per pattern id (see ``base.py`` for the contract)."""
