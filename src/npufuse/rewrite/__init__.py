"""Rewrites: the guarded fused branch around the verbatim original (see codegen.py)."""
