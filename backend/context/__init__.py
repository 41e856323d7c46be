"""The context layer: semantic blocks, rules that find them, and topic epochs with their semantic temperature.

Pure Python (no database, no engine): the splitter takes a token-counting callable, the topic tracker a scorer
(``scorers.py``: the topic-shift classifier by default), so both are testable from plain strings. Storage lives in
``backend/services/context_store.py``.
"""
