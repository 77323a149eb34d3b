"""One engine replica: the body of the Ray actor that ``pipeline.execute.ray.driver`` starts (one ``engine.LLM`` each).

Plain Python (no ``import ray`` at module level); ``pipeline.execute.ray.driver`` wraps the class with ``ray.remote``.
The driver calls ``work`` with the units it hands this replica (``pipeline.execute.ray.assign``); each call adds their
requests (priority = plan position, as in a local run, so a group's provider computes the shared blocks first), pins
each unit's shared head while the unit runs, steps the engine for at most ``max_s`` seconds and returns what
finished plus the steps it took. Results go back to the driver, which alone commits them.

Test hook ``BATCHGEN_RAY_FAULT`` (read by the driver, passed here; several joined by commas):
    ``exit-at-call:R:N``  the first incarnation of replica R calls ``os._exit`` in its N-th ``work`` call
    ``exit-on:P``         any replica exits when it is handed plan position P (a request that kills its engine)
    ``exit-once-on:P:F``  the first replica handed position P exits, creating file F (so only one ever does)
    ``step-delay:S``      sleep S seconds after every engine step (a tiny model's run lasts long enough to kill)

Bench hook ``BATCHGEN_RAY_ENGINE=module:name`` (read by the driver, passed here): each replica builds
``name(config)`` instead of ``engine.LLM`` (``bench/pipeline_double.py --ray``: the driver's memory against rows
with an engine test double in the replicas).
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import socket
import time

from engine import EngineConfig
from pipeline.execute.execution import step_delay


class Replica:
    def __init__(self, index: int, incarnation: int, config: EngineConfig, threads: int, fault: str = "",
                 engine: str = ""):
        import torch  # NOTE: in the actor only: the driver's process never needs torch for this module
        torch.set_num_threads(max(1, threads))          # before any torch op in this process
        t0 = time.monotonic()
        config = dataclasses.replace(config, num_threads=max(1, threads))
        if engine:                                      # the bench hook above
            module, _, name = engine.partition(":")
            self.llm = getattr(importlib.import_module(module), name)(config)
        else:
            from engine import LLM
            self.llm = LLM(config=config)
        self.load_s = time.monotonic() - t0
        self.index, self.incarnation, self.threads = index, incarnation, threads
        self.faults = [f.strip() for f in fault.split(",") if f.strip()]
        self.step_delay = step_delay(self.faults)
        self.calls = 0
        self._unit_left: dict[int, int] = {}          # unit id -> requests not finished
        self._unit_pin: dict[int, int | None] = {}
        self._unit_of: dict[str, int] = {}            # request id -> unit id

    def hello(self) -> dict:
        import ray  # NOTE: runs inside a Ray actor; module level would make Ray a hard dependency
        return {"info": self.llm.info, "pid": os.getpid(), "host": socket.gethostname(),
                "node": ray.get_runtime_context().get_node_id(), "load_s": self.load_s, "threads": self.threads,
                "now": time.monotonic()}

    def work(self, units: list[tuple[int, list[int], list[tuple[int, list[int], object]]]], max_s: float) -> dict:
        """``units``: (unit id, shared head token ids, [(plan position, prompt token ids, SamplingParams)])."""
        self.calls += 1
        self._maybe_fail(call=self.calls)
        llm = self.llm
        for uid, head, requests in units:
            self._unit_pin[uid] = llm.pin_prefix(head) if head else None
            self._unit_left[uid] = len(requests)
            for pos, ids, params in requests:
                self._maybe_fail(position=pos)
                llm.add_request(str(pos), ids, params, priority=pos)
                self._unit_of[str(pos)] = uid
        t0 = time.monotonic()
        outs, steps = [], []
        while llm.has_unfinished_requests():
            finished, stats = llm.step()
            outs.extend(finished)
            steps.append(stats)
            if self.step_delay:
                time.sleep(self.step_delay)
            if time.monotonic() - t0 >= max_s:
                break
        for out in outs:
            uid = self._unit_of.pop(out.request_id)
            self._unit_left[uid] -= 1
            if not self._unit_left[uid]:
                del self._unit_left[uid]
                pin = self._unit_pin.pop(uid)
                if pin is not None:
                    llm.unpin_prefix(pin)
        return {"outputs": outs, "steps": steps, "now": time.monotonic()}

    def _maybe_fail(self, call: int | None = None, position: int | None = None) -> None:
        for f in self.faults:
            kind, _, arg = f.partition(":")
            if kind == "exit-at-call" and call is not None and self.incarnation == 0:
                r, _, n = arg.partition(":")
                if int(r) == self.index and int(n) == call:
                    os._exit(1)
            if kind == "exit-on" and position is not None and int(arg) == position:
                os._exit(1)
            if kind == "exit-once-on" and position is not None and int(arg.partition(":")[0]) == position:
                try:
                    os.close(os.open(arg.partition(":")[2], os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    continue
                os._exit(1)


__all__ = ["Replica"]
