"""What the data plane (`transfer_queue`) and the weight plane (`checkpoint_engine`) share: the lowest layer.

- `curve`: the run's secret -> ZeroMQ CURVE key pairs (one derivation, so a queue and a weight plane
  of one run accept the same keys) and the client side of a CURVE socket;
- `listener`: the `Gate` of a context's listening sockets: frame limit, handshake deadline, CURVE
  server whose ZAP handler admits only the secret's client key, connection cap; refusals counted;
- `strict_msgpack`: typed msgpack decoders that refuse ext types (what every wire record is read with);
- `liveness`: whether an owner still lives: a pid of this host (`pid_alive`), or whoever holds a
  file's lock (`unlink_orphan` removes the file once nobody does).

Boundary: pyzmq, msgspec, psutil and the standard library only. It never imports `asyncrl`, `agents` or
either plane, so each plane stays usable on its own (docs/layers.md, the lowest row).
"""
