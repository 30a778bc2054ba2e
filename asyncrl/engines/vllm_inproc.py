"""An asyncio face for vLLM's in-process engine: the subset of `AsyncLLM` the server uses.

Job: let `VLLMRolloutServer` run vLLM without an engine-core process (`LLMEngine` with
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni"). On CPU it starts in seconds instead of
20-25 s, which is what tests and the embedded default want.

Why it exists: in vllm 0.32 `AsyncLLM` always starts a separate engine-core process
(`make_async_mp_client`); in-process mode is only offered by the synchronous `LLMEngine`.

Boundary and rules:
- One worker thread owns the engine: it is built there and every call (`add_request`, `step`,
  `abort_request`, `collective_rpc`, ...) runs there, so calls never overlap and the event loop
  stays free while a step runs. A background task steps while requests are in flight.
- `generate` yields DELTA `RequestOutput`s like `AsyncLLM.generate`. An aborted request ends
  with an output whose `finish_reason` is "abort" (`LLMEngine` emits nothing on abort).
- `pause_generation(mode)`: "abort" aborts everything in flight; "wait" returns when nothing is
  in flight; "keep" stops stepping (requests stay in place) until `resume_generation`.
  Holding back new requests while paused is the caller's job (the server does it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

_ABORTED = object()


@dataclass
class _Request:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class InprocAsyncEngine:
    live = 0
    """In-process engines alive in this process: at most one, since vLLM keeps the forward
    context and parallel state in module globals that two stepping engines would share."""

    def __init__(self, engine_args: Any) -> None:
        from vllm.v1.engine.llm_engine import LLMEngine

        if InprocAsyncEngine.live:
            raise RuntimeError("one in-process vLLM engine per process: close the other one, use "
                               "in_process=False, or run servers in separate processes")
        InprocAsyncEngine.live += 1
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm-inproc")
        try:
            self._engine = self._pool.submit(LLMEngine.from_engine_args, engine_args).result()
        except BaseException:
            InprocAsyncEngine.live -= 1
            self._pool.shutdown()
            raise
        self._requests: dict[str, _Request] = {}
        self._frozen = False
        self._wake: asyncio.Event | None = None
        self._stepper: asyncio.Task | None = None

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _ensure_stepper(self) -> asyncio.Event:
        if self._stepper is None:
            self._wake = asyncio.Event()
            self._stepper = asyncio.get_running_loop().create_task(self._step_loop())
        if self._stepper.done():  # a failed step: surface it to every later caller
            self._stepper.result()
        assert self._wake is not None
        return self._wake

    async def _step_loop(self) -> None:
        assert self._wake is not None
        try:
            while True:
                if not self._requests or self._frozen:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                for out in await self._call(self._engine.step):
                    req = self._requests.get(out.request_id)
                    if req is None:
                        continue
                    if out.finished:
                        del self._requests[out.request_id]
                    req.queue.put_nowait(out)
        except BaseException as exc:  # the engine died: fail every waiter with the cause
            for req in self._requests.values():
                req.queue.put_nowait(exc)
            raise

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str) -> AsyncIterator[Any]:
        wake = self._ensure_stepper()
        req = _Request()
        self._requests[request_id] = req
        try:
            await self._call(self._engine.add_request, request_id, prompt, sampling_params)
        except BaseException:
            self._requests.pop(request_id, None)
            raise
        wake.set()
        try:
            while True:
                item = await req.queue.get()
                if item is _ABORTED:
                    yield _abort_output(request_id)
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:  # the caller went away (cancelled, or stopped iterating): stop the request too
            if self._requests.pop(request_id, None) is not None and self._engine is not None:
                self._pool.submit(self._engine.abort_request, [request_id])

    async def abort(self, request_ids: list[str]) -> None:
        ids = [r for r in request_ids if r in self._requests]
        if not ids:
            return
        await self._call(self._engine.abort_request, ids)
        for rid in ids:
            req = self._requests.pop(rid, None)
            if req is not None:
                req.queue.put_nowait(_ABORTED)

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = False) -> None:
        if mode == "abort":
            await self.abort(list(self._requests))
        elif mode == "wait":
            while self._requests:
                self._ensure_stepper()
                await asyncio.sleep(0.005)
        elif mode == "keep":
            self._frozen = True
            await self._call(lambda: None)  # returns once a step in progress has finished
            while any(not r.queue.empty() for r in self._requests.values()):
                await asyncio.sleep(0)  # let consumers take the outputs of that last step
        else:
            raise ValueError(f"pause mode must be abort, wait or keep, got {mode!r}")
        if clear_cache:
            await self.reset_prefix_cache()

    async def resume_generation(self) -> None:
        self._frozen = False
        if self._wake is not None:
            self._wake.set()

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list[Any]:
        return await self._call(self._engine.collective_rpc, method, timeout, args, kwargs)

    async def update_weight_version(self, version: str) -> None:
        await self._call(self._engine.set_weight_version, version)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return await self._call(self._engine.reset_prefix_cache, reset_running_requests)

    def shutdown(self) -> None:
        if self._stepper is not None and not self._stepper.done():
            self._stepper.cancel()
        engine, self._engine = self._engine, None
        if engine is not None:
            InprocAsyncEngine.live -= 1
            self._pool.submit(engine.engine_core.shutdown).result()
        self._pool.shutdown(wait=True)


def _abort_output(request_id: str) -> Any:
    """A final DELTA output with no new tokens and finish_reason "abort"."""
    from vllm.outputs import CompletionOutput, RequestOutput

    comp = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=[],
                            finish_reason="abort")
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=None,
                         prompt_logprobs=None, outputs=[comp], finished=True)
