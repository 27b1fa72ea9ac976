"""Stage 1: walk a repository, parse each file once, run every detector, assess and report.

Entry points: :func:`npufuse.scan.engine.scan_repo` (library) and ``npufuse scan`` (CLI,
:mod:`npufuse.scan.command`). Nothing in this package imports torch: scanning must stay fast.
"""
