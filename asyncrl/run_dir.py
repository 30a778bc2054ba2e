"""The run directory: resolved config, metrics, generations, checkpoints, summary and the reward curve.

Layout of `<logging.run_root>/<run name>/`:
    config.yaml            the resolved config (every key)
    metrics.jsonl          one line per logged step (also in MLflow)
    trained_uids.jsonl     audit: the trajectory uids trained at each step
    checkpoints/step_NNNNNN/{trainer/, state.json}
    summary.json           written at the end of the run (one that stopped: state, steps, error, resume_command; error.log: its traceback)
    generations.jsonl      evaluated samples: prompt as rendered, response, reward, version (`logging.num_generations` per evaluation)
    reward_curve.png       over steps: training and held-out reward, response length, staleness
    status.json            heartbeat: pid, state (running / finished / failed), step, time
    queue_run_id           the run's queue namespace (`queue.run_id`), kept so that a resume finds its own

Private: `resolve_run_dir` makes the directory 0700 and the process umask 077, so everything the run
writes there (weights, generations, config) is its user's only; `logging.shared_group` makes them
02750 / umask 027 with that group instead (members read, nobody else).
"""

from __future__ import annotations

import grp
import json
import os
import re
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import Any

from asyncrl.config import Config, ConfigError


def resolve_run_dir(cfg: Config) -> Path:
    """The run's directory (found again on resume), made private (`make_private`), `cfg.queue.run_id`
    set to the run's own queue namespace when left at its default (`assign_queue_run_id`), and a durable
    queue's record key (`assign_record_key`)."""
    d = _find_run_dir(cfg)
    make_private(d, cfg.logging.shared_group)
    assign_queue_run_id(cfg, d)
    assign_record_key(cfg, d)
    return d


def _find_run_dir(cfg: Config) -> Path:
    root = Path(cfg.logging.run_root)
    if cfg.resume:
        if cfg.logging.run_name:
            d = root / cfg.logging.run_name
            if not os.path.lexists(d):
                raise ConfigError(f"resume: run directory {str(d)!r} does not exist (logging.run_name)")
            check_own_dir(d, "logging.run_name")
            return d
        runs = sorted((p for p in root.glob("*") if _own_dir(p) and (p / "checkpoints").is_dir()),
                      key=lambda p: p.stat().st_mtime)  # another user's runs are never resumed, however new
        if not runs:
            raise ConfigError(f"resume: no run of yours with checkpoints under {str(root)!r} (set logging.run_name)")
        return runs[-1]
    name = cfg.logging.run_name or f"{cfg.trainer.mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    d = root / name
    d.parent.mkdir(parents=True, exist_ok=True)  # the runs root (and a name's folders: logging.run_name=exp/r1)
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        check_own_dir(d, "logging.run_name")  # there before this run: used only if it is this user's own
    if (d / "checkpoints").is_dir() and any((d / "checkpoints").iterdir()):
        raise ConfigError(f"logging.run_name: {str(d)!r} already holds checkpoints; pass resume=true or another name")
    return d


def _not_own(st: os.stat_result) -> str:
    """Why a file (its `lstat`) is not this user's alone: a link, another owner, writable by others; '' if it is."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if st.st_uid != os.getuid():
        return f"owned by {_user(st.st_uid)}"
    return f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})" if st.st_mode & 0o022 else ""


def _own_dir(p: Path) -> bool:
    """Whether `p` is a directory (not a link to one) of this user that no one else may write."""
    try:
        st = os.lstat(p)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and not _not_own(st)


def check_own_dir(p: Path, key: str) -> None:
    """A run directory that was there before this run is used only if it is a directory (not a link), this
    user's, and writable by no one else (else whoever could write it may have planted links the run would
    write through); anything else is one line naming the path, its owner and the key."""
    st = os.lstat(p)
    what = _not_own(st) or ("" if stat.S_ISDIR(st.st_mode) else "not a directory")
    if what:
        raise ConfigError(f"{key}: run directory {str(p)!r} is {what}; a run writes only into a directory of its own "
                          f"user that no one else may write: pick another name or logging.run_root")


def _user(uid: int) -> str:
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def make_private(path: Path, shared_group: str = "", *, umask: bool = True, recursive: bool = True) -> None:
    """Only this user (or, with `shared_group`, that group too) may read what this process writes
    under `path`: `path` becomes 0700 (02750 of the group: setgid, files inherit it), what it already
    holds loses the others' bits (a resumed run written before; `recursive`), and with `umask` the
    process umask becomes 077 (027) for everything the run writes from now on (checkpoints, jsonl, MLflow)."""
    gid = grp.getgrnam(shared_group).gr_gid if shared_group else None
    if umask:
        os.umask(0o027 if gid is not None else 0o077)
    keep = 0o750 if gid is not None else 0o700
    for p in [path, *(path.rglob("*") if recursive else ())]:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid():
            continue  # never follow a link out of the run, nor touch another user's file
        if gid is not None and st.st_gid != gid:
            os.chown(p, -1, gid, follow_symlinks=False)
        mode = stat.S_IMODE(st.st_mode) & keep
        if stat.S_ISDIR(st.st_mode):
            mode |= 0o700 | (0o2050 if gid is not None else 0)
        os.chmod(p, mode)


QUEUE_RUN_ID_FILE = "queue_run_id"
"""The run's queue namespace, written once: a resume (and a restart) uses the same one."""


