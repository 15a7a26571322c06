"""A LangChain 1.x agent (``langchain.agents.create_agent``) on a local model through specagent.

The agent calls a tool, reads its result and answers the customer under the lossless
``customer-reply`` policy; then a second agent returns a typed object (``response_format``).
On small models two guards keep the loop short: a reply that only repeats a tool call already
answered becomes an answer from its result, and an answer to a tool result starts as prose.

    python examples/langchain_agent.py                      # Qwen2.5-Coder-0.5B from the index
    python examples/langchain_agent.py --target qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse

from langchain.agents import create_agent
from langchain_core.tools import tool
from pydantic import BaseModel

from langchain_specagent import ChatSpecAgent
from specagent import SpecRuntime, shipped_policies


@tool
def order_status(order_id: str) -> str:
    """Look up where a customer's order is, by its id (for example A-10234)."""
    return f"Order {order_id}: delayed at the regional depot, now arriving Thursday."


class Ticket(BaseModel):
    """A support ticket, as the triage step files it."""

    order_id: str
    topic: str
    urgent: bool


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--draft", default=None)
    parser.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "transformers", "llama.cpp"],
        help="what runs the forwards (auto: llama.cpp for a GGUF model on a CPU)",
    )
    args = parser.parse_args()
    runtime = SpecRuntime.from_pretrained(
        args.target, draft=args.draft, policies=shipped_policies(), engine=args.engine
    )
    # Greedy per call (the policy samples at 0.3): the same run every time, token for token.
    # One shop (tenant): the agent's turns reuse each other's KV and text.
    model = ChatSpecAgent(
        runtime=runtime, policy="customer-reply", max_tokens=80, temperature=0.0, tenant="shop"
    )

    agent = create_agent(
        model,
        tools=[order_status],
        system_prompt="You are a support agent. Look the order up, then answer in one sentence.",
    )
    state = agent.invoke(
        {"messages": [{"role": "user", "content": "Where is my order A-10234? - Maria"}]}
    )
    for message in state["messages"]:
        calls = getattr(message, "tool_calls", None)
        shown = f"calls {[(c['name'], c['args']) for c in calls]}" if calls else message.content
        print(f"{message.type:>5}: {shown}")

    triage = create_agent(model, tools=[], response_format=Ticket)
    filed = triage.invoke(
        {
            "messages": [
                {
                    "role": "user",
                    "content": "File this: order A-10234 is late and the customer is upset.",
                }
            ]
        }
    )
    print(f"filed: {filed['structured_response']!r}")
    runtime.close()


if __name__ == "__main__":
    main()
