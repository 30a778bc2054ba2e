"""The map from verl's config keys (and a few other common names) to asyncrl's, and the hint an unknown key gets.

Job: one table, `ALIASES`, read by two readers: `hint(key, keys)` (the error of an unknown key, raised by
`io.load`) and `docs/verl.md` (its table is `markdown_table()`, written there by
`python -m asyncrl.config.aliases --write docs/verl.md`; a test keeps the two equal and checks that
every asyncrl key named here exists). A key the table does not know gets the closest keys of its
section (difflib), or, under one of verl's sections (`actor_rollout_ref.rollout.`, ...), the asyncrl
key of the same name in the matching section.

Boundary: names only. No value is translated (verl's `loss_agg_mode=token-mean` is not rewritten to
`token_mean`): a user sets the asyncrl key, with the asyncrl value, once.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Alias:
    """One foreign key and where it lives in asyncrl."""

    key: str
    """The key as a verl user (or another framework's user) writes it, dotted."""
    asyncrl: tuple[str, ...]
    """The asyncrl key(s) to set instead; empty when asyncrl has no such setting (`note` says why)."""
    note: str = ""
    """How the meaning differs, when it does."""


def _a(key: str, *asyncrl: str, note: str = "") -> Alias:
    return Alias(key, tuple(asyncrl), note)


BACKENDS = "`vllm`, `torch` (embedded), `openai` (OpenAI-compatible servers you run, at `rollout.server_urls`) or `cost_model` (simulated)"
"""The note of every key that names the inference engine."""

GSPO = "verl's GSPO reads this key too (its recipe: 3e-4 low, 4e-4 high); asyncrl's `gspo` has its own: `algorithm.loss_args.seq_clip_ratio_low` / `_high` (older keys `algorithm.gspo_clip_ratio_low` / `_high`)"
"""The note of verl's clip range keys: GSPO's clip range lives elsewhere in asyncrl."""

ALIASES: tuple[Alias, ...] = (
    # model and data
    _a("actor_rollout_ref.model.path", "model.path", note="a local folder only; nothing is downloaded"),
    _a("actor_rollout_ref.model.lora_rank", "model.lora_rank", note="0 is off; adapters reach the servers merged into full weights"),
    _a("actor_rollout_ref.model.lora_alpha", "model.lora_alpha"),
    _a("actor_rollout_ref.model.target_modules", "model.target_modules", note="a list; `[all-linear]` is the default"),
    _a("data.train_files", "data.train_path", note="one path (not a list): a parquet or jsonl file, or a `datasets` save_to_disk folder"),
    _a("data.val_files", "data.eval_path", note="one file; empty holds out `data.eval_size` training rows"),
    _a("data.train_batch_size", "trainer.prompts_per_step", note="prompts (groups) per step; samples = prompts x rollout.group_size"),
    _a("data.max_prompt_length", "data.max_prompt_tokens", note="longer prompts are skipped and counted, never truncated"),
    _a("data.max_response_length", "rollout.max_tokens", note="per generate call; the tool agent's total is `agent.kwargs.max_response_tokens`"),
    # rollout
    _a("actor_rollout_ref.rollout.n", "rollout.group_size"),
    _a("rollout.n", "rollout.group_size"),
    _a("actor_rollout_ref.rollout.name", "rollout.backend", note=BACKENDS),
    _a("rollout.name", "rollout.backend", note=BACKENDS),
    _a("rollout.engine", "rollout.backend", note=BACKENDS),
    _a("actor_rollout_ref.rollout.temperature", "rollout.temperature"),
    _a("actor_rollout_ref.rollout.top_p", "rollout.top_p"),
    _a("actor_rollout_ref.rollout.top_k", "rollout.top_k"),
    _a("actor_rollout_ref.rollout.response_length", "rollout.max_tokens"),
    _a("rollout.response_length", "rollout.max_tokens"),
    _a("rollout.max_new_tokens", "rollout.max_tokens"),
    _a("actor_rollout_ref.rollout.val_kwargs.temperature", "rollout.eval_temperature", note="0 is greedy"),
    _a("actor_rollout_ref.rollout.tensor_model_parallel_size", "rollout.tensor_parallel_size"),
    _a("rollout.tensor_model_parallel_size", "rollout.tensor_parallel_size"),
    _a("actor_rollout_ref.rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    _a("actor_rollout_ref.rollout.enforce_eager", "rollout.enforce_eager"),
    _a("actor_rollout_ref.rollout.mode",
       note="verl's `async` is its server mode, which asyncrl always uses; asynchronous training is `trainer.mode`"),
    _a("actor_rollout_ref.rollout.multi_turn.max_assistant_turns", "agent.name", "agent.kwargs",
       note="`agent.name=tool` with `agent.kwargs={max_turns: N}`"),
    # actor / optimizer
    _a("actor_rollout_ref.actor.optim.lr", "trainer.lr"),
    _a("actor_rollout_ref.actor.optim.weight_decay", "trainer.weight_decay"),
    _a("actor_rollout_ref.actor.optim.lr_warmup_steps", "trainer.warmup_steps"),
    _a("actor_rollout_ref.actor.optim.warmup_style", "trainer.lr_schedule", note="`constant` or `cosine`"),
    _a("actor_rollout_ref.actor.optim.min_lr_ratio", "trainer.min_lr_ratio"),
    _a("actor_rollout_ref.actor.grad_clip", "trainer.grad_clip"),
    _a("actor_rollout_ref.actor.ppo_mini_batch_size", "trainer.minibatches",
       note="asyncrl counts mini-batches: trainer.minibatches = data.train_batch_size / ppo_mini_batch_size"),
    _a("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "trainer.micro_batch_size", note="sequences per forward/backward"),
    _a("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "trainer.max_tokens_per_micro_batch", note="micro-batches by a token budget"),
    _a("actor_rollout_ref.model.use_remove_padding", "trainer.packing", note="sequences packed without padding"),
    _a("actor_rollout_ref.model.enable_gradient_checkpointing", "trainer.gradient_checkpointing"),
    _a("actor_rollout_ref.actor.clip_ratio_c", "algorithm.clip_ratio_c", note="dual-clip PPO bound (3 as verl); the older key of `algorithm.loss_args.clip_ratio_c`"),
    _a("actor_rollout_ref.actor.ppo_epochs", note="one pass per step; more optimizer steps per batch: trainer.minibatches"),
    _a("actor_rollout_ref.actor.clip_ratio", "algorithm.clip_ratio_low", "algorithm.clip_ratio_high", note="set both; " + GSPO),
    _a("actor_rollout_ref.actor.clip_ratio_low", "algorithm.clip_ratio_low", note=GSPO),
    _a("actor_rollout_ref.actor.clip_ratio_high", "algorithm.clip_ratio_high", note=GSPO),
    _a("actor_rollout_ref.actor.policy_loss.loss_mode", "algorithm.loss",
       note="verl's `vanilla` (PPO's clip, with dual clip) is `ppo_clip`; `gspo`, `clip_cov`, `kl_cov`, `cispo` keep their names (asyncrl's `vanilla_pg` is unclipped)"),
    _a("actor_rollout_ref.actor.loss_agg_mode", "algorithm.loss_agg", note="values with underscores: `token_mean`, `seq_mean_token_mean`, `seq_mean_token_sum`, `seq_mean_token_sum_norm`"),
    _a("actor_rollout_ref.actor.loss_scale_factor", "algorithm.loss_agg_norm_len",
       note="the constant of `seq_mean_token_sum_norm`, required > 0 there (verl's null, the batch's padded length: give e.g. rollout.max_tokens); "
            "asyncrl also takes the mean over sequences, so verl's loss is N times asyncrl's (docs/verl.md)"),
    _a("actor_rollout_ref.actor.use_kl_loss", "algorithm.kl_coef", note="KL to the reference is on when algorithm.kl_coef > 0"),
    _a("actor_rollout_ref.actor.kl_loss_coef", "algorithm.kl_coef"),
    _a("actor_rollout_ref.actor.kl_loss_type", "algorithm.kl_estimator", note="`k1`, `k2`, `k3` (verl's `low_var_kl` is k3)"),
    _a("actor_rollout_ref.actor.entropy_coeff", "algorithm.entropy_coef",
       note="with algorithm.entropy_target > 0 (the default) it is the start of an adapted weight"),
    # algorithm
    _a("algorithm.adv_estimator", "algorithm.advantage", note="`grpo`, `rloo`, `reinforce_pp`, `gae` (with the critic)"),
    _a("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std"),
    # critic (algorithm.gamma, algorithm.lam, algorithm.use_kl_in_reward and algorithm.kl_ctrl.* keep verl's names)
    _a("critic.optim.lr", "critic.lr", note="0 takes trainer.lr"),
    _a("critic.optim.weight_decay", "critic.weight_decay"),
    _a("critic.model.path", "critic.model_path", note="empty: the policy's model; a value head is added"),
    _a("critic.ppo_micro_batch_size_per_gpu", "trainer.micro_batch_size", note="the critic runs on the trainer's ranks with their micro-batches"),
    _a("trainer.critic_warmup", note="not implemented: the actor and the critic update from the first step"),
    # verl's algorithm.rollout_correction.* keys load as they are (asyncrl reads them: docs/verl.md); its loss settings:
    _a("actor_rollout_ref.actor.policy_loss.clip_cov_ratio", "algorithm.loss_args", note="`algorithm.loss_args.clip_cov_ratio` with `algorithm.loss=clip_cov`"),
    _a("actor_rollout_ref.actor.policy_loss.clip_cov_lb", "algorithm.loss_args", note="`algorithm.loss_args.clip_cov_lb` with `algorithm.loss=clip_cov`"),
    _a("actor_rollout_ref.actor.policy_loss.clip_cov_ub", "algorithm.loss_args", note="`algorithm.loss_args.clip_cov_ub` with `algorithm.loss=clip_cov`"),
    _a("actor_rollout_ref.actor.policy_loss.kl_cov_ratio", "algorithm.loss_args", note="`algorithm.loss_args.kl_cov_ratio` with `algorithm.loss=kl_cov`"),
    _a("actor_rollout_ref.actor.policy_loss.ppo_kl_coef", "algorithm.loss_args", note="`algorithm.loss_args.ppo_kl_coef` with `algorithm.loss=kl_cov`"),
    # AReaL's off-policy keys
    _a("actor.use_decoupled_loss", "algorithm.correction", note="true: `decoupled_ppo` (or another entry of form decoupled); false: `bypass`"),
    _a("actor.prox_logp_method", "algorithm.proximal", note="`recompute` as AReaL's; AReaL's `loglinear` is `interpolate`"),
    _a("actor.m2_threshold", "algorithm.correction", "algorithm.correction_args", note="`algorithm.correction=m2po` with `algorithm.correction_args.m2_threshold`"),
    _a("actor.rejection_sampling.level", "algorithm.correction", note="token, ratio, mask with lower/upper: `icepop` (`correction_args.low` / `high`); sequence, ratio, mean: `geo_rs`"),
    _a("actor.rejection_sampling.lower", "algorithm.correction_args", note="`low` of `icepop` / `geo_rs`"),
    _a("actor.rejection_sampling.upper", "algorithm.correction_args", note="`high` of `icepop` / `geo_rs`"),
    # verl's fully-async recipe
    _a("async_training.staleness_threshold", "trainer.max_staleness",
       note="verl: a fraction of extra samples generated ahead; asyncrl: eta, the most versions a trained sample may lag (with trainer.mode=fully_async)"),
    _a("async_training.trigger_parameter_sync_step", "trainer.publish_every"),
    _a("async_training.partial_rollout", "rollout.partial_rollouts", note="and `rollout.update_mode` (keep, wait, abort)"),
    # reward
    _a("custom_reward_function.path", "agent.reward", note="`module:function`, or a registered name"),
    _a("custom_reward_function.name", "agent.reward"),
    _a("reward_model.reward_manager", "agent.reward"),
    _a("reward_model.overlong_buffer.enable", "agent.overlong_buffer_len", note="DAPO overlong shaping is on when agent.overlong_buffer_len > 0"),
    _a("reward_model.overlong_buffer.len", "agent.overlong_buffer_len", note="must be < rollout.max_tokens (the tool agent's: agent.kwargs.max_response_tokens)"),
    _a("reward_model.overlong_buffer.penalty_factor", "agent.overlong_penalty_factor"),
    _a("reward_model.overlong_buffer.log", note="always on: each record's reward_info keeps `score` (unshaped) and `overlong_penalty`"),
    # trainer and logging
    _a("trainer.total_training_steps", "trainer.total_steps"),
    _a("trainer.total_epochs", "trainer.total_steps", note="asyncrl counts steps; the prompt stream repeats"),
    _a("trainer.test_freq", "trainer.eval_every"),
    _a("trainer.save_freq", "trainer.save_every"),
    _a("trainer.n_gpus_per_node", "trainer.num_ranks", "rollout.num_servers", note="trainer ranks and servers are placed separately"),
    _a("trainer.nnodes", "ray.address", note="join a Ray cluster; placement follows the ranks and servers asked for"),
    _a("trainer.project_name", "logging.experiment"),
    _a("trainer.experiment_name", "logging.run_name"),
    _a("trainer.logger", "logging.mlflow", note="MLflow only"),
    _a("trainer.default_local_dir", "logging.run_root"),
    _a("trainer.resume_mode", "resume", note="`resume=true` with `logging.run_name`"),
    _a("trainer.val_before_train", note="asyncrl always evaluates at step 0: drop the override"),
    _a("trainer.batch_size", "trainer.prompts_per_step"),
)

BY_KEY: dict[str, Alias] = {a.key: a for a in ALIASES}

SECTIONS: dict[str, str] = {
    "actor_rollout_ref.rollout.": "rollout.",
    "actor_rollout_ref.actor.optim.": "trainer.",
    "actor_rollout_ref.actor.": "algorithm.",
    "actor_rollout_ref.model.": "model.",
}
"""verl sections and the asyncrl section where a key of the same name lives (`actor_rollout_ref.rollout.top_p` ->
`rollout.top_p`)."""


def _point(a: Alias) -> str:
    if not a.asyncrl:
        return "there is no asyncrl key" + (f" ({a.note})" if a.note else "")
    return f"in asyncrl it is {' and '.join(a.asyncrl)}" + (f" ({a.note})" if a.note else "")


def hint(key: str, keys: frozenset[str]) -> str:
    """What to set instead of the unknown `key`, given every asyncrl key (`doc.asyncrl_keys`); '' when nothing is close."""
    if key in BY_KEY:
        return _point(BY_KEY[key])
    for verl, ours in SECTIONS.items():
        if key.startswith(verl):
            for section in dict.fromkeys((ours, "trainer.", "algorithm.", "rollout.")):
                if section + key[len(verl):] in keys:
                    return f"in asyncrl it is {section + key[len(verl):]}"
    section, _, name = key.rpartition(".")
    siblings = sorted(k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section)
    close = [f"{section}.{n}" if section else n for n in difflib.get_close_matches(name, siblings, n=3, cutoff=0.6)]
    return f"did you mean {' or '.join(close)}?" if close else ""


def markdown_table() -> str:
    """The key map as the Markdown table of `docs/verl.md`."""
    rows = ["| verl key | asyncrl key | note |", "|---|---|---|"]
    for a in ALIASES:
        ours = ", ".join(f"`{k}`" for k in a.asyncrl) or "—"
        rows.append(f"| `{a.key}` | {ours} | {a.note} |")
    return "\n".join(rows) + "\n"


BEGIN, END = "<!-- key map: generated by python -m asyncrl.config.aliases --write docs/verl.md -->", "<!-- end of key map -->"


def write(path: str) -> None:
    """Replace the table between `BEGIN` and `END` in the page at `path`."""
    from pathlib import Path

    p = Path(path)
    text = p.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    p.write_text(f"{head}{BEGIN}\n{markdown_table()}{END}{tail}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"] and len(sys.argv) == 3:
        write(sys.argv[2])
    else:
        print(markdown_table(), end="")
