"""A short answer after a long prompt: the draft's prefill priced (``catch_up_pays``) against
always prefilling it. Writes JSON to benchmarks/results/.

    python benchmarks/catch_up.py                      # Qwen2.5-Coder pair, dtype auto
    python benchmarks/catch_up.py --tools 24 --short 24 --long 96

An agent framework sends its tool schemas with every call: a system prompt of a thousand tokens
or more, then a tool call of twenty. Drafting with a model first feeds the draft the whole
prompt; on a small CPU that prefill costs as many seconds as drafting saves over dozens of
tokens. The runtime now weighs the catch-up (measured draft forward costs) against what the
call's remaining tokens can save, and decodes without the draft model where it cannot pay.
Here: plain ``generate``; specagent ``lossless-auto`` as shipped (priced); and the same call
with the pricing switched off (the draft always catches up: the behaviour before), each output
checked against plain greedy; a short call (a tool call) and a long one (where the draft
should still be used). No prefix reuse: every call pays its own prefill, as a first turn does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specagent import RuntimeOptions, SpecRuntime
from specagent.chat import render_prompt
from specagent.decoding.drafters import DraftModelDrafter
from specagent.measuring.agent_bench import agent_policies
from specagent.measuring.baselines import baseline_methods
from specagent.measuring.records import dtypes_of, write_result

TOOL_NAMES = [
    "get_order", "cancel_order", "refund_order", "track_shipment", "update_address",
    "list_invoices", "get_invoice", "send_email", "create_ticket", "close_ticket",
    "search_products", "get_product", "check_stock", "reserve_stock", "get_customer",
    "update_customer", "list_payments", "charge_card", "schedule_call", "get_weather",
    "convert_currency", "translate_text", "summarise_document", "run_sql",
]  # fmt: skip


def tool_schemas(count: int) -> str:
    """``count`` tool definitions as an agent framework renders them (JSON schema per tool)."""
    tools = []
    for i, name in enumerate(TOOL_NAMES[:count]):
        words = name.replace("_", " ")
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": f"Use this tool to {words} for the current customer. "
                    f"Call it only when the user asks to {words}; never guess its arguments.",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "string", "description": f"Identifier ({i})."},
                            "reason": {"type": "string", "description": "Why, in one line."},
                            "urgent": {"type": "boolean", "description": "Whether it is urgent."},
                        },
                        "required": ["id"],
                    },
                },
            }
        )
    return (
        "You are a support agent. Answer with exactly one tool call as JSON "
        '{"name": ..., "arguments": {...}} when a tool fits.\n\nTools:\n'
        + json.dumps(tools, indent=1)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tools", type=int, default=8, help="tool schemas in the prompt")
    parser.add_argument("--short", type=int, default=24, help="max_new_tokens of the tool call")
    parser.add_argument("--long", type=int, default=96, help="max_new_tokens of the long answer")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    started = time.perf_counter()
    rt = SpecRuntime.from_pretrained(
        args.target,
        args.draft,
        policies=agent_policies(True),
        options=RuntimeOptions(prefix_cache_tokens=0),
        engine_options={"compile_steps": False},
    )
    system = tool_schemas(args.tools)
    calls = {
        "tool call": (
            "Please cancel order A-1042, the customer changed their mind.",
            args.short,
        ),
        "long answer": (
            "Without calling a tool: explain step by step how you would choose between "
            "cancel_order and refund_order for an order that has already shipped.",
            args.long,
        ),
    }
    priced = DraftModelDrafter.catch_up_pays

    def spec(ids: list[int], n: int, tenant: str, pricing: bool) -> tuple[list[int], float, Any]:
        DraftModelDrafter.catch_up_pays = priced if pricing else lambda self, context: True  # type: ignore[method-assign]
        if rt.history is not None:
            rt.history.clear()  # nothing drafted from the previous call's text
        start = time.perf_counter()
        out = rt.generate_sync(ids, policy="lossless-auto", max_new_tokens=n, tenant=tenant)
        return out.token_ids, time.perf_counter() - start, out.stats

    warm = render_prompt(
        [{"role": "user", "content": "Hi"}], rt.tokenizer, vocab_size=rt.vocab_size
    )
    baseline_methods(rt, 4)["plain"](warm, 0)
    spec(warm, 4, "warm", True)
    rt.wait_measured()
    rows: dict[str, Any] = {}
    for i, (name, (question, n)) in enumerate(calls.items()):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        ids = render_prompt(messages, rt.tokenizer, vocab_size=rt.vocab_size)
        plain = baseline_methods(rt, n)["plain"]
        start = time.perf_counter()
        reference, _ = plain(ids, 0)
        plain_s = time.perf_counter() - start
        fast, fast_s, fast_stats = spec(ids, n, f"priced-{i}", True)
        slow, slow_s, slow_stats = spec(ids, n, f"unpriced-{i}", False)
        rows[name] = {
            "prompt_tokens": len(ids),
            "max_new_tokens": n,
            "new_tokens": len(reference),
            "plain_seconds": round(plain_s, 2),
            "priced_seconds": round(fast_s, 2),
            "unpriced_seconds": round(slow_s, 2),
            "priced_vs_plain": round(plain_s / fast_s, 3),
            "unpriced_vs_plain": round(plain_s / slow_s, 3),
            "priced_accepted_by_source": dict(fast_stats.accepted_by_source),
            "unpriced_accepted_by_source": dict(slow_stats.accepted_by_source),
            "equal_to_plain": fast == reference and slow == reference,
        }
        print(name, rows[name], flush=True)
    DraftModelDrafter.catch_up_pays = priced  # type: ignore[method-assign]
    rt.close()
    result = {
        "target": args.target,
        "draft": args.draft,
        "precision": dtypes_of(rt),
        "tools": args.tools,
        "rows": rows,
    }
    path = write_result(result, args.out, f"catch-up_{Path(args.target).name}", started)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
