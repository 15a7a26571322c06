"""``specagent demo``: a small LangChain support agent on a real local model.

One ticket, three calls on one shared runtime:

1. the agent looks the order up: a tool call, forced and made valid by constrained decoding;
2. the answer to the customer, under ``customer-reply`` (lossless: exactly the model's output);
3. an internal summary for the team, routed by its tags to ``internal-summary`` (relaxed).

Then a table per call: policy, mode, drafter, tokens, acceptance, latency, tokens/s, divergence.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from ..catalog import PAIRS
from ..errors import SpecAgentError

__all__ = ["run_demo"]

TICKET = (
    "Hi, this is Maria Lopez. My order A-10234 was supposed to arrive last Monday and it still "
    "hasn't come. Can you tell me where it is? Thanks."
)
ORDERS = {
    "A-10234": {
        "status": "delayed at the regional depot",
        "new_delivery_date": "Thursday",
        "carrier": "NordPost",
        "compensation": "free shipping on the next order",
    },
}


def run_demo(pair: str | None = None, policies: str = "policies") -> int:
    try:
        from langchain_core.messages import HumanMessage, SystemMessage
        from langchain_core.tools import tool
        from pydantic import Field

        from langchain_specagent import ChatSpecAgent
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SpecAgentError(
            'the demo needs the LangChain extra: pip install "specagent[langchain]"'
        ) from exc
    from ..runtime import SpecRuntime

    target, draft = PAIRS[pair] if pair else ("smollm2-135m-instruct", None)
    print(
        f"loading {target}" + (f" with draft {draft}" if draft else " (drafting by prompt lookup)"),
        flush=True,
    )
    runtime = SpecRuntime.from_pretrained(target, draft=draft, policies=policies)
    for role, choice in runtime.precision.items():
        print(f"{role} runs in {choice['dtype']}: {choice['reason']}", flush=True)

    @tool
    def lookup_order(
        order_id: str = Field(pattern=r"^[A-Z]-[0-9]{5}$", description="e.g. A-10234"),
    ) -> dict:
        """Look up an order's delivery status by its id."""
        return ORDERS.get(order_id, {"status": "not found"})

    agent = ChatSpecAgent(runtime=runtime, policy="customer-reply", max_tokens=160)
    calls: list[tuple[str, Any, float]] = []

    def timed(label: str, fn: Any) -> Any:
        start = time.perf_counter()
        message = fn()
        calls.append((label, message, time.perf_counter() - start))
        return message

    system = SystemMessage(
        "You are a friendly support agent for an online shop. Answer the "
        "customer in at most four sentences, using the order data you looked up."
    )
    human = HumanMessage(TICKET)
    request = timed(
        "tool call",
        lambda: agent.bind_tools([lookup_order], tool_choice="lookup_order").invoke(
            [system, human], config={"tags": ["customer"]}, max_tokens=60
        ),
    )
    call = request.tool_calls[0]
    tool_message = lookup_order.invoke(call)
    print(f"\n[agent] called lookup_order({call['args']}) -> {tool_message.content}")

    answer = timed("customer answer", lambda: agent.invoke([system, human, request, tool_message]))
    print(f"\n[customer answer, lossless]\n{answer.content}")

    summary = timed(
        "internal summary",
        lambda: agent.invoke(
            [
                SystemMessage("Summarise support tickets for the internal team in two sentences."),
                HumanMessage(
                    f"Ticket: {TICKET}\nOrder data: {tool_message.content}\n"
                    f"Reply sent: {answer.content}"
                ),
            ],
            config={"tags": ["summary", "internal"]},
        ),
    )
    print(f"\n[internal summary, relaxed]\n{summary.content}\n")
    _table(calls)
    runtime.close()
    return 0


def _table(calls: list[tuple[str, Any, float]]) -> None:
    columns = [
        ("call", "18"),
        ("policy", "18"),
        ("mode", "9"),
        ("drafter", "14"),
        ("in", ">5"),
        ("out", ">5"),
        ("accept", ">7"),
        ("tok/fwd", ">7"),
        ("latency", ">8"),
        ("tok/s", ">7"),
        ("diverg.", ">8"),
    ]
    header = " ".join(f"{name:{spec}}" for name, spec in columns)
    print(header)
    print("-" * len(header))
    for label, message, seconds in calls:
        meta = message.response_metadata["specagent"]
        usage = message.usage_metadata or {}
        divergence = meta.get("divergence")
        print(
            f"{label:18s} {meta['policy']:18s} {meta['mode']:9s} {meta['drafter']:14s} "
            f"{usage.get('input_tokens', 0):5d} {usage.get('output_tokens', 0):5d} "
            f"{meta['acceptance_rate']:7.2f} {meta['mean_acceptance_length']:7.2f} "
            f"{seconds:7.2f}s {meta['tokens_per_s']:7.1f} "
            f"{'-' if divergence is None else f'{divergence:.3f}':>8s}"
        )
    sys.stdout.flush()
