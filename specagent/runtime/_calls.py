"""One call's way through a runtime (``CallPath``): its tenant, its admission in the
principal's turn (``_gate``, ``_admission``), the worker, its chunks assembled into text and the
result (``_assembly``), its span (``telemetry``) and its audit row (``_audit``), within one
deadline."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
from opentelemetry import context as otel_context

from ..call import Call
from ..errors import CallTimeoutError, InvalidRequestError
from ..results import StreamChunk
from ..telemetry import CallSpan, Telemetry
from ..tenants import tenant_of
from ._admission import Admission, CallPlan
from ._assembly import CallAssembler
from ._audit import CallFacts, record_call, status_of
from ._gate import AdmissionGate
from ._worker import AsyncSink, Job, Worker

if TYPE_CHECKING:
    from ..audit import AuditStore

__all__ = ["CallPath"]


@dataclass
class CallPath:
    """What a runtime's calls pass through, from its ``run`` to the last chunk."""

    admission: Admission
    gate: AdmissionGate
    """Admissions fair across principals, each within its call's deadline."""
    telemetry: Telemetry
    audit: AuditStore | None
    """Where every call's row goes (None: no audit)."""
    worker: Callable[[], Worker]
    """The runtime's worker, started if it is not running."""
    decode_text: Callable[[Sequence[int]], str]
    engine: str
    token_bytes: Callable[[int], bytes | None]
    """A token's own bytes, for log-probabilities (``specagent.token_bytes``)."""

    async def run(self, call: Call, streaming: bool) -> AsyncGenerator[StreamChunk, None]:
        """The call's chunks; ``streaming`` says whether the caller receives them as they come
        (the conventions report time to first chunk only then) or the whole result. The audit
        store gets the call's row however it ends, unless ``call.record`` is False."""
        # An absolute deadline, admission included, checked around each wait: a cancel scope
        # held across the ``yield``s below would fire inside the caller's own code.
        timeout = call.timeout
        deadline = anyio.current_time() + timeout if timeout is not None else math.inf
        facts = CallFacts(self.audit if call.record else None)
        try:
            try:
                who = tenant_of(call.tenant)
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from None
            facts.tenant = who
            # Off the event loop (rendering a template, tokenizing a long prompt or compiling
            # a grammar must not pause every other call's stream on this loop), in the
            # principal's turn, within the call's deadline.
            plan = facts.plan = await self.gate.admit(
                who.principal if who is not None else None,
                lambda tokenizer: self.admission.plan(call, who, tokenizer=tokenizer),
                timeout,
            )
        except BaseException as exc:
            self._record(facts, status_of(exc))
            raise
        span = self._start_span(plan, call.parent_context, streaming)
        facts.trace_id = span.trace_id
        # A caller who waits for the whole result is woken once, at the end (``AsyncSink``).
        sink = AsyncSink(eager=streaming)
        job = Job(plan, sink, alone=plan.reproducible)
        finished = False
        try:
            started = time.perf_counter()  # before the worker can emit a token
            self.worker().submit(job)
            assembler = CallAssembler(
                plan, started, self.decode_text, streaming, token_bytes=self.token_bytes
            )
            while True:
                got = None
                with anyio.move_on_after(deadline - anyio.current_time()):
                    got = await sink.get()
                if got is None:
                    raise CallTimeoutError(f"the call passed its deadline of {timeout} s")
                kind, payload = got
                if kind == "error":
                    raise payload
                if kind == "done":
                    last, result = assembler.finish(payload, sink.first_token_at)
                    result = facts.result = dataclasses.replace(result, trace_id=span.trace_id)
                    self.telemetry.end_call(span, result)
                    self._record(facts, "ok")
                    finished = True
                    yield dataclasses.replace(last, result=result)
                    return
                chunk = assembler.chunk(payload)
                if chunk is not None:
                    self.telemetry.chunk(span)
                    yield chunk
        except BaseException as exc:
            self.telemetry.fail_call(span, exc)
            if not finished:
                self._record(facts, status_of(exc))
            raise
        finally:
            job.cancelled.set()
            if not finished:
                self.telemetry.fail_call(span, GeneratorExit("stream closed before it finished"))
                self._record(facts, "cancelled")

    def _record(self, facts: CallFacts, status: str) -> None:
        """The call's audit row, once (``facts.audit``: the store, None: not recorded here)."""
        record_call(facts, status, self.engine, self.telemetry.model_name)

    def _start_span(
        self, plan: CallPlan, parent: otel_context.Context | None, streaming: bool
    ) -> CallSpan:
        policy = plan.policy
        return self.telemetry.start_call(
            policy=policy.name,
            mode=policy.mode,
            drafter=plan.drafter.kind,
            temperature=plan.params.temperature,
            top_p=plan.params.top_p,
            max_tokens=plan.max_new_tokens,
            seed=plan.seed,
            record_content=policy.telemetry.record_content,
            prompt=plan.prompt,
            parent=parent,
            streaming=streaming,
        )
