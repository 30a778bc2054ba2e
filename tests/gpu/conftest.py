"""GPU tests (`make test-gpu` on a host with a CUDA GPU; every one is skipped elsewhere).

They cover what no CPU run can: an FSDP2 step on CUDA, the vLLM GPU engine, a CUDA-IPC publish
from a trainer rank to a server on the same GPU, NCCL between GPUs
(`tests/integration/checkpoint_engine/test_ckpt_nccl.py`, 2+ GPUs) and the GSM8K recipe's
pipeline on a tiny local model. Each module carries `pytestmark = GPU`.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
