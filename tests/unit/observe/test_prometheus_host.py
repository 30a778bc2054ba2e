"""`asyncrl status --watch --prometheus PORT --prometheus-host HOST`: the gauges are served on the address given
(127.0.0.1 unless told; a pod gives its own, deploy/kuberay/status-service.yaml), never on a wildcard."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from asyncrl.observe import prometheus
from asyncrl.observe.command import judge, parse
from tests.unit.observe.test_command import _snap

OTHER = "127.0.0.2"
"""A second loopback address (Linux routes all of 127.0.0.0/8 to lo): bound, it is not 127.0.0.1."""


def _get(host: str, port: int) -> str:
    return urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()


def _refused(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) != 0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.mark.timeout(30)
def test_serve_binds_loopback_by_default_and_the_host_it_is_given(tmp_path):
    snap = _snap(tmp_path)
    snap["liveness"] = judge(snap)
    want = prometheus.render(snap)
    default = prometheus.serve(0, lambda: snap)
    other = prometheus.serve(0, lambda: snap, host=OTHER)
    try:
        assert default.server_address[0] == "127.0.0.1" and other.server_address[0] == OTHER
        port = other.server_address[1]
        assert _get(OTHER, port) == want and 'asyncrl_queue_depth{state="ready"} 8.0' in want
        assert _refused("127.0.0.1", port)  # bound to the one address given, not to every one
        assert _get("127.0.0.1", default.server_address[1]) == want
    finally:
        default.shutdown()
        other.shutdown()
    for wildcard in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="never binds every interface"):
            prometheus.serve(0, lambda: snap, host=wildcard)


def test_the_option_is_checked_where_the_command_is_parsed(capsys):
    assert parse(["--watch", "--prometheus", "9464"]).prometheus_host == "127.0.0.1"
    assert parse(["--watch", "--prometheus", "9464", "--prometheus-host", "127.0.0.0/8"]).prometheus_host == "127.0.0.1"
    assert parse(["--watch", "--prometheus", "9464", "--prometheus-host", "iface:lo"]).prometheus_host == "127.0.0.1"
    for argv in (["--watch", "--prometheus", "9464", "--prometheus-host", "0.0.0.0"],
                 ["--watch", "--prometheus", "9464", "--prometheus-host", "iface:no-such-nic"],
                 ["--watch", "--prometheus-host", OTHER]):  # without --prometheus it would bind nothing
        with pytest.raises(SystemExit) as e:
            parse(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "never binds every interface" in err and "no interface 'no-such-nic'" in err
    assert "--prometheus-host needs --prometheus" in err


@pytest.mark.timeout(60)
def test_the_watching_command_serves_the_runs_gauges_on_the_host_given(tmp_path):
    """The real command in its own process, with no terminal (as in a pod): it serves the figures of the run it
    watches on HOST:PORT only, and leaves on SIGINT."""
    (tmp_path / "status.json").write_text(json.dumps(_snap(tmp_path)))
    port = _free_port(OTHER)
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "status", "--run", str(tmp_path), "--watch", "--interval", "0.2",
                             "--prometheus", str(port), "--prometheus-host", OTHER],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, body = time.time() + 30, ""
        while time.time() < deadline and "asyncrl_up" not in body:
            try:
                body = _get(OTHER, port)
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.2)
        assert 'asyncrl_queue_depth{state="ready"} 8.0' in body and "asyncrl_up 1.0" in body, body[-2000:]
        assert 'asyncrl_server_healthy{fleet="default",server="server-1"} 0.0' in body
        assert _refused("127.0.0.1", port)
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]