def assign_queue_run_id(cfg: Config, run_dir: Path) -> str:
    """A `queue.run_id` left at `default` becomes this run's own (`<run name>-<8 hex>`, kept in
    `RUN_DIR/queue_run_id`), so that no two runs share shm segments, Redis keys or handles."""
    if cfg.queue.run_id != "default":
        return cfg.queue.run_id
    path = run_dir / QUEUE_RUN_ID_FILE
    try:
        run_id = path.read_text().strip()
    except FileNotFoundError:
        run_id = ""
    if not run_id:
        run_id = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', run_dir.name)[:48]}-{secrets.token_hex(4)}"
        path.write_text(run_id + "\n")
    cfg.queue.run_id = run_id
    return run_id


RECORD_KEY_FILE = "queue_record_key"
"""The Redis records' MAC key of the run (`queue.record_key`): a resume reads the records a segment before wrote."""


def assign_record_key(cfg: Config, run_dir: Path) -> None:
    """`queue.metadata=redis` without `queue.record_key`: the run's own, drawn once into `RUN_DIR/queue_record_key`
    (mode 0600, never through a link) and read back by a resume; a file there that is a link, another user's or
    readable by others is a one-line error naming it. The run's `secret` cannot serve: unless given
    (`ASYNCRL_SECRET`) each segment draws its own, and the records of the one before would all fail their MACs."""
    if cfg.queue.metadata != "redis" or cfg.queue.record_key:
        return
    path = run_dir / RECORD_KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        fd = -1
    if fd >= 0:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:  # ELOOP: a link
        raise ConfigError(f"queue.record_key: {str(path)!r} cannot be read as this run's own file ({e.strerror})") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"queue.record_key: {str(path)!r} is not a file of this user's that only it may read "
                              f"(owner uid {st.st_uid}, mode {st.st_mode & 0o777:o})")
        key = f.read(256).strip()
    if len(key) < 32:
        raise ConfigError(f"queue.record_key: {str(path)!r} holds no key (remove it only if no record of the run is in Redis)")
    cfg.queue.record_key = key


def check_own_tree(path: Path, key: str) -> None:
    """`path` and everything under it must be this user's, not links, and writable by no one else before
    anything there is loaded (no file of a checkpoint is code, `trainer.ckpt_format`, but whoever could write
    one could make this user's run train from weights and state of theirs); else one line naming the file,
    its owner and `key`."""
    for p in [path, *sorted(path.rglob("*"))]:
        what = _not_own(os.lstat(p))
        if what:
            raise ConfigError(f"{key}: {str(p)!r} is {what}; a checkpoint is loaded only when every file of it is "
                              "this user's and no one else may write it")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """Newest complete checkpoint (one whose state.json was written last, after the trainer state)."""
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "state.json").exists())
    return done[-1] if done else None


def write_state(ckpt: Path, state: dict[str, Any]) -> None:
    tmp = ckpt / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, ckpt / "state.json")


PUBLISHED_FILE = "published_version.json"
"""The newest version any segment of the run published: a resume labels its weights above it."""


