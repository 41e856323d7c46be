"""Llama-family models over a paged KV pool: architecture spec, weights, forward, loading.

``model_load.load_model(folder, device, dtype)`` turns a resolved model folder (see ``loader.resolve_model``) into a
``LoadedModel`` that ``engine.model_runner.ModelRunner`` runs.

NOTE: this package's ``__init__`` imports nothing: ``loader`` (a model's folder, fingerprint and tokenizer files) must
load without torch, for a backend whose engine runs elsewhere (tests/backend/engine_client/test_no_torch.py).
``load_model`` lives in ``model_load``.
"""
