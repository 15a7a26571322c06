"""``specagent demo``: a small LangChain support agent on a real local model.

One ticket, three calls on one shared runtime:

1. the agent looks the order up: a tool call, forced and made valid by constrained decoding;
2. the answer to the customer, under ``customer-reply`` (lossless: exactly the model's output);
3. a two-line case note for the support team's log, routed by its tags to
   ``internal-summary`` (relaxed).

Then a table per call: policy, mode, drafter, tokens, acceptance, latency, tokens/s, divergence.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from ..catalog import PAIRS
from ..errors import SpecAgentError
from .parser import DEFAULT_MODEL

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


FACTS = ("Thursday", "NordPost")
"""What a correct answer to the ticket must mention: the new delivery day and the carrier."""


def run_demo(pair: str | None = None, policies: Any = None, engine: str = "auto") -> int:
    """Run the demo; 0 when the tool call and the answers carry the order's facts, else 1.

    ``policies``: a ``PolicySet`` or directory (default: the shipped policies).
    """
    try:
        from langchain_core.messages import HumanMessage, SystemMessage
        from langchain_core.tools import tool
        from pydantic import Field

        from langchain_specagent import ChatSpecAgent
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SpecAgentError(
            'the demo needs the LangChain extra: pip install "specagent[langchain]"'
        ) from exc
    runtime = _loaded(pair, policies, engine)

    @tool
    def lookup_order(
        order_id: str = Field(pattern=r"^[A-Z]-[0-9]{5}$", description="e.g. A-10234"),
    ) -> dict:
        """Look up an order's delivery status by its id."""
        return ORDERS.get(order_id, {"status": "not found"})

    # Greedy (the policy's 0.3 overridden per call): lossless greedy output is the target's own
    # greedy output token for token, so every run shows the same answers. Sampled at 0.3, the
    # 0.5B model's answer left out the new delivery date in some runs.
    # One shop's session: its calls share history and prefix KV (calls with no tenant share none).
    agent = ChatSpecAgent(
        runtime=runtime,
        policy="customer-reply",
        max_tokens=160,
        temperature=0.0,
        tenant="demo-shop",
    )
    calls: list[tuple[str, Any, float]] = []

    def timed(label: str, fn: Any) -> Any:
        start = time.perf_counter()
        message = fn()
        calls.append((label, message, time.perf_counter() - start))
        return message

    system = SystemMessage(
        "You are a friendly support agent for an online shop. Write your reply to the "
        "customer: greet them by name, then give the order's status, new delivery date, "
        "carrier and compensation from the order data you looked up, in at most four sentences."
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

    # The team's case note: a different job from the reply (two labelled lines for the log,
    # written from the ticket and the lookup, not from the reply), under the relaxed policy
    # its tags route to.
    note = timed(
        "case note",
        lambda: agent.invoke(
            [
                SystemMessage(
                    "You keep the support team's case log; customers never see it. Write "
                    "exactly two lines and nothing else:\n"
                    "Case: <customer name>, order <order id>: <the problem, a few words>\n"
                    "Outcome: <what the lookup found>; <what the customer was offered>"
                ),
                HumanMessage(f"Ticket: {TICKET}\nOrder lookup: {tool_message.content}"),
            ],
            config={"tags": ["summary", "internal"]},
            max_tokens=80,
        ),
    )
    print(f"\n[case note for the support team, relaxed]\n{note.content}\n")
    _table(calls)
    runtime.close()
    problems = _check(call["args"], str(answer.content))
    for problem in problems:
        print(f"check failed: {problem}", file=sys.stderr)
    if not problems:
        print("\nchecks passed: the tool call names the order; the answer gives its facts")
    return 1 if problems else 0


def _loaded(pair: str | None, policies: Any, engine: str) -> Any:
    """The demo's runtime, saying what it loads, which engine runs it and in which dtype."""
    from ..engines import describe
    from ..policy import shipped_policies
    from ..runtime import SpecRuntime

    target, draft = PAIRS[pair] if pair else (DEFAULT_MODEL, None)
    print(
        f"loading {target}" + (f" with draft {draft}" if draft else " (drafting by prompt lookup)"),
        flush=True,
    )
    runtime = SpecRuntime.from_pretrained(
        target,
        draft=draft,
        policies=policies if policies is not None else shipped_policies(),
        engine=engine,
    )
    for line in describe(runtime.engine_choice):
        print(line, flush=True)
    for role, choice in runtime.precision.items():
        print(f"{role} runs in {choice['dtype']}: {choice['reason']}", flush=True)
    return runtime


def _check(tool_args: dict, answer: str) -> list[str]:
    """What a reader would catch: a tool call for the wrong order, an answer without the facts
    the lookup returned."""
    problems = []
    if tool_args.get("order_id") != "A-10234":
        problems.append(f"the tool call asked for {tool_args!r}, not order A-10234")
    missing = [fact for fact in FACTS if fact.lower() not in answer.lower()]
    if missing:
        problems.append(f"the customer answer does not mention {', '.join(missing)}")
    return problems


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
