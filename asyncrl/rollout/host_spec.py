"""What a server's process needs to host samples, and the wire form of what crosses to and from it.

`HostSpec` is plain data (it travels to every server actor once, at start): the agent settings,
the resolved reward name, the sampling of training and of evaluation, the queue's data-plane
config and the partial-rollout switch. `build_host` turns it into a `ServerHost` in the
server's process: the tokenizer and the AgentLoops are built there, and the data plane the
trajectories are written into is that process's own.

Per sample, a `Sample` goes to the server and a `SampleMeta` (the queue record) comes back,
both as msgpack through msgspec, decoded into their types (a malformed reply is a
`msgspec.ValidationError`, never an object built from untrusted data).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from agents.base import AgentLoop
from asyncrl.engines.sample import Sample
from transfer_queue import SampleMeta
from transfer_queue.storage.handles import Handle


@dataclass
class HostSpec:
    agent: dict[str, Any]
    """`AgentConfig` as a dict (name, reward_kwargs, reward_timeout_s, reward_workers, max_reward_failures, kwargs)."""
    reward: str
    """The reward function by name or `module:attr` (the agent's, else the task's)."""
    sampling: dict[str, Any]
    """`SamplingParams` of training rollouts."""
    eval_sampling: dict[str, Any]
    """`SamplingParams` of held-out evaluation."""
    queue: dict[str, Any] = field(default_factory=dict)
    """`TransferQueueConfig` of the data plane the host writes trajectories into."""
    partial_rollouts: bool = True
    log_dir: str = ""
    """The run directory: inference engines write their own logs there (`vllm.log`); empty: none."""


def make_agent(agent: dict[str, Any], reward: str | None, encode: Callable, decode: Callable, sampling: Any,
               tokenizer: Any = None) -> AgentLoop:
    """The configured AgentLoop; `encode`, `tokenizer` (its chat template renders multi-turn agents'
    turns), `agent.reward_workers` and `agent.max_reward_failures` are passed to agents that take
    them (the built-in ones do). Errors name the config key (`agent.name`, `agent.reward`, and for what
    the agent's or a tool's constructor refuses, `agent.kwargs.<key>` or `agent.kwargs.tools[i].<key>`).
    `reward=None`: not known yet (the task's, read from its data): the agent is built with a stand-in
    reward, to check its settings (`preflight.check_agent`)."""
    from agents.registry import AGENTS, accepts, build_agent
    from agents.rewards import get_reward
    from agents.tools.base import ToolUnavailable
    from asyncrl.config import ConfigError
    from asyncrl.registry import UnknownName

    scoring: dict[str, Any] = (dict(reward=reward, reward_kwargs=dict(agent["reward_kwargs"])) if reward is not None
                               else dict(reward_fn=lambda *a, **k: 0.0))
    kw: dict[str, Any] = dict(decode=decode, sampling=sampling, **scoring, reward_timeout_s=agent["reward_timeout_s"], **agent["kwargs"])
    try:
        factory = AGENTS.get(agent["name"])
    except UnknownName as e:  # its text names the key already
        raise ConfigError(str(e)) from None
    except (ValueError, ImportError, AttributeError) as e:
        raise ConfigError(f"agent.name: {e}") from None
    if reward is not None:
        try:
            get_reward(reward, **agent["reward_kwargs"])
        except UnknownName as e:
            raise ConfigError(str(e)) from None
        except (ValueError, ImportError, AttributeError) as e:
            raise ConfigError(f"agent.reward: {e}") from None
    if "encode" in inspect.signature(factory).parameters:
        kw["encode"] = encode
    if tokenizer is not None and "tokenizer" not in kw and accepts(factory, "tokenizer"):
        kw["tokenizer"] = tokenizer
    for key in ("reward_workers", "max_reward_failures"):
        if key in agent and key not in kw and accepts(factory, key):
            kw[key] = agent[key]
    try:
        return build_agent(agent["name"], **kw)
    except ConfigError:
        raise
    except (TypeError, ValueError, ImportError, ToolUnavailable) as e:  # refused by the agent's or a tool's constructor
        raise _refused(e, agent["kwargs"]) from None


def _refused(e: BaseException, kwargs: dict[str, Any]) -> Exception:
    """The `ConfigError` of a setting an agent's or a tool's constructor refused: the key is the tool's
    (`agent.kwargs.tools[i]`, the first spec that fails alone with the same error) or the agent's
    (`agent.kwargs`), narrowed to the setting the message is about when it starts with its name
    (`sandbox.wall_s must be > 0`: `.wall_s`) or is a TypeError's unexpected keyword."""
    import re

    from agents.tools.base import build_tools
    from asyncrl.config import ConfigError

    msg = str(e)
    base, given = "agent.kwargs", dict(kwargs)
    tools = kwargs.get("tools")
    for i, spec in enumerate(tools if isinstance(tools, (list, tuple)) else []):
        try:
            build_tools([spec])
        except Exception as again:  # noqa: BLE001  only compared with `e`: is this the spec that failed?
            if type(again) is type(e) and str(again) == msg:
                base, given = f"agent.kwargs.tools[{i}]", dict(spec) if isinstance(spec, dict) else {}
                break
    named = [k for k in given if k != "name" and (re.match(rf"([\w.]*\.)?{re.escape(str(k))}(?!\w)", msg)  # `sandbox.wall_s must ...`
                                                or f"keyword argument '{k}'" in msg)]  # a TypeError's unexpected keyword
    key = f"{base}.{named[0]}" if len(named) == 1 else base
    for prefix in (key, base, "agent.kwargs.tools", "agent.kwargs"):  # a message that names its key already
        if msg.startswith(prefix + ": "):
            msg = msg[len(prefix) + 2:]
            break
    return ConfigError(f"{key}: {msg}")


def tokenizer_codec(tokenizer: Any) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]]:
    """(encode, decode) of a HF tokenizer as the agents use them."""
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    return encode, decode


