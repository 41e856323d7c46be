"""The backend's one interface to an inference engine (``protocol.py``) and the plain values it speaks in
(``values.py``). The rest of the backend imports engine types from here only (``lint-imports`` holds it to that)."""
