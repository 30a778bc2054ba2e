"""The figures of a status snapshot as Prometheus text (exposition format 0.0.4).

Job: turn one snapshot (with `liveness`) into gauges named like its JSON keys
(`asyncrl_queue_depth{state="ready"}`, `asyncrl_staleness{view="queue",staleness="1"}`, ...)
and serve them on 127.0.0.1 from `asyncrl status --watch --prometheus PORT`.
Boundary: no Prometheus client library; the watcher's latest snapshot is the only input.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


def _line(name: str, value: Any, **labels: Any) -> str:
    lab = ",".join(f'{k}="{str(v)}"' for k, v in labels.items())
    return f"asyncrl_{name}{{{lab}}} {float(value or 0)}" if lab else f"asyncrl_{name} {float(value or 0)}"


def render(snap: dict[str, Any]) -> str:
    if "queue" not in snap:
        return _line("up", snap.get("liveness", {}).get("alive", False)) + "\n"
    q, tr, w, st, ro = snap["queue"], snap["trainer"], snap["weights"], snap["staleness"], snap["rollout"]
    out = [_line("up", snap["liveness"]["alive"]), _line("trainer_step", tr["step"]), _line("version", tr["version"]),
           _line("weights_last_publish_s", w["last_publish_s"]), _line("weights_last_publish_time", w["last_publish_time"]),
           _line("queue_capacity", q["capacity"]), _line("queue_resident", q["resident"]),
           _line("queue_complete_groups", q["complete_groups"]),
           _line("idle_ratio", tr["idle_ratio"], component="trainer"), _line("idle_ratio", ro["idle_ratio"], component="rollout")]
    out += [_line("queue_depth", q[s], state=s) for s in ("ready", "leased", "waiting", "acked")]
    for view in ("queue", "last_batch", "trained"):
        out += [_line("staleness", v, view=view, staleness=k) for k, v in st[view].items()]
    out += [_line("drops", v, cause=k, unit="groups") for k, v in snap["drops"].items()]
    out += [_line("drops", v, cause=k, unit="records") for k, v in q["drops"].items()]
    out += [_line("rate", v, kind=k) for k, v in snap["rates"].items()]
    for fleet, f in snap["fleets"].items():
        for s in f["servers"]:
            for key in ("version", "in_flight", "tokens_per_s", "healthy"):
                out.append(_line(f"server_{key}", s[key], fleet=fleet, server=s["name"]))
    out += [_line("heartbeat_age_s", v, component=k) for k, v in snap["liveness"]["component_age_s"].items()]
    return "\n".join(out) + "\n"


def serve(port: int, latest: Callable[[], dict[str, Any]]) -> ThreadingHTTPServer:
    """Serve `render(latest())` at http://127.0.0.1:PORT/metrics in a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = render(latest()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, name="status-prometheus", daemon=True).start()
    return server
