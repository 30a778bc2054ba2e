"""The terminal view of a status snapshot (rich): one screen, printed once or refreshed live.

Job: lay out the snapshot of `snapshot.py`, as `schema.check` returned it (plus the `liveness` that `command.py` adds),
with the same words as the JSON keys: queue_depth by state, staleness histograms, per
fleet / per server version, in_flight, tokens/s, arena_waits and health, trainer step and version,
last publish, the latest step's training-inference mismatch (one `mismatch` line), the data plane's
back-pressure (arena_waits, undelivered_frees), drops by cause, rates, idle ratios and heartbeat ages. Boundary: display
only; it computes nothing that is not in the snapshot except ages relative to now.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

_STYLE = {"running": "green", "starting": "cyan", "finished": "blue", "failed": "red", "dead": "bold red", "stalled": "yellow",
          "interrupted": "yellow"}


def _change(event: dict[str, Any]) -> str:
    """One fleet change for the status view: kind, server, how it joined, where a start's seconds went."""
    out = f"{event['kind']} {event['server']}".strip() + (f" ({event['via']})" if event.get("via") else "")
    split = event.get("startup")
    if split:
        parts = ", ".join(f"{k[:-2]} {split[k]:.1f}" for k in ("placement_s", "queued_s", "imports_s", "build_s") if k in split)
        out += f" (up in {split.get('total_s', 0.0) + split.get('placement_s', 0.0):.1f} s: {parts})"
    return out


def _hist(h: dict[str, int]) -> str:
    if not h:
        return "-"
    total = sum(h.values())
    return "  ".join(f"{k}:{v} ({100 * v / total:.0f}%)" for k, v in h.items())


def _ago(t: float | None, now: float) -> str:
    return "never" if not t else f"{now - t:.1f} s ago"


class _PlainTable(Table):
    """A table whose string cells are plain text, never rich markup (a snapshot's strings are the run's,
    or whoever wrote its status file or Redis key)."""

    def add_row(self, *cells: Any, **kw: Any) -> None:  # type: ignore[override]
        super().add_row(*(Text(c) if isinstance(c, str) else c for c in cells), **kw)


def _table(title: str, *columns: str) -> Table:
    t = _PlainTable(title=title, title_justify="left", title_style="bold", box=None, padding=(0, 2, 0, 0), show_edge=False)
    for c in columns:
        t.add_column(c, justify="right" if c not in ("fleet", "server", "health", "view", "histogram (staleness:count)",
                                                              "size over time", "latest changes") else "left")
    return t


