"""The processes `asyncrl bench planes --hosts N` (`planes_hosts.py`) starts on simulated hosts, one role each,
each answering with one JSON line on stdout:

    python -m asyncrl.bench.host_probes sender MODEL HOST PORT RECEIVERS REPEATS
    python -m asyncrl.bench.host_probes receiver ENDPOINT ID UPDATES
    python -m asyncrl.bench.host_probes producer HOST RECORDS TOKENS HANDLES_FILE
    python -m asyncrl.bench.host_probes consumer HANDLES_FILE BATCH PASSES

- `sender`: a bare `checkpoint_engine.Sender` (gloo, the pipeline's bucket size) whose control socket binds
  HOST:PORT (a fixed port, so the receivers can be started with it at once), waiting for RECEIVERS
  receivers and publishing MODEL's state dict REPEATS times: the publish the pipeline's is held against.
- `receiver`: a `Receiver` that joins ENDPOINT and takes UPDATES updates, copying each tensor into a
  parameter buffer as an engine's load does (`asyncrl.bench.weights.worker`, without its command socket).
- `producer`: a `ZmqStorage` whose own storage unit binds HOST (a rollout side's unit); writes RECORDS
  records of two TOKENS-long fields (`response_ids` int32, each filled with its record's index, and
  `behavior_logprobs` float32), writes their handles, as the consumer copies a memory service hands out
  (`handles.without_free`), to HANDLES_FILE as msgpack, prints its line and serves until stdin closes.
- `consumer`: reads those handles with a `ZmqStorage` that hosts no unit (a trainer rank's), BATCH
  records per read (a trainer rank's step), PASSES timed passes over all of them after one untimed read
  (connection and CURVE handshake); checks every record's index.

Every socket carries the run's secret (`ASYNCRL_SECRET`, which the cluster's processes inherit), as a run's
planes do. Nothing here knows of hosts: the bench says where each role runs and what it binds.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

WEIGHTS = {"backend": "gloo", "bucket_size_mb": 64, "checksum": False, "timeout_s": 120}
"""The weight plane of the bare publish: the pipeline's (`planes.overrides`) with gloo, which crosses hosts."""


def _secret() -> str:
    return os.environ.get("ASYNCRL_SECRET", "")


def sender(model: str, host: str, port: int, receivers: int, repeats: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    from checkpoint_engine import Sender, WeightsConfig

    state = load_file(os.path.join(model, "model.safetensors"))
    s = Sender(WeightsConfig(**WEIGHTS, host=host, port=port, secret=_secret()))
    try:
        s.wait_for(receivers, timeout_s=120)
        secs = []
        for v in range(repeats):
            t0 = time.perf_counter()
            out = s.publish(state.items(), v)
            secs.append(time.perf_counter() - t0)
            if len(out.completed) != receivers:
                raise RuntimeError(f"publish {v}: {len(out.completed)} of {receivers} receivers completed; evicted {out.evicted}")
    finally:
        s.close()
    return {"publish_s_each": [round(x, 4) for x in secs], "bytes": out.bytes, "endpoint": s.endpoint}


def receiver(endpoint: str, rid: str, updates: int) -> dict[str, Any]:
    import torch

    from checkpoint_engine import Receiver, WeightsConfig

    rx = Receiver(WeightsConfig(**WEIGHTS, secret=_secret()), rid, endpoint=endpoint)
    times, params = [], {}
    try:
        for _ in range(updates):
            t0 = time.perf_counter()
            for name, tensor in rx.next_update(timeout_s=300, borrow=True):
                if name not in params:  # an engine's parameters exist before any update
                    params[name] = torch.empty_like(tensor)
                params[name].copy_(tensor)
            times.append(round(time.perf_counter() - t0, 4))
    finally:
        rx.close()
    return {"seconds": times}


def producer(host: str, records: int, tokens: int, handles_file: str) -> None:
    import numpy as np

    from transfer_queue.codec import pack
    from transfer_queue.storage.handles import without_free
    from transfer_queue.storage.zmq import ZmqStorage

    plane = ZmqStorage(bind_host=host, secret=_secret())
    rng = np.random.default_rng(0)
    logprobs = rng.standard_normal(tokens).astype(np.float32)
    out = []
    t0 = time.perf_counter()
    for k in range(records):
        handles = plane.write(f"r{k}", {"response_ids": np.full(tokens, k, dtype=np.int32), "behavior_logprobs": logprobs})
        out.append({name: without_free(h) for name, h in handles.items()})
    write_s = time.perf_counter() - t0
    Path(handles_file).write_bytes(pack(out))
    print(json.dumps({"write_s": round(write_s, 3), "unit": plane.address()}), flush=True)
    sys.stdin.read()  # serve the reads until the bench closes stdin
    plane.close()


def consumer(handles_file: str, batch: int, passes: int) -> dict[str, Any]:
    from plane_common.strict_msgpack import decoder
    from transfer_queue.storage.handles import Handle
    from transfer_queue.storage.zmq import ZmqStorage

    records = decoder(list[dict[str, Handle]]).decode(Path(handles_file).read_bytes())
    fields = sorted(records[0])
    batches = [records[i:i + batch] for i in range(0, len(records), batch)]
    plane = ZmqStorage(secret=_secret())  # reads only: it hosts no storage unit
    try:
        plane.read([r[f] for r in batches[0] for f in fields])  # untimed: connection and handshake
        secs, nbytes = [], 0
        for _ in range(passes):
            t0 = time.perf_counter()
            got = [plane.read([r[f] for r in b for f in fields]) for b in batches]
            secs.append(time.perf_counter() - t0)
            nbytes = sum(a.nbytes for arrays in got for a in arrays)
            ids = [int(arrays[k * len(fields) + fields.index("response_ids")][0]) for arrays, b in zip(got, batches)
                   for k in range(len(b))]
            if ids != list(range(len(records))):
                raise RuntimeError("records read back out of order or corrupted")
    finally:
        plane.close()
    read_s = statistics.median(secs)
    return {"records": len(records), "bytes": nbytes, "batch": batch, "read_s": round(read_s, 4),
            "read_s_each": [round(x, 4) for x in secs], "records_per_s": round(len(records) / read_s, 1),
            "data_mb_per_s": round(nbytes / read_s / 1e6, 2)}


def main(argv: list[str] | None = None) -> int:
    role, *args = sys.argv[1:] if argv is None else argv
    if role == "sender":
        model, host, port, receivers, repeats = args
        print(json.dumps(sender(model, host, int(port), int(receivers), int(repeats))), flush=True)
    elif role == "receiver":
        endpoint, rid, updates = args
        print(json.dumps(receiver(endpoint, rid, int(updates))), flush=True)
    elif role == "producer":
        host, records, tokens, handles_file = args
        producer(host, int(records), int(tokens), handles_file)
    elif role == "consumer":
        handles_file, batch, passes = args
        print(json.dumps(consumer(handles_file, int(batch), int(passes))), flush=True)
    else:
        print(f"host_probes: no role {role!r} (sender, receiver, producer, consumer)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
