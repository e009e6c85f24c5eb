"""``python -m storage_side --store URL``: serve the storage daemon with a real WSGI server.

gunicorn (one process, gthread workers: the prefix cache and memory budget are per
process) where it runs; waitress, the portable fallback, elsewhere.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from flask import Flask

from storage_side.app import create_app
from storage_side.config import DaemonConfig


def parse_args(argv: list[str] | None) -> DaemonConfig:
    defaults = DaemonConfig(store_url="")
    p = argparse.ArgumentParser(prog="python -m storage_side", description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="s3://bucket/prefix or file:///path")
    p.add_argument("--endpoint-url", help="S3 endpoint of this node's store; default $AWS_ENDPOINT_URL")
    p.add_argument("--host", default=defaults.host)
    p.add_argument("--port", type=int, default=defaults.port)
    p.add_argument("--server", choices=("auto", "gunicorn", "waitress"), default=defaults.server)
    p.add_argument("--server-threads", type=int, default=defaults.server_threads)
    p.add_argument("--io-threads", type=int, default=defaults.io_threads)
    p.add_argument("--torch-threads", type=int, default=defaults.torch_threads)
    p.add_argument("--sub-batch", type=int, default=defaults.sub_batch)
    p.add_argument("--max-keys-per-request", type=int, default=defaults.max_keys_per_request)
    p.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes)
    p.add_argument("--model-cache-size", type=int, default=defaults.model_cache_size)
    p.add_argument("--weights-file", type=Path, action="append", default=[],
                   help="a state_dict file requests may use (named by its sha256); repeatable")
    a = p.parse_args(argv)
    for path in a.weights_file:
        if not path.is_file():
            p.error(f"--weights-file {path}: no such file")
    return DaemonConfig(
        store_url=a.store, endpoint_url=a.endpoint_url, host=a.host, port=a.port, server=a.server,
        server_threads=a.server_threads, io_threads=a.io_threads, torch_threads=a.torch_threads,
        sub_batch=a.sub_batch, max_keys_per_request=a.max_keys_per_request,
        max_request_bytes=a.max_request_bytes, model_cache_size=a.model_cache_size,
        weights_files=tuple(a.weights_file),
    )


def serve_gunicorn(app: Flask, config: DaemonConfig) -> None:
    from gunicorn.app.base import BaseApplication

    class Server(BaseApplication):
        def load_config(self) -> None:
            self.cfg.set("bind", f"{config.host}:{config.port}")
            self.cfg.set("workers", 1)
            self.cfg.set("worker_class", "gthread")
            self.cfg.set("threads", config.server_threads)
            self.cfg.set("timeout", 600)  # a large request on a slow CPU is not a hung worker
            self.cfg.set("accesslog", "-")

        def load(self) -> Flask:
            return app

    Server().run()


def serve_waitress(app: Flask, config: DaemonConfig) -> None:
    import waitress

    waitress.serve(app, host=config.host, port=config.port, threads=config.server_threads)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_args(argv)
    try:
        app = create_app(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = config.server
    if server == "auto":
        try:
            import fcntl  # noqa: F401  gunicorn needs a POSIX system

            import gunicorn  # noqa: F401

            server = "gunicorn"
        except ImportError:
            server = "waitress"
    logging.getLogger(__name__).info("serving %s on http://%s:%d with %s", config.store_url, config.host,
                                     config.port, server)
    (serve_gunicorn if server == "gunicorn" else serve_waitress)(app, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
