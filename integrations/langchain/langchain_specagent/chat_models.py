"""ChatSpecAgent: a LangChain chat model on a specagent runtime."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import LanguageModelInput, ModelProfile
from langchain_core.language_models.chat_models import (
    BaseChatModel,
    LangSmithParams,
    agenerate_from_stream,
    generate_from_stream,
)
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
)
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from opentelemetry import context as otel_context
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from specagent import IncompleteOutputError, SpecRuntime, load_policies, shipped_policies
from specagent.backend import Backend
from specagent.calls import CallSpec, run_call, split_model, tool_choice_name
from specagent.policy.sampling import MaxNewTokens, Seed, Temperature, TopK, TopLogprobs, TopP
from specagent.runtime.portal import iterate_sync

from ._structured import structured_output
from ._translate import final_chunk, text_chunk, to_chat_message

__all__ = ["ChatSpecAgent"]

POLICY_METADATA_KEY = "specagent_policy"
"""``config={"metadata": {"specagent_policy": "legal-drafting"}}`` picks a call's policy."""
TENANT_METADATA_KEY = "specagent_tenant"
"""``config={"metadata": {"specagent_tenant": "acme"}}`` names who a call is for: policies that
draft from earlier calls' text draft only from that tenant's."""


class ChatSpecAgent(BaseChatModel):
    """Chat model on a local model with speculative decoding, governed by specagent policies.

    Setup:
        ``pip install -e ".[dev]"`` in the specagent repository (or ``specagent[langchain]``).

    Instantiate (sharing one runtime between many chat models, one per default policy):
        .. code-block:: python

            from specagent import SpecRuntime, shipped_policies
            from langchain_specagent import ChatSpecAgent

            runtime = SpecRuntime.from_pretrained("/models/target", draft="/models/draft",
                                                  policies=shipped_policies())
            customer = ChatSpecAgent(runtime=runtime, policy="customer-reply")
            notes = ChatSpecAgent(runtime=runtime, policy="internal-summary", temperature=0.7)

        or from model paths, owning its runtime (built on first use):
        ``ChatSpecAgent(target="/models/target")`` (the shipped policies; ``policies="dir/"``
        adds to them and overrides those of the same name).

    Invoke:
        .. code-block:: python

            msg = customer.invoke([("system", "Be kind."), ("human", "Where is my parcel?")])
            msg.usage_metadata                   # input/output/total tokens
            msg.response_metadata["specagent"]   # policy, mode, acceptance, divergence, ...

    Per-call policy:
        .. code-block:: python

            customer.invoke("...", config={"metadata": {"specagent_policy": "legal-drafting"}})
            customer.invoke("...", config={"tags": ["summary", "internal"]})  # routed by tags

    Stream / Async / Batch:
        ``for chunk in customer.stream("Hi")``, ``await customer.ainvoke("Hi")``,
        ``async for chunk in customer.astream("Hi")``, ``customer.batch([...])``,
        ``await customer.abatch([...])``: all through the runtime's one async core.

    Tool calling:
        .. code-block:: python

            agent_model = customer.bind_tools([get_order_status], tool_choice="any")
            agent_model.invoke("Where is order 42?").tool_calls

        ``tool_choice`` "any"/"required" or a tool name is enforced by constrained decoding:
        the call is well formed and its arguments valid for the tool's schema.

    Structured output:
        ``customer.with_structured_output(Order)`` (``method`` "json_schema",
        "function_calling" or "json_mode"; ``include_raw=True`` keeps the message).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    runtime: Any = Field(default=None, exclude=True)
    """A shared ``SpecRuntime``. Without one, ``target`` is loaded on first use."""
    target: str | None = None
    """Path or hub id of the target model, when this chat model owns its runtime."""
    draft: str | None = None
    """Path or hub id of the draft model (optional), when this chat model owns its runtime."""
    policies: str | None = None
    """Policy directory for an owned runtime, added to the shipped policies (``customer-reply``,
    ``internal-summary``, ...), replacing those of the same name."""
    device: str = "auto"
    dtype: str = "auto"
    policy: str | None = None
    """Default policy name; a call's config metadata (``specagent_policy``) or tags override it."""
    model_name: str | None = Field(default=None, alias="model")
    """Name reported to LangSmith and in response metadata (default: the runtime's)."""
    # The sampling fields as a policy declares them (``specagent.policy.sampling``); None:
    # the policy's own.
    temperature: Temperature | None = None
    """Overrides the policy's temperature (never its mode)."""
    top_p: TopP | None = None
    top_k: TopK | None = None
    max_tokens: MaxNewTokens | None = None
    """Most new tokens per call (the policy's ``max_new_tokens`` when unset)."""
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    timeout: float | None = None
    """Seconds per call, queueing included."""
    max_retries: int = 2
    """Retries when the runtime is overloaded or a decoding step failed, before any output."""
    seed: Seed | None = None
    logprobs: bool | None = None
    """Each output token's log-probability under the target, in
    ``response_metadata["logprobs"]`` (``{"content": [...]}``, as ``ChatOpenAI`` gives them)."""
    top_logprobs: TopLogprobs | None = None
    """With ``logprobs``: that many most likely tokens at each position, with theirs."""
    tenant: str | None = None
    """Who this model's calls are for: policies that draft from earlier calls' text, and the
    prefix cache, share only within a tenant; calls with no tenant share nothing. When set, a
    call's ``specagent_tenant`` metadata (or ``tenant=``) may not name another one, unless
    ``allow_tenant_override``: metadata can come from a client, and must not pick whose text
    a call drafts from."""
    allow_tenant_override: bool = False
    """Let a call's metadata or ``tenant=`` name a tenant other than ``tenant`` (for a model
    shared by a trusted router that sets the tenant per call)."""
    streaming: bool = False
    """Kept for compatibility with LangChain's ``streaming=True``; ``invoke`` always works."""
    guard_answers: bool = True
    """An answer to a tool result with no tools bound starts as prose, not as an echo of the
    call or its JSON (``specagent.calls.ANSWER_AFTER_TOOLS``); with tools bound, a reply that
    only repeats a call already made and answered becomes an answer from its result
    (``CallSpec.repeat_guard``): small models need both, or an agent loop never ends."""

    _owned_runtime: SpecRuntime | None = PrivateAttr(default=None)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @model_validator(mode="after")
    def _needs_a_model(self) -> ChatSpecAgent:
        if self.runtime is None and self.target is None:
            raise ValueError("ChatSpecAgent needs runtime=SpecRuntime(...) or target='<path>'")
        if self.runtime is not None and not isinstance(self.runtime, Backend):
            msg = f"runtime must be a SpecRuntime (or a Backend), got {type(self.runtime).__name__}"
            raise ValueError(msg)
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        return self

    # ------------------------------------------------------------------ LangChain hooks

    @property
    def _llm_type(self) -> str:
        return "specagent"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self._model_name(),
            "policy": self.policy,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }

    def _resolve_model_profile(self) -> ModelProfile | None:
        """What this model can do, for LangChain's ``model.profile`` (agents read it to decide,
        for example, whether to ask for structured output natively). Text in and out; tool
        calling and tool choice and structured output by constrained decoding; the context
        window from the runtime's target when one is given (an owned runtime is not loaded
        just to answer this)."""
        profile = ModelProfile(
            open_weights=True,
            text_inputs=True,
            text_outputs=True,
            image_inputs=False,
            audio_inputs=False,
            video_inputs=False,
            pdf_inputs=False,
            image_tool_message=False,
            pdf_tool_message=False,
            reasoning_output=False,
            tool_calling=True,
            tool_choice=True,
            tool_call_streaming=True,
            structured_output=True,
            temperature=True,
        )
        window = getattr(self.runtime, "context_window", None)
        if isinstance(window, int):
            profile["max_input_tokens"] = window
        return profile

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="specagent",
            ls_model_name=kwargs.get("model") or self._model_name(),
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stops = stop or kwargs.get("stop") or self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._with_llm_output(
            generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        )

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._with_llm_output(
            await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))
        )

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        call, model = self._call_spec(messages, stop, run_manager, kwargs)
        async for chunk in self._chunks(call, model):
            if run_manager is not None and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        call, model = self._call_spec(messages, stop, run_manager, kwargs)
        options = {"parent_context": otel_context.get_current()}
        for chunk in iterate_sync(lambda: self._chunks(call, model, options)):
            if run_manager is not None and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    # ------------------------------------------------------------------ tools and structure

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (anything LangChain converts to an OpenAI tool). ``tool_choice``: "auto"
        (default), "none", "any"/"required"/True (some tool must be called), or a tool name;
        ``parallel_tool_calls=False``: at most one call per reply, as ``ChatOpenAI`` takes it."""
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        # Checked now, so a wrong name fails where it was written, not at the first call.
        tool_choice = tool_choice_name(tool_choice, [t["function"]["name"] for t in formatted])
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["function_calling", "json_mode", "json_schema"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """Output parsed into ``schema`` (a pydantic class, TypedDict or JSON schema). With
        "json_schema" (default) and "function_calling" the output is valid by constrained
        decoding; "json_mode" guarantees a JSON object. ``strict`` is accepted for API
        compatibility: constrained decoding is always strict."""
        if kwargs:
            raise ValueError(f"unexpected arguments: {sorted(kwargs)}")
        return structured_output(self, schema, method, include_raw)

    # ------------------------------------------------------------------ the one async core

    def _tenant(self, asked: Any) -> str | None:
        """The call's tenant: the model's own, unless overriding is allowed or it has none."""
        if asked is None or asked == self.tenant:
            return self.tenant
        if self.tenant is not None and not self.allow_tenant_override:
            msg = (
                f"this model serves tenant {self.tenant!r}; a call may not name another "
                f"(got {TENANT_METADATA_KEY} = {str(asked)[:64]!r}); set "
                "allow_tenant_override=True where a trusted caller picks the tenant"
            )
            raise ValueError(msg)
        return asked

    def _runtime(self) -> Backend:
        if self.runtime is not None:
            return self.runtime  # type: ignore[no-any-return]
        with self._lock:
            if self._owned_runtime is None:
                assert self.target is not None
                self._owned_runtime = SpecRuntime.from_pretrained(
                    self.target,
                    draft=self.draft,
                    policies=(
                        load_policies(self.policies, extends=shipped_policies())
                        if self.policies
                        else shipped_policies()
                    ),
                    device=self.device,
                    dtype=self.dtype,
                    model_name=self.model_name,
                )
            return self._owned_runtime

    def _model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.runtime is not None:
            return str(self.runtime.model_name)
        return str(self.target)

    def _call_spec(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
    ) -> tuple[CallSpec, str]:
        """Everything a call needs, translated from LangChain's arguments, and the model name
        its answer reports. A per-call ``model`` must be the runtime's model, or
        ``<model>:<policy>`` (``specagent.calls.split_model``); an explicit policy (argument or
        ``specagent_policy`` metadata) still comes first."""
        metadata = dict(getattr(run_manager, "metadata", None) or {})
        kwargs.pop("ls_structured_output_format", None)
        backend = self._runtime()
        model = kwargs.pop("model", None)
        model_policy = split_model(model, backend.model_name) if model else None
        stops = list(stop or []) + list(kwargs.pop("stop", None) or []) + list(self.stop or [])
        call = CallSpec.build(
            [to_chat_message(m) for m in messages],
            policy=kwargs.pop("policy", None)
            or metadata.get(POLICY_METADATA_KEY)
            or model_policy
            or None,
            tags=list(getattr(run_manager, "tags", None) or []),
            tenant=self._tenant(kwargs.pop("tenant", None) or metadata.get(TENANT_METADATA_KEY)),
            default_policy=self.policy,
            tools=kwargs.pop("tools", None),
            tool_choice=kwargs.pop("tool_choice", None),
            response_format=kwargs.pop("response_format", None),
            stop=stops,
            temperature=kwargs.pop("temperature", self.temperature),
            top_p=kwargs.pop("top_p", self.top_p),
            top_k=kwargs.pop("top_k", self.top_k),
            max_tokens=kwargs.pop("max_tokens", self.max_tokens),
            seed=kwargs.pop("seed", self.seed),
            logprobs=self._logprobs(kwargs),
            timeout=kwargs.pop("timeout", self.timeout),
            answer_guard=self.guard_answers,
            repeat_guard=self.guard_answers,
            prediction=kwargs.pop("prediction", None),
            parallel_tool_calls=kwargs.pop("parallel_tool_calls", None),
        )
        if kwargs:
            raise TypeError(f"ChatSpecAgent got unexpected call arguments: {sorted(kwargs)}")
        return call, model or self._model_name()

    def _logprobs(self, kwargs: dict[str, Any]) -> int | None:
        """``Call.logprobs`` from the call's or the model's ``logprobs`` and ``top_logprobs``."""
        wanted = kwargs.pop("logprobs", self.logprobs)
        top = kwargs.pop("top_logprobs", self.top_logprobs)
        if top is not None and not wanted:
            raise ValueError("top_logprobs needs logprobs=True")
        return (top or 0) if wanted else None

    async def _chunks(
        self, call: CallSpec, model: str, options: dict[str, Any] | None = None
    ) -> AsyncIterator[ChatGenerationChunk]:
        """Run one call (``specagent.calls.run_call``) and translate its chunks."""
        if options:
            call = dataclasses.replace(call, call=dataclasses.replace(call.call, **options))
        try:
            async for chunk in run_call(self._runtime(), call, self.max_retries):
                if chunk.result is None:
                    yield text_chunk(chunk)
                else:
                    yield final_chunk(chunk, model)
        except IncompleteOutputError as exc:
            raise OutputParserException(str(exc), llm_output=exc.output) from exc

    def _with_llm_output(self, result: ChatResult) -> ChatResult:
        """``llm_output`` with token usage, as OpenAI-style integrations report it."""
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for generation in result.generations:
            metadata = getattr(generation.message, "usage_metadata", None) or {}
            usage["prompt_tokens"] += metadata.get("input_tokens", 0)
            usage["completion_tokens"] += metadata.get("output_tokens", 0)
            usage["total_tokens"] += metadata.get("total_tokens", 0)
        result.llm_output = {"token_usage": usage, "model_name": self._model_name()}
        return result

    def _combine_llm_outputs(self, llm_outputs: list[dict[str, Any] | None]) -> dict[str, Any]:
        """``llm_output`` with summed token usage (what OpenLLMetry and callbacks read)."""
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for output in llm_outputs:
            for key, value in ((output or {}).get("token_usage") or {}).items():
                usage[key] = usage.get(key, 0) + value
        return {"token_usage": usage, "model_name": self._model_name()}
