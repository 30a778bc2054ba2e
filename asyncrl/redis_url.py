"""A Redis URL's password is a secret: never taken on a command line, never written or printed.

`url_password` tells a URL that carries one (`redis://:PASSWORD@host:6379/0`), `redact_url` writes it
as `redis://:<set>@host:6379/0`, and `from_arg` is what the commands that take `--redis URL`
(`asyncrl status`, `asyncrl scale`) accept: a URL without a password, or `env` for the one in
`ASYNCRL_REDIS_URL`. The config's `queue.redis_url` follows the same rule (`config.io`): a password
comes from the environment (`'queue.redis_url=${oc.env:ASYNCRL_REDIS_URL}'`) or a 0600 recipe.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ENV = "ASYNCRL_REDIS_URL"
"""The environment variable that holds a Redis URL with its password."""
REDACTED = "<set>"


def url_password(url: Any) -> bool:
    """Whether `url` is a URL that carries a password (`scheme://user:PASSWORD@host`); an
    interpolation (`${oc.env:...}`) is not: its value never reaches a command line."""
    if not isinstance(url, str) or "://" not in url or "${" in url:
        return False
    try:
        return bool(urlsplit(url).password)
    except ValueError:  # a malformed URL: whoever uses it says so
        return False


def redact_url(url: str) -> str:
    """`url` with its password, if any, replaced by `<set>`."""
    if not url_password(url):
        return url
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:{REDACTED}@{host}"))


def from_arg(value: str, environ: Any = None) -> str:
    """The Redis URL a `--redis` argument names: `env` (`ASYNCRL_REDIS_URL`), or a URL without a password;
    a URL with one is a `ValueError` whose message never repeats it."""
    env = os.environ if environ is None else environ
    if value == "env":
        if not env.get(ENV):
            raise ValueError(f"--redis env: {ENV} is not set")
        return env[ENV]
    if url_password(value):
        raise ValueError(f"--redis: a URL with a password is not taken on the command line (every user of this host "
                         f"reads it in /proc/<pid>/cmdline); export {ENV}='redis://:PASSWORD@host:6379/0' and pass "
                         "--redis env")
    return value