def build_host(server: Any, name: str, spec: dict[str, Any] | HostSpec, model_path: str) -> tuple[Any, Any]:
    """(ServerHost, its data plane) for `server` in this process."""
    from asyncrl.hf_imports import auto_tokenizer
    from asyncrl.engines.base import SamplingParams
    from asyncrl.rollout.host import ServerHost
    from transfer_queue import TransferQueueConfig, make_storage

    s = spec if isinstance(spec, HostSpec) else HostSpec(**spec)
    tok = auto_tokenizer(model_path)
    encode, decode = tokenizer_codec(tok)
    agent = make_agent(s.agent, s.reward, encode, decode, SamplingParams(**s.sampling), tokenizer=tok)
    eval_agent = make_agent(s.agent, s.reward, encode, decode, SamplingParams(**s.eval_sampling), tokenizer=tok)
    queue = TransferQueueConfig(**s.queue)
    plane = make_storage(queue)
    if plane.kind == "shm":  # on a host that may hold no controller: what runs gone left here goes too
        from asyncrl.shm_gc import at_start

        at_start(queue.shm_dir, queue.shm_keep_s, who=f"server {name}: ")
    host = ServerHost(server, name=name, agent=agent, eval_agent=eval_agent, plane=plane, partial_rollouts=s.partial_rollouts)
    return host, plane


def as_dict(spec: HostSpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)


def encode_sample(sample: Sample) -> bytes:
    return msgspec.msgpack.encode(sample)


def decode_sample(data: bytes) -> Sample:
    return msgspec.msgpack.decode(data, type=Sample)


def encode_samples(samples: list[Sample]) -> bytes:
    return msgspec.msgpack.encode(list(samples))


def decode_samples(data: bytes) -> list[Sample]:
    return msgspec.msgpack.decode(data, type=list[Sample])


def encode_handles(handles: dict[str, Any]) -> bytes:
    """{uid: data-plane handle} (a server's snapshots) as msgpack."""
    return msgspec.msgpack.encode(handles)


def decode_handles(data: bytes) -> dict[str, Handle]:
    return msgspec.msgpack.decode(data, type=dict[str, Handle])


def decode_handle(data: bytes) -> Handle:
    return msgspec.msgpack.decode(data, type=Handle)


def encode_record(record: SampleMeta) -> bytes:
    return msgspec.msgpack.encode(record)


def encode_records(records: list[SampleMeta]) -> bytes:
    return msgspec.msgpack.encode(list(records))


def decode_records(data: bytes) -> list[SampleMeta]:
    return msgspec.msgpack.decode(data, type=list[SampleMeta])


def decode_record(data: bytes) -> SampleMeta:
    return msgspec.msgpack.decode(data, type=SampleMeta)
