"""A rollout-server stand-in process for the weight-plane tests and the benchmark.

Joins a sender, receives `--updates` updates and appends one JSON line per update to
`--out`: the version and a CRC32 per tensor (or the error it raised). `--slow` sleeps
that many seconds after each bucket so a test can kill it mid-update. Arguments are
JSON / plain strings: nothing is pickled between the test and this process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib

from checkpoint_engine import ChecksumError, Receiver, UpdateAborted, WeightsConfig


def digest(tensor) -> int:
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(__import__("torch").uint8)
    return zlib.crc32(memoryview(raw.numpy()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True, help="WeightsConfig fields as JSON")
    p.add_argument("--id", required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--updates", type=int, default=1)
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--digest", type=int, default=1)
    args = p.parse_args(argv)
    rx = Receiver(WeightsConfig(**json.loads(args.config)), args.id, endpoint=args.endpoint)
    done = 0
    while done < args.updates:
        record: dict = {}
        try:
            update = rx.next_update(timeout_s=120)
            record["version"] = update.version
            t0 = time.perf_counter()
            got = {}
            for name, tensor in update:
                got[name] = digest(tensor) if args.digest else tensor.numel()
                if args.slow:
                    with open(args.out + ".progress", "a") as f:
                        f.write(name + "\n")
                    time.sleep(args.slow)
            record.update(received=rx.version, seconds=time.perf_counter() - t0, digest=got)
        except (ChecksumError, UpdateAborted) as e:
            record["error"] = type(e).__name__
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
        done += 1
    rx.close()


if __name__ == "__main__":
    main(sys.argv[1:])