def render(snap: dict[str, Any], now: float | None = None) -> Group:
    now = time.time() if now is None else now
    live = snap.get("liveness", {})
    run, tr = snap.get("run", {}), snap.get("trainer", {})
    status = live.get("status", snap.get("state", "?"))
    head = Text()
    head.append(f"asyncrl status  {run.get('name', '?')}  ", style="bold")
    head.append(live.get("detail", status), style=_STYLE.get(status, ""))
    head.append(f"\nmode {run.get('mode')}  pid {run.get('pid')}@{run.get('host')}  heartbeat {live.get('heartbeat_age_s')} s ago"
                f"\nsource {snap.get('source', '-')}")
    parts: list[Any] = [head]
    dead = snap.get("shm_dead") or {}
    if dead.get("files"):
        parts.append(Text(f"shm: {dead['runs']} runs that are gone hold {dead['bytes'] / (1 << 20):.1f} MiB in {dead['dir']} "
                          f"({dead['removable_bytes'] / (1 << 20):.1f} MiB of it due: asyncrl status --gc)", style="yellow"))
    if "queue" not in snap:  # a lifecycle record only: the pipeline never reported
        parts.append(Text(f"step {tr.get('step', 0)}; no pipeline snapshot yet"))
        return Group(*parts)
    w, q, ro, st, rates = snap["weights"], snap["queue"], snap["rollout"], snap["staleness"], snap["rates"]

    t = _table("trainer", "step", "version", "last publish", "publish_s", "parity (max/tol)", "idle_ratio", "trained_samples",
               "rollout idle_ratio")
    t.add_row(f"{tr['step']}/{tr['total_steps']}", str(tr["version"]), _ago(w["last_publish_time"], now),
              f"{w['last_publish_s']:.3f}", _parity(w.get("parity_max_abs"), w.get("parity_tol")), f"{tr['idle_ratio']:.2f}",
              str(tr["trained_samples"]), f"{ro['idle_ratio']:.2f}")
    parts.append(t)

    t = _table(f"queue ({q['backend']}, consumer {q['consumer']})", "ready", "leased", "waiting", "acked",
               "resident/capacity", "complete_groups", "produced/s", "consumed/s")
    t.add_row(str(q["ready"]), str(q["leased"]), str(q["waiting"]), str(q["acked"]), f"{q['resident']}/{q['capacity']}",
              str(q["complete_groups"]), f"{rates['produced_per_s']:.2f}", f"{rates['consumed_per_s']:.2f}")
    parts.append(t)

    t = _table(f"staleness (eta {st['eta']})", "view", "histogram (staleness:count)")
    t.add_row("queue (at delivery)", _hist(st["queue"]))
    t.add_row("last batch", _hist(st["last_batch"]))
    t.add_row("trained (all)", _hist(st["trained"]))
    parts.append(t)
    if "mismatch" in snap:
        parts.append(_mismatch(snap["mismatch"]))

    t = _table("rollout fleets", "fleet", "server", "version", "in_flight", "tokens/s", "parity", "arena_waits", "health")
    for name, fleet in snap["fleets"].items():
        for s in fleet["servers"]:
            health = ("healthy" if s["healthy"] else "UNHEALTHY") + (" paused" if s.get("paused") else "")
            gap = s.get("parity_max_abs")
            parity = "-" if gap is None else f"{gap:.2g} @v{s.get('parity_version')}"
            t.add_row(name, str(s["name"]), str(s["version"]), str(s["in_flight"]), f"{s['tokens_per_s']:.1f}", parity,
                      _arena(s), health)
    parts.append(t)
    if "data_plane" in snap:
        parts.append(_data_plane(snap["data_plane"]))

    changes = [(name, f) for name, f in snap["fleets"].items() if f.get("events") or len(f.get("history", [])) > 1 or f.get("autoscale")]
    if changes:  # an elastic run: its size over time, and what changed it
        t = _table("fleet size and changes", "fleet", "size/target", "size over time", "latest changes")
        for name, f in changes:
            sizes = " -> ".join(f"{n} ({now - at:.0f} s ago)" for at, n in f.get("history", [])[-5:])
            latest = "; ".join(_change(e) for e in f.get("events", [])[-4:])
            t.add_row(name, f"{f.get('size', '-')}/{f.get('target', '-')}", sizes, latest or "-")
        parts.append(t)
        for name, f in changes:
            a = f.get("autoscale")
            if a and a.get("bottleneck") != "unknown":
                parts.append(Text.assemble(("autoscale ", "bold"), f"{name}: bottleneck {a['bottleneck']} (trainer idle "
                                           f"{a['trainer_idle']:.2f}, server slots idle {a['rollout_idle']:.2f}), "
                                           f"{a['servers']} servers in [{a['min']}, {a['max']}]"
                                           + (f"; measured: the trainer takes {a['trainer_tokens_per_s']:.0f} tok/s, a server at full "
                                              f"slots gives {a['server_tokens_per_s_full']:.0f}: {a['servers_for_trainer']} servers keep it fed"
                                              if a.get("servers_for_trainer") else "")))

    if snap.get("lengths"):  # do the drops skew what is trained? (asyncrl/lengths.py)
        t = _table("response lengths by fate", "fate", "samples", "mean", "p50", "p90", "max")
        for fate, row in snap["lengths"].items():
            t.add_row(fate, str(row["count"]), *(str(row.get(k, "-")) for k in ("mean", "p50", "p90", "max")))
        parts.append(t)

    drops = ", ".join(f"{k} {v}" for k, v in snap["drops"].items()) or "none"
    qdrops = ", ".join(f"{k} {v}" for k, v in q["drops"].items() if v) or "none"
    beats = "  ".join(f"{k} {v:.1f} s" for k, v in live.get("component_age_s", {}).items())
    parts.append(Text.assemble(("drops ", "bold"), f"groups: {drops}; queue records: {qdrops}   ",
                               ("groups ", "bold"), f"running {ro['running_groups']} accepted {ro['accepted_groups']}"
                               f" admission limit {ro.get('admission_limit', '-')} ({ro.get('admission', '-')})\n",
                               ("heartbeats ", "bold"), beats or "-"))
    if snap.get("error") and snap.get("state") != "interrupted":  # an interrupted run's line is the head's detail
        parts.append(Text(f"error: {snap['error']}", style="red"))
    return Group(*parts)


