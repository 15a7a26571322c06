"""Many concurrent callers sharing one runtime, as in a web service's request handlers.

Shows streaming, per-call timeouts, cancellation, back-pressure (RuntimeOverloadedError) and the
per-call stats, with anyio (works the same under asyncio or trio).

    python examples/async_service.py [--target PATH_OR_CATALOG_NAME] [--calls 8]
"""

from __future__ import annotations

import argparse
import time

import anyio

from specagent import RuntimeOptions, RuntimeOverloadedError, SpecRuntime, shipped_policies

TICKETS = [
    "My parcel arrived damaged, what now?",
    "Can I change the delivery address of order A-20001?",
    "How do I return a pair of shoes?",
    "Do you ship to Norway?",
]


async def handle(runtime: SpecRuntime, i: int) -> None:
    messages = [{"role": "user", "content": TICKETS[i % len(TICKETS)]}]
    try:
        result = await runtime.generate(
            messages, policy="customer-reply", max_new_tokens=48, timeout=60
        )
    except RuntimeOverloadedError:
        print(f"call {i}: refused, runtime overloaded (retry later)")
        return
    except TimeoutError:
        print(f"call {i}: timed out after 60 s (its work stopped at the next step)")
        return
    s = result.stats
    print(
        f"call {i}: {s.tokens_per_s:5.1f} tok/s, ttft {s.ttft_s:.2f}s, "
        f"acceptance {s.acceptance_rate:.2f}: "
        f"{result.text[:60]!r}"
    )


async def main(target: str, calls: int, engine: str = "auto") -> None:
    runtime = SpecRuntime.from_pretrained(
        target, policies=shipped_policies(), engine=engine, options=RuntimeOptions(max_queue=64)
    )
    async with runtime:
        print("streaming one call:")
        async for chunk in runtime.stream(
            "Say hello to a new customer.", policy="customer-reply", max_new_tokens=24
        ):
            print(chunk.text, end="", flush=True)
        print()

        with anyio.move_on_after(0.5):  # a caller that gives up: its work stops at the next step
            await runtime.generate("Write a long essay.", max_new_tokens=500)
        print("a cancelled call freed its slot")

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(calls):
                tg.start_soon(handle, runtime, i)
        print(f"{calls} concurrent calls in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "transformers", "llama.cpp"],
        help="what runs the forwards (auto: llama.cpp for a GGUF model on a CPU)",
    )
    args = parser.parse_args()
    anyio.run(main, args.target, args.calls, args.engine)
