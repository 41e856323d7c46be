"""``kvchat engine-serve``: the engine alone (no chat database) behind an OpenAI-compatible HTTP API, so the backend can
run its inference on replicas (``backend/engine_client/remote.py``) behind vllm-router (docs/scale-out.md)."""
