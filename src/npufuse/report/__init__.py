"""Renderers over plain data: the scan report (markdown.py) and the validation report (html)."""