def write_published(run_dir: Path, version: int) -> None:
    """Record that `version` was published (atomically; called at every publish)."""
    tmp = run_dir / (PUBLISHED_FILE + ".tmp")
    tmp.write_text(json.dumps({"version": int(version)}))
    os.replace(tmp, run_dir / PUBLISHED_FILE)


def read_published(run_dir: Path) -> int:
    """The newest version published in this run directory (-1: none, or written before it was kept)."""
    try:
        return int(json.loads((run_dir / PUBLISHED_FILE).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):  # absent or torn by a crash mid-write: nothing known
        return -1


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "state.json").exists())
    for p in done[: max(len(done) - keep, 0)]:
        shutil.rmtree(p, ignore_errors=True)


def write_status(run_dir: Path, **fields: Any) -> None:
    tmp = run_dir / "status.json.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), "time": time.time(), **fields}))
    os.replace(tmp, run_dir / "status.json")


def read_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> that step's logged metrics from `metrics.jsonl` (a step logged again after a resume: the last line wins)."""
    path = run_dir / "metrics.jsonl"
    rows: dict[int, dict[str, float]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[int(row["step"])] = row
    return dict(sorted(rows.items()))


def _series(rows: dict[int, dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    pts = [(s, r[key]) for s, r in rows.items() if key in r]
    return [s for s, _ in pts], [v for _, v in pts]


def _limits(values: list[float]) -> tuple[float, float] | None:
    """[0, 1] (a little margin) for rewards in [0, 1]; else the data range padded, so that a flat line is not magnified."""
    if not values:
        return None
    lo, hi = min(values), max(values)
    if lo >= 0.0 and hi <= 1.0:
        return -0.03, 1.03
    pad = max((hi - lo) * 0.1, abs(hi) * 0.1, 0.05)
    return lo - pad, hi + pad


def curve_figure(run_dir: Path, curve: list[tuple[int, float]], title: str) -> Any:
    """Three stacked panels over steps: reward (training batches and held-out), response length, staleness.

    Training values come from `metrics.jsonl` (`rollout/reward`, `rollout/response_length`,
    `staleness/mean`, `staleness/max`), the held-out reward from `curve`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = read_metrics(run_dir)
    fig, (ax_r, ax_l, ax_s) = plt.subplots(3, 1, figsize=(7, 7.5), dpi=100, sharex=True)
    ts, tr = _series(rows, "rollout/reward")
    ax_r.plot(ts, tr, marker="o", ms=4, label="training batch")
    ax_r.plot([s for s, _ in curve], [r for _, r in curve], marker="s", ms=5, label="held-out")
    lim = _limits(tr + [r for _, r in curve])
    if lim:
        ax_r.set_ylim(*lim)
    ax_r.set_ylabel("reward")
    ax_r.legend(loc="best", fontsize=8)
    ls, lv = _series(rows, "rollout/response_length")
    ax_l.plot(ls, lv, marker="o", ms=4, color="tab:green")
    ax_l.set_ylim(0, max(lv, default=1.0) * 1.15 or 1.0)
    ax_l.set_ylabel("response length\n(tokens, mean)")
    for key, style in (("staleness/mean", "o-"), ("staleness/max", "^--")):
        ss, sv = _series(rows, key)
        ax_s.plot(ss, sv, style, ms=4, label=key.split("/")[1])
    ax_s.set_ylim(-0.1, max([v for k in ("staleness/max", "staleness/mean") for v in _series(rows, k)[1]], default=1.0) + 0.5)
    ax_s.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_s.set_ylabel("staleness\n(versions)")
    ax_s.legend(loc="best", fontsize=8)
    ax_s.set_xlabel("step")
    ax_s.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax_r, ax_l, ax_s):
        ax.grid(alpha=0.3)
    ax_r.set_title(title)
    fig.tight_layout()
    return fig


def plot_curve(run_dir: Path, curve: list[tuple[int, float]], title: str) -> Path | None:
    """reward_curve.png (see `curve_figure`); None when there is nothing to plot."""
    if not curve and not (run_dir / "metrics.jsonl").exists():
        return None
    import matplotlib.pyplot as plt

    fig = curve_figure(run_dir, curve, title)
    path = run_dir / "reward_curve.png"
    fig.savefig(path)
    plt.close(fig)
    return path
