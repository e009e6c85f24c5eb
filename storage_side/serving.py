"""The waitress server the daemon runs by default, with its protocol errors answered as JSON.

waitress's event loop reads a request's line, headers and body into buffers before a
worker thread sees it, so a client that connects and sends slowly (or nothing) holds a
socket, never one of the threads; idle connections are closed after the client timeout.
Requests that fail at the protocol level (headers over the limit, a malformed request
line, a body over the limit) never reach Flask: waitress answers them itself, in plain
text unless told otherwise, so its error task is replaced by one that writes the same
``{"error", "message"}`` body as every other error of the daemon.
"""

from __future__ import annotations

import json

from flask import Flask
from waitress.channel import HTTPChannel
from waitress.server import BaseWSGIServer, create_server
from waitress.task import ErrorTask

from storage_side.config import DaemonConfig

SERVER_IDENT = "hapi-storage"


class JsonErrorTask(ErrorTask):
    def execute(self) -> None:
        error = self.request.error
        code = "request_too_large" if error.code == 413 else error.reason.lower().replace(" ", "_")
        body = json.dumps({"error": code, "message": f"{error.reason}: {error.body}"}).encode()
        self.status = f"{error.code} {error.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


class JsonErrorChannel(HTTPChannel):
    error_task_class = JsonErrorTask


def waitress_server(app: Flask, config: DaemonConfig) -> BaseWSGIServer:
    """A bound, not yet running, waitress server for ``app`` (call ``.run()``)."""
    server = create_server(
        app, host=config.host, port=config.port, threads=config.server_threads, ident=SERVER_IDENT,
        connection_limit=config.max_connections,
        channel_timeout=config.client_timeout_s,
        cleanup_interval=max(1, int(config.client_timeout_s / 4)),  # how often idle channels are closed
        max_request_header_size=config.max_request_header_bytes,
        max_request_body_size=config.max_request_bytes,
        asyncore_use_poll=True,  # select() cannot watch file descriptors past 1024
    )
    server.channel_class = JsonErrorChannel
    return server
