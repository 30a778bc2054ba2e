#!/usr/bin/env bash
# Regenerate configs/README.md's key table from the config dataclasses (keeps the prose above the table).
set -euo pipefail
cd "$(dirname "$0")/.."
{ sed '/^| key | default | meaning |$/,$d' configs/README.md; .venv/bin/asyncrl config --doc; } > configs/README.md.new
mv configs/README.md.new configs/README.md
