"""``python -m storage_side --store URL``: serve the storage daemon with a real WSGI server.

waitress by default: its event loop reads each request whole (up to the header and body
limits, under a timeout) before a worker thread runs it, so slow or stalled clients hold
no thread, and its own protocol errors (431, 400) are answered as JSON like the app's.
gunicorn (one process, gthread: the prefix cache and memory budget are per process) on
request. Every option is a field of ``storage_side.config.DaemonConfig``, documented there.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from flask import Flask

from hapi.wire import TOKEN_ENV
from storage_side.app import create_app
from storage_side.config import DaemonConfig, option_help, parse_size, resolve_device
from storage_side.memory import keep_freed_memory_within
from storage_side.parallel import pin_cores


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None) -> DaemonConfig:
    d = DaemonConfig(store_url="")
    p = argparse.ArgumentParser(prog="python -m storage_side", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def add(flag: str, name: str, **kwargs: object) -> None:
        p.add_argument(flag, dest=name, help=option_help(name), **kwargs)

    add("--store", "store_url", required=True)
    add("--dataset-prefix", "dataset_prefixes", action="append", default=[])
    add("--endpoint-url", "endpoint_url")
    add("--host", "host", default=d.host)
    add("--port", "port", type=int, default=d.port)
    add("--insecure", "insecure", action="store_true", default=d.insecure)
    add("--server", "server", choices=("auto", "gunicorn", "waitress"), default=d.server)
    add("--server-threads", "server_threads", type=int, default=d.server_threads)
    add("--max-connections", "max_connections", type=int, default=d.max_connections)
    add("--client-timeout", "client_timeout_s", type=float, default=d.client_timeout_s)
    add("--io-threads", "io_threads", type=int, default=d.io_threads)
    add("--cores", "cores", type=int, default=d.cores)
    add("--decode-workers", "decode_workers", type=int, default=d.decode_workers)
    add("--torch-threads", "torch_threads", type=int, default=d.torch_threads)
    add("--state-dir", "state_dir", type=Path, default=d.state_dir)
    add("--compute-dtype", "compute_dtype", choices=("float32", "bfloat16"), default=d.compute_dtype)
    add("--device", "device", default=d.device)
    add("--memory-budget", "memory_budget", type=_size, default=d.memory_budget)
    add("--gpu-memory-budget", "gpu_memory_budget", type=_size, default=d.gpu_memory_budget)
    add("--memory-headroom", "memory_headroom", type=float, default=d.memory_headroom)
    add("--max-sub-batch", "max_sub_batch", type=int, default=d.max_sub_batch)
    add("--min-sub-batch", "min_sub_batch", type=int, default=d.min_sub_batch)
    add("--adapt", "adapt", action=argparse.BooleanOptionalAction, default=d.adapt)
    add("--max-running", "max_running", type=int, default=d.max_running)
    add("--max-queue", "max_queue", type=int, default=d.max_queue)
    add("--queue-timeout", "queue_timeout_s", type=float, default=d.queue_timeout_s)
    add("--max-keys-per-request", "max_keys_per_request", type=int, default=d.max_keys_per_request)
    add("--max-request-bytes", "max_request_bytes", type=_size, default=d.max_request_bytes)
    add("--max-request-header-bytes", "max_request_header_bytes", type=_size, default=d.max_request_header_bytes)
    add("--max-image-pixels", "max_image_pixels", type=int, default=d.max_image_pixels)
    add("--max-object-bytes", "max_object_bytes", type=_size, default=d.max_object_bytes)
    add("--log-format", "log_format", choices=("text", "json"), default=d.log_format)
    add("--weights-file", "weights_files", type=Path, action="append", default=[])
    p.add_argument("--token-file", type=Path,
                   help=f"a file holding the bearer token (else ${TOKEN_ENV}). " + option_help("token"))
    a = vars(p.parse_args(argv))
    try:
        resolve_device(a["device"])  # checked now: a host without the GPU asked for is a usage error
    except ValueError as exc:
        p.error(str(exc))
    for path in a["weights_files"]:
        if not path.is_file():
            p.error(f"--weights-file {path}: no such file")
    token_file = a.pop("token_file")
    if token_file is not None:
        try:
            a["token"] = token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            p.error(f"--token-file {token_file}: {getattr(exc, 'strerror', None) or exc}")
        if not a["token"]:
            p.error(f"--token-file {token_file} is empty or blank: put the shared secret in it")
    else:
        # Set but blank is a mistake, not a wish for no authentication: DaemonConfig refuses it.
        a["token"] = os.environ.get(TOKEN_ENV)
        if a["token"] is not None and not a["token"].strip():
            p.error(f"${TOKEN_ENV} is set but blank: set the shared secret, or unset it on a loopback --host")
    a["weights_files"] = tuple(a["weights_files"])
    a["dataset_prefixes"] = tuple(a["dataset_prefixes"])
    try:
        return DaemonConfig(**a)
    except ValueError as exc:
        p.error(str(exc))


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a record's ``extra={"fields": {...}}`` become its keys."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                "message": record.getMessage(), **getattr(record, "fields", {})}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """Plain lines; a record's fields follow its message as key=value."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        return line + "".join(f" {k}={v}" for k, v in fields.items()) if fields else line


def setup_logging(log_format: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else TextFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


def serve_gunicorn(app: Flask, config: DaemonConfig) -> None:
    from gunicorn.app.base import BaseApplication

    # gunicorn serves from a worker it forks from this process, and a fork takes no threads
    # or child processes along: the decoders stop here and start again in that worker.
    decoder = app.extensions["hapi"]["decoder"]
    decoder.close()

    class Server(BaseApplication):
        def load_config(self) -> None:
            self.cfg.set("bind", f"{config.host}:{config.port}")
            self.cfg.set("workers", 1)
            self.cfg.set("worker_class", "gthread")
            self.cfg.set("threads", config.server_threads)
            self.cfg.set("timeout", 600)  # a large request on a slow CPU is not a hung worker
            self.cfg.set("accesslog", "-")
            self.cfg.set("worker_connections", config.max_connections)
            self.cfg.set("keepalive", int(config.client_timeout_s))
            # gunicorn's default control socket is one path per user, shared by every daemon of
            # that user; this daemon needs none (SIGTERM stops it), so it opens none.
            self.cfg.set("control_socket_disable", True)
            self.cfg.set("post_worker_init", lambda worker: decoder.start())

        def load(self) -> Flask:
            return app

    Server().run()


def serve_waitress(app: Flask, config: DaemonConfig) -> None:
    from storage_side.serving import waitress_server

    waitress_server(app, config).run()


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    setup_logging(config.log_format)
    try:
        # Before anything starts a thread or a worker: they all inherit the cores.
        cores = pin_cores(config.cores)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info("running on cores %s", ",".join(map(str, cores)))
    # Only in the daemon's own process: it changes how the whole process allocates. The
    # freed memory kept for the next passes is the budget's headroom, which no request reserves.
    if not keep_freed_memory_within(config.headroom_bytes(), config.compute_slots()):
        logging.getLogger(__name__).warning("not glibc: resident memory may exceed what the budget counts")
    if config.insecure and not config.token:
        logging.getLogger(__name__).warning("--insecure: serving %s:%d without a token, to anyone who reaches it",
                                            config.host, config.port)
    try:
        app = create_app(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = "waitress" if config.server == "auto" else config.server
    logging.getLogger(__name__).info("serving %s on http://%s:%d with %s", config.store_url, config.host,
                                     config.port, server)
    (serve_gunicorn if server == "gunicorn" else serve_waitress)(app, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
