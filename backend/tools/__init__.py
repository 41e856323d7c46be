"""Tool calling in the model family's own format: tool definitions and calls rendered into the prompt
(``prompt.py``), a grammar that forces a call when one is required (``grammar.py``), and a parser per family that
turns a reply back into text and calls (``parsers.py``). Used by the OpenAI-compatible API and the chat product."""
