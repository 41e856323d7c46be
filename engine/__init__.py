"""kvchat's inference engine: paged KV, exact prefix reuse, continuous batching, own Llama-family forward.

Import the facade from ``engine.llm_engine``; this package init stays import-light (no torch) so the pure-Python
cache logic can be used and tested without a model.
"""
