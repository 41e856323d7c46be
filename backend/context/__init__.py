"""The context layer: semantic blocks, rules that find them, and topic epochs with their semantic temperature.

Pure Python (no database, no engine): the splitter takes a token-counting callable, the topic tracker a similarity
backend, so both are testable from plain strings. Storage lives in ``backend/services/context_store.py``.
"""