def _mismatch(m: dict[str, Any]) -> Text:
    """The latest step's training-inference mismatch in one line, e.g. `mismatch (step 12) logprob_gap mean 0.012 max
    0.41 · k3_seq mean 0.003 max 0.02 · masked 1.2% tokens 3.4% seqs · truncated 0% tokens · ess 0.97`."""
    def num(key: str) -> str:
        return f"{m[key]:.3g}" if key in m else "-"

    def pct(key: str) -> str:
        return f"{100 * m[key]:.3g}%" if key in m else "-"

    return Text.assemble((f"mismatch (step {m['step']}) ", "bold"),
                         f"logprob_gap mean {num('logprob_gap_mean')} max {num('logprob_gap_max')} · "
                         f"k3_seq mean {num('k3_seq_mean')} max {num('k3_seq_max')} · "
                         f"masked {pct('token_masked_share')} tokens {pct('seq_masked_share')} seqs · "
                         f"truncated {pct('token_truncated_share')} tokens · ess {num('ess')}")


def _arena(row: dict[str, Any]) -> str:
    """A data plane's arena waits: `-` (none, or not reported), else `3 (1.2 s)`, `WAITING` while one waits now."""
    waits, waiting = row.get("arena_waits", 0), row.get("arena_waiting", 0)
    if not waits:
        return "-"
    return f"{waits} ({row.get('arena_wait_s', 0.0):.1f} s)" + (f" {waiting} WAITING" if waiting else "")


def _data_plane(dp: dict[str, Any]) -> Text:
    """The controller's data plane: its arena's waits and, in red, the producers its frees do not reach."""
    out = Text.assemble(("data plane ", "bold"), f"(controller) arena_waits {_arena(dp)}; undelivered_frees ")
    rows = dp.get("undelivered_frees", [])
    if not rows:
        out.append("none")
    for i, r in enumerate(rows):
        out.append(("; " if i else "") + f"{r['endpoint']} ({r['producer'] or 'producer unknown'}) {r['frees']}", style="red")
    return out


def _parity(gap: float | None, tol: float | None) -> str:
    """The weight-parity probe's last figure against its tolerance: `off`, `-` (not yet checked), or `2e-07/0.01`."""
    if tol is None:
        return "off"
    return "-" if gap is None else f"{gap:.2g}/{tol:g}" + (" FAIL" if gap > tol else "")


def console() -> Console:
    """The terminal, or 110 columns when printing to a pipe or file (rich's default 80 wraps the tables)."""
    c = Console()
    return c if c.is_terminal else Console(width=110)


def checked(snap: dict[str, Any]) -> Group:
    """`render`, a snapshot of the wrong shape being `MalformedSnapshot` (one line), not a traceback."""
    from asyncrl.observe.snapshot import MALFORMED, MalformedSnapshot

    try:
        return render(snap)
    except MALFORMED as e:
        raise MalformedSnapshot(f"{snap.get('source', 'snapshot')}: of the wrong shape "
                                f"({type(e).__name__}: {str(e)[:200]})") from None


def show(snap: dict[str, Any]) -> None:
    console().print(checked(snap))


def watch(read: Callable[[], dict[str, Any]], *, interval_s: float = 1.0, prometheus_port: int | None = None,
          prometheus_host: str = "127.0.0.1") -> int:
    """Refresh the view every `interval_s` until Ctrl-C; a run that ends stays on screen with its end state.
    With `prometheus_port`, the latest snapshot's figures are served on `prometheus_host` (`prometheus.serve`)."""
    from asyncrl.observe.snapshot import RunNotFound

    latest: dict[str, Any] = {}
    server = None
    if prometheus_port is not None:
        from asyncrl.observe.prometheus import serve

        server = serve(prometheus_port, lambda: latest, host=prometheus_host)

    def frame() -> Any:
        try:
            snap = read()
        except RunNotFound as e:
            return Text(f"asyncrl status: {e}", style="yellow")
        latest.clear()
        latest.update(snap)
        try:
            return checked(snap)
        except RunNotFound as e:
            return Text(f"asyncrl status: {e}", style="yellow")

    try:
        with Live(frame(), auto_refresh=False, screen=False) as view:
            while True:
                time.sleep(interval_s)
                view.update(frame(), refresh=True)
    except KeyboardInterrupt:
        return 0
    finally:
        if server is not None:
            server.shutdown()
