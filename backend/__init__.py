"""kvchat backend: FastAPI app, websocket chat, admin and OpenAI-compatible REST, sessions in the database."""
