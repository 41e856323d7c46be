"""What a remote engine adds to the engine's errors (``engine/errors.py``), as subclasses the backend already maps:

EngineStopped
└── EngineUnreachable    a replica (or the router) refused the connection, timed out, or closed the stream
                         mid-reply: the chat layer's ``unavailable`` error frame, OpenAI's 503
RequestFailed
└── EngineProtocolError  a replica answered something that is not an engine's answer (another server, a broken
                         proxy): ``engine_error``
ModelLoadError
└── EngineMismatch       the replica serves another model than the backend tokenizes for: refused at start
"""

from __future__ import annotations

from engine.errors import EngineStopped, ModelLoadError, RequestFailed


class EngineUnreachable(EngineStopped):
    pass


class EngineProtocolError(RequestFailed):
    pass


class EngineMismatch(ModelLoadError):
    pass
