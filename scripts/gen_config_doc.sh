#!/usr/bin/env bash
# Regenerate configs/README.md: the hand-written prose above its generated line is kept, and everything from
# that line on is `asyncrl config --doc` (the policy losses' settings and every key, from the config dataclasses).
set -euo pipefail
cd "$(dirname "$0")/.."
marker='^<!-- generated from the config dataclasses by'
grep -q "$marker" configs/README.md || { echo "configs/README.md: no generated line (see asyncrl/config/doc.py GENERATED)" >&2; exit 1; }
{ sed "/$marker/,\$d" configs/README.md; .venv/bin/asyncrl config --doc; } > configs/README.md.new
mv configs/README.md.new configs/README.md
