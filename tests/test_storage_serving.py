"""The daemon as served (``python -m storage_side``): slow clients cannot starve others,
protocol errors are JSON, and it refuses to start in a way that would serve unauthenticated."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch

from compute_side.daemon_process import local_daemon
from experiments.attacks import LONG_URL, MANY_HEADERS, half_open_connections, healthz_s
from hapi.store import FileStore
from hapi.wire import TOKEN_ENV
from storage_side.__main__ import main, parse_args
from storage_side.config import DaemonConfig, resolve_device

TOKEN = "serving-test-token"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    store = FileStore(tmp_path_factory.mktemp("store"))
    store.put("x.jpg", b"not read in these tests")
    log = tmp_path_factory.mktemp("logs") / "daemon.log"
    args = ("--memory-budget", "3GiB", "--client-timeout", "5")
    with local_daemon(store.url, log, extra_args=args, env={TOKEN_ENV: TOKEN}) as url:
        yield url


@pytest.mark.parametrize("clients", [40, 200])
def test_half_open_connections_do_not_starve_healthz(daemon: str, clients: int) -> None:
    port = int(daemon.rsplit(":", 1)[1])
    with half_open_connections(port, clients):
        time.sleep(0.2)
        latencies = [healthz_s(daemon) for _ in range(5)]
        print(f"{clients} half-open connections: /healthz in {max(latencies) * 1e3:.0f} ms at worst")
        assert max(latencies) < 1.0


def test_a_slow_body_holds_no_thread(daemon: str) -> None:
    port = int(daemon.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /v1/extract HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n{")
        assert healthz_s(daemon) < 1.0


@pytest.mark.parametrize("path, headers, status", [
    (*LONG_URL, 431),
    (*MANY_HEADERS, 431),
    ("/healthz", {f"X-{i}": "v" for i in range(500)}, 200),
])
def test_protocol_errors_are_json(daemon: str, path: str, headers: dict, status: int) -> None:
    response = requests.get(daemon + path, headers=headers, timeout=10)
    assert response.status_code == status
    assert response.headers["Content-Type"].startswith("application/json")
    if status != 200:
        assert response.json()["error"] == "request_header_fields_too_large"


def test_a_body_over_the_limit_is_refused_as_json_before_it_is_read(daemon: str) -> None:
    response = requests.post(daemon + "/v1/extract", data=b"{" + b" " * (2 << 20) + b"}", timeout=10,
                             headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"] == "request_too_large"


# --- auth that fails closed, at startup ------------------------------------------------


def test_an_empty_or_blank_token_file_is_an_error(tmp_path: Path, capsys) -> None:
    for text in ("", "  \n\t\n"):
        token_file = tmp_path / "token"
        token_file.write_text(text)
        with pytest.raises(SystemExit):
            parse_args(["--store", "file:///tmp", "--token-file", str(token_file)])
        assert "empty or blank" in capsys.readouterr().err


def test_a_blank_token_variable_is_an_error(monkeypatch, capsys) -> None:
    monkeypatch.setenv(TOKEN_ENV, " ")
    with pytest.raises(SystemExit):
        parse_args(["--store", "file:///tmp"])
    assert "blank" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "storage.example"])
def test_a_non_loopback_bind_without_a_token_needs_insecure(host: str, monkeypatch, capsys) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--store", "file:///tmp", "--host", host])
    assert "--insecure" in capsys.readouterr().err
    assert parse_args(["--store", "file:///tmp", "--host", host, "--insecure"]).insecure
    monkeypatch.setenv(TOKEN_ENV, "secret")
    assert parse_args(["--store", "file:///tmp", "--host", host]).token == "secret"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_binds_need_no_token(host: str, monkeypatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert parse_args(["--store", "file:///tmp", "--host", host]).token is None


@pytest.mark.parametrize("prefix", ["../x", "/abs", "a//b", "./a"])
def test_a_dataset_prefix_must_be_plain(prefix: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--store", "file:///tmp", "--dataset-prefix", prefix])
    assert "dataset prefix" in capsys.readouterr().err


# --- the device the prefix runs on -------------------------------------------------------


def test_the_prefix_runs_on_the_cpu_unless_asked() -> None:
    assert parse_args(["--store", "file:///tmp"]).device == DaemonConfig(store_url="").device == "cpu"
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_is_cuda_where_there_is_one_else_the_cpu() -> None:
    assert parse_args(["--store", "file:///tmp", "--device", "auto"]).device == "auto"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("device, words", [("tpu", "expected auto, cpu, cuda or cuda:N"),
                                           ("cuda:x", "expected auto, cpu, cuda or cuda:N")])
def test_a_device_that_is_no_device_is_a_usage_error(device: str, words: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--store", "file:///tmp", "--device", device])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_asking_for_a_gpu_on_a_host_without_one_is_one_line_and_status_2(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--store", "file:///tmp", "--device", "cuda"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m storage_side: error: --device cuda: this host has no CUDA device")
