"""kvchat's workload benchmark: realistic customer-service sessions replayed against kvchat and its peers.

Reproduce the standard set:  .venv/bin/python -m bench.run --standard   (``make bench`` runs it too)

``bench.workload`` turns the datasets into sessions and per-turn prompts, ``bench.runners`` drives one system each,
``bench.metrics`` summarises what was measured, and ``bench.run`` is the program that ties them together and writes
``docs/benchmarks/workload.{json,md}`` and the plots.
"""
