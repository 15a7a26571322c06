"""A LangChain support agent with two tools on a local model, governed by policies.

The agent loop decides which tool to call (constrained decoding keeps every call well formed),
then answers the customer under the lossless ``customer-reply`` policy, and writes an internal
summary that the run's tags route to the relaxed ``internal-summary`` policy.

    python examples/support_agent.py                        # SmolLM2-135M from the package index
    python examples/support_agent.py --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import json
from typing import Annotated, Literal

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import Field

from langchain_specagent import ChatSpecAgent
from specagent import SpecRuntime, load_policies, shipped_policies

ORDERS = {"A-10234": {"status": "delayed at the regional depot", "eta": "Thursday"}}
POLICY_TEXT = {
    "late": "Late parcels: apologise, give the new date, offer free shipping next time.",
    "refund": "Refunds within 30 days of delivery, to the original payment method.",
    "damaged": "Damaged goods: replace free of charge; no need to send them back.",
}


@tool
def lookup_order(order_id: Annotated[str, Field(pattern=r"^[A-Z]-[0-9]{5}$")]) -> str:
    """Look up an order's delivery status by its id, e.g. A-10234."""
    return json.dumps(ORDERS.get(order_id, {"status": "not found"}))


@tool
def shop_policy(topic: Literal["late", "refund", "damaged"]) -> str:
    """Read the shop's policy on a topic: 'late', 'refund' or 'damaged'."""
    return POLICY_TEXT.get(topic, "No policy on that topic.")


TOOLS = {t.name: t for t in (lookup_order, shop_policy)}


def run_agent(model: ChatSpecAgent, ticket: str, max_steps: int = 2) -> list[BaseMessage]:
    """Call tools until the model has the facts (each step's call is forced to be valid)."""
    messages: list[BaseMessage] = [
        SystemMessage("You are a support agent. Look up the order, then the relevant policy."),
        HumanMessage(ticket),
    ]
    for _ in range(max_steps):
        step: AIMessage = model.bind_tools(list(TOOLS.values()), tool_choice="any").invoke(messages)
        messages.append(step)
        for call in step.tool_calls:
            result = TOOLS[call["name"]].invoke(call)
            print(f"  tool {call['name']}({call['args']}) -> {result.content}")
            messages.append(result)
    return messages


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
    parser.add_argument(
        "--policies", default=None, help="policy directory added to the shipped policies"
    )
    args = parser.parse_args()

    shipped = shipped_policies()
    policies = load_policies(args.policies, extends=shipped) if args.policies else shipped
    runtime = SpecRuntime.from_pretrained(
        args.target, draft=args.draft, policies=policies, engine=args.engine
    )
    model = ChatSpecAgent(runtime=runtime, policy="customer-reply", max_tokens=160, tenant="shop")
    ticket = "Hi, my order A-10234 should have arrived on Monday. Where is it? - Maria"

    print("agent steps:")
    history = run_agent(model, ticket)
    facts = "\n".join(m.content for m in history if isinstance(m, ToolMessage))

    answer = model.invoke(
        [
            SystemMessage("Answer the customer kindly in at most four sentences."),
            HumanMessage(f"{ticket}\n\nFacts:\n{facts}"),
        ]
    )
    print(f"\ncustomer answer ({answer.response_metadata['specagent']['mode']}):\n{answer.content}")

    summary = model.invoke(
        [
            SystemMessage("Summarise the ticket for the internal team in one sentence."),
            HumanMessage(f"{ticket}\nFacts: {facts}\nAnswer sent: {answer.content}"),
        ],
        config={"tags": ["summary", "internal"]},  # routed to internal-summary (relaxed)
    )
    meta = summary.response_metadata["specagent"]
    print(
        f"\ninternal summary ({meta['mode']}, divergence {meta['divergence']:.3f}):\n"
        f"{summary.content}"
    )
    runtime.close()


if __name__ == "__main__":
    main()
