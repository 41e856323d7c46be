"""The OpenAI-compatible chat-completions API (``/v1``): schemas, error mapping and the service behind the routes."""
