"""Loading transformers' model classes without scikit-learn and scipy: a process that starts mid-run starts sooner.

Every `PreTrainedModel` loads `transformers.generation.candidate_generator`, which imports
`sklearn.metrics` whenever scikit-learn is installed (mlflow installs it) for assisted decoding's
threshold (`roc_curve`), and `transformers.loss`, which imports `scipy.optimize` for the matching of
object-detection losses. asyncrl runs neither. With what they pull in (pandas) they made a torch
rollout server's start in a fresh process 4.1 s instead of 3.2 s on an idle 2-core host, and more on a
loaded one. Every rollout server and trainer rank that starts while a run waits for it (a restart after
a fault, a fleet that grows) paid it.

`skip_unused_backends()` makes transformers see both as absent. Call it before the first model class is
imported. Only vision, detection and audio models of transformers use them (for a causal LM: nothing).
It does nothing where those modules are already loaded, for a transformers version without these
probes, or with `ASYNCRL_TRANSFORMERS_BACKENDS=1` in the environment (for code in the same process that
wants transformers' scikit-learn or scipy paths). Code that imports sklearn or scipy itself still gets them.
"""

from __future__ import annotations

import os
import sys

PROBES = ("is_sklearn_available", "is_scipy_available")
"""transformers' checks of the backends skipped (`transformers.utils`)."""
LOADERS = ("transformers.generation.candidate_generator", "transformers.loss.loss_utils")
"""The modules that import them when loaded: once one is, it is too late."""
KEEP_ENV = "ASYNCRL_TRANSFORMERS_BACKENDS"


def skip_unused_backends() -> bool:
    """Returns whether transformers now sees scikit-learn and scipy as absent."""
    if any(m in sys.modules for m in LOADERS) or os.environ.get(KEEP_ENV) == "1":
        return False
    try:
        import transformers.utils as utils
        from transformers.utils import import_utils
    except ImportError:
        return False
    done = False
    for module in (utils, import_utils):  # `from ..utils import is_sklearn_available` reads the first
        for probe in PROBES:
            if hasattr(module, probe):
                setattr(module, probe, _absent)
                done = True
    return done


def _absent() -> bool:
    return False


def auto_tokenizer(path: str | os.PathLike) -> object:
    """`AutoTokenizer.from_pretrained(path)`, backends skipped first: transformers' tokenizer classes
    load its model classes' modules too (a cost-model server that loads only a tokenizer spent 2.8 s of
    its 3.4 s build in them with scikit-learn loaded)."""
    skip_unused_backends()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
