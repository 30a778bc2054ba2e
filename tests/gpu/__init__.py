"""GPU tests: `GPU` marks a module as needing a CUDA GPU (skipped where none is visible)."""

import pytest
import torch

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
