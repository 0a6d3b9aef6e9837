"""The engine session's plain Unix socket, which both sides import: where it is and how a frame
looks (the session itself is ``EngineService.Session``'s, proto/kvsidecar/v1/engine.proto).

``session_socket_for``: the engine socket's path + ``.session``, next to it and its credential
socket (``kvsidecar.engine_auth``), same directory and mode. A frame is a 4-byte big-endian length
and that many bytes of a serialized message: ``SessionCalls`` from the client, ``SessionAnswers``
from the sidecar, at most the sidecar's ``max_message_bytes``. The sidecar's first frame is an
empty ``SessionAnswers`` (the session is open; an empty one later means nothing), its last one has
``end`` set (how the session ended), then it closes the connection. The client half-closes
(``shutdown(SHUT_WR)``) to end the session after its calls in flight are answered.

Standard library and protobuf only; no state.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from google.protobuf.message import Message

SESSION_SUFFIX = ".session"
HEADER = struct.Struct(">I")


def session_socket_for(engine_socket: str | os.PathLike[str]) -> Path:
    """The plain socket that carries the engine session of ``engine_socket``'s sidecar."""
    return Path(f"{os.fspath(engine_socket)}{SESSION_SUFFIX}")


def frame(message: Message) -> bytes:
    """``message`` as one frame."""
    data = message.SerializeToString()
    return HEADER.pack(len(data)) + data
