"""Agent workloads through the runtime: drafting from earlier calls within a tenant only,
`auto` choosing between history, the draft model and plain decoding, grammar-forced tokens, and
greedy outputs equal to plain decoding across multi-turn episodes."""

from __future__ import annotations

import asyncio

import pytest
from conftest import PinnedCosts

from policies import make_policy
from specagent import InvalidRequestError, RuntimeOptions, SpecRuntime
from specagent.grammar import Constraint

PLAIN = make_policy("plain")


def _history(kind: str, history: str, **extra: object) -> dict:
    return {"kind": kind, "num_speculative_tokens": 8, "history": history, **extra}


SUFFIX_TENANT = make_policy("suffix-tenant", _history("suffix", "tenant"))
AUTO_TENANT = make_policy("auto-tenant", _history("auto", "tenant"))
AUTO_TREES = make_policy("auto-trees", _history("auto", "tenant", tree=True))
SHARED = make_policy("shared", _history("suffix", "runtime"))

PROMPT = [{"role": "user", "content": "Summarise the meeting notes for the team."}]


def _history_accepted(result) -> int:
    return int(result.stats.accepted_by_source.get("history", 0))


def test_one_tenants_calls_never_draft_for_another(target, tokenizer) -> None:
    # Both runtimes plan with the same pinned costs: with costs measured in the background, a
    # call's drafts depend on whether the measurement has landed before it (in one full-suite
    # run the other tenant's call accepted 7 history tokens where the fresh runtime's accepted
    # none; run alone, with or without pinned costs, they matched every time).
    runtime = SpecRuntime(
        target,
        tokenizer=tokenizer,
        policies=[SUFFIX_TENANT],
        device="cpu",
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )
    alone = runtime.with_policies([SUFFIX_TENANT])  # its own, empty history
    options = {"policy": "suffix-tenant", "max_new_tokens": 40}
    first = runtime.generate_sync(PROMPT, tenant="acme", **options)
    again = runtime.generate_sync(PROMPT, tenant="acme", **options)
    other = runtime.generate_sync(PROMPT, tenant="globex", **options)
    fresh = alone.generate_sync(PROMPT, tenant="globex", **options)
    assert first.token_ids == again.token_ids == other.token_ids == fresh.token_ids
    # The same tenant drafts its earlier answer; another tenant drafts exactly as much as on a
    # runtime that never saw the first tenant's text.
    assert _history_accepted(again) > _history_accepted(first)
    assert _history_accepted(again) >= len(again.token_ids) // 2
    assert other.stats.accepted_by_source == fresh.stats.accepted_by_source
    assert other.stats.num_drafts == fresh.stats.num_drafts
    stats = runtime.history.stats() if runtime.history else {}
    assert stats["keys"] == 2
    assert 0 < stats["tokens"] <= stats["max_tokens"]
    runtime.close()
    alone.close()


def test_a_fallback_drafts_from_the_history_its_own_block_names(target, tokenizer) -> None:
    # A draft-model policy on a runtime without one runs its fallback, whose block says whose
    # text may draft (written flat, as before per-kind blocks: ``history`` is the fallback's).
    policy = make_policy(
        "fallback-tenant",
        {"kind": "draft_model", "num_speculative_tokens": 8, "fallback": "suffix"}
        | {"history": "tenant"},
    )
    runtime = SpecRuntime(
        target,
        tokenizer=tokenizer,
        policies=[policy],
        device="cpu",
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )
    options = {"policy": "fallback-tenant", "max_new_tokens": 40}
    first = runtime.generate_sync(PROMPT, tenant="acme", **options)
    again = runtime.generate_sync(PROMPT, tenant="acme", **options)
    assert again.stats.drafter == "suffix"
    assert first.token_ids == again.token_ids
    assert _history_accepted(again) > _history_accepted(first)
    runtime.close()


def test_runtime_wide_history_refuses_a_call_that_names_a_tenant(target, tokenizer) -> None:
    runtime = SpecRuntime(target, tokenizer=tokenizer, policies=[SHARED], device="cpu")
    with pytest.raises(InvalidRequestError, match="history: tenant"):
        runtime.generate_sync("Hello", policy="shared", tenant="acme", max_new_tokens=4)
    result = runtime.generate_sync("Hello", policy="shared", max_new_tokens=4)
    assert result.usage.output_tokens >= 1
    runtime.close()


def test_call_scope_keeps_nothing(target, tokenizer) -> None:
    policy = make_policy("own", _history("suffix", "call"))
    runtime = SpecRuntime(target, tokenizer=tokenizer, policies=[policy], device="cpu")
    result = runtime.generate_sync(PROMPT, policy="own", tenant="acme", max_new_tokens=20)
    assert result.stats.drafter == "suffix"
    assert runtime.history is not None
    assert runtime.history.stats()["documents"] == 0
    runtime.close()


def test_multi_turn_episode_equals_plain_greedy(target, draft, tokenizer) -> None:
    """An agent episode (a tool call, its result, an answer quoting it, a rewrite of that
    answer): with `auto` (history and draft model) every turn equals plain greedy decoding."""
    runtime = SpecRuntime(target, draft, tokenizer, [AUTO_TENANT, PLAIN], "cpu")
    turns = [
        "Look up order A-10234.",
        'Tool result: {"status": "delayed", "carrier": "NordPost", "eta": "Thursday"}',
        "Now rewrite your answer as a short email to the customer.",
        "Rewrite it once more, keeping every fact.",
    ]
    conversations: dict[str, list[dict[str, str]]] = {"auto-tenant": [], "plain": []}
    sources: dict[str, int] = {}
    for turn in turns:
        outputs = {}
        for name, messages in conversations.items():
            messages.append({"role": "user", "content": turn})
            result = runtime.generate_sync(
                list(messages), policy=name, tenant="acme", max_new_tokens=24
            )
            messages.append({"role": "assistant", "content": result.text})
            outputs[name] = result.token_ids
            for source, n in result.stats.accepted_by_source.items():
                sources[source] = sources.get(source, 0) + n
        assert outputs["auto-tenant"] == outputs["plain"]
    assert sources.get("history", 0) + sources.get("model", 0) > 0
    runtime.close()


def test_token_trees_in_batched_rounds_equal_plain_greedy(target, draft, tokenizer) -> None:
    """The tenant's earlier (sampled) answers to the same requests disagree with the greedy
    ones; with costs that make extra rows free, `auto` verifies the history's continuation
    beside the draft model's as a token tree, in rounds where another call's forwards are
    batched; every output still equals plain greedy decoding. Without ``tree: true`` (the
    default), the same calls verify chains only."""
    runtime = SpecRuntime(
        target,
        draft,
        tokenizer,
        [AUTO_TREES, AUTO_TENANT, PLAIN],
        "cpu",
        options=RuntimeOptions(probe_store=PinnedCosts()),
    )
    runtime.wait_measured(timeout=120)
    prompts = [
        [{"role": "user", "content": "Summarise the meeting notes for the team."}],
        [{"role": "user", "content": "Look up order A-10234 and reply."}],
    ]
    for messages in prompts:
        for seed in range(3):
            runtime.generate_sync(
                messages,
                policy="auto-trees",
                tenant="acme",
                max_new_tokens=24,
                temperature=1.0,
                seed=seed,
            )

    async def together() -> tuple[list, list]:
        calls = [
            runtime.generate(m, policy="auto-trees", tenant="acme", max_new_tokens=24)
            for m in prompts
        ]
        drafted = await asyncio.gather(*calls)
        plain = [await runtime.generate(m, policy="plain", max_new_tokens=24) for m in prompts]
        return list(drafted), plain

    drafted, plain = asyncio.run(together())
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert sum(r.stats.num_tree_steps for r in drafted) > 0
    chains = [
        runtime.generate_sync(m, policy="auto-tenant", tenant="acme", max_new_tokens=24)
        for m in prompts
    ]
    assert [r.token_ids for r in chains] == [r.token_ids for r in plain]
    assert all(r.stats.num_tree_steps == 0 for r in chains)
    runtime.close()


def test_auto_without_a_draft_model_drafts_from_text_only(target, tokenizer) -> None:
    runtime = SpecRuntime(target, tokenizer=tokenizer, policies=[AUTO_TENANT, PLAIN], device="cpu")
    runtime.generate_sync(PROMPT, policy="auto-tenant", max_new_tokens=30)
    again = runtime.generate_sync(PROMPT, policy="auto-tenant", max_new_tokens=30)
    plain = runtime.generate_sync(PROMPT, policy="plain", max_new_tokens=30)
    assert again.token_ids == plain.token_ids
    assert again.stats.drafter == "auto"
    assert set(again.stats.accepted_by_source) <= {"history"}
    assert _history_accepted(again) > 0
    runtime.close()


def test_a_tool_call_under_a_grammar_counts_forced_tokens(target, tokenizer) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup_order",
                "parameters": {
                    "type": "object",
                    "properties": {"order_id": {"enum": ["A-10234", "B-20001"]}},
                    "required": ["order_id"],
                },
            },
        }
    ]
    runtime = SpecRuntime(target, tokenizer=tokenizer, policies=[PLAIN], device="cpu")
    result = runtime.generate_sync(
        "Call the tool", tools=tools, constraint=Constraint.tool_call(tools), max_new_tokens=80
    )
    assert result.finish_reason == "stop"
    assert result.stats.num_forced_tokens > 0
    assert result.stats.accepted_by_source.get("grammar", 0) > 0
    assert result.stats.num_draft_tokens == 0  # plain decoding: only the grammar drafted
    # Forced tokens make a plain call need fewer target forwards than tokens.
    assert result.stats.mean_acceptance_length > 1.0
    runtime.close()


@pytest.mark.slow  # every bench method over the episodes
def test_agent_bench_on_a_tiny_pair(target, draft, tokenizer, tmp_path) -> None:
    from specagent.measuring.agent_bench import (
        agent_policies,
        load_episodes,
        run_agent_bench,
        save_agent_bench,
    )

    episodes = load_episodes()
    assert len(episodes) >= 12
    assert {e.kind for e in episodes} >= {
        "tool-result-answer",
        "code-again",
        "sql-fix",
        "same-extraction",
        "rewrite",
    }
    runtime = SpecRuntime(target, draft, tokenizer, agent_policies(True), "cpu")
    result = run_agent_bench(
        runtime, episodes=episodes[:3], max_new_tokens=8, repeats=2, log=lambda _: None
    )
    runtime.close()
    methods = {
        "plain",
        "hf_prompt_lookup",
        "hf_assisted",
        "specagent_lossless-auto",
        "specagent_lossless-draft_model",
        "specagent_lossless-auto+reuse",
        "specagent_lossless-draft_model+reuse",
        "specagent_lossless-plain",
        "specagent_lossless-plain+reuse",
    }
    for rows in result.episodes.values():
        assert set(rows) == methods
        assert all(len(turns) == len(rows["plain"]) for turns in rows.values())
        for name, turns in rows.items():
            if name != "plain":
                assert all(t.equal_to_plain for t in turns), name
    summary = result.summary
    assert summary["all_lossless_equal_to_plain"]
    assert all(c["other"] == c["near_tie"] == 0 for c in summary["divergences"].values())
    assert summary["speedup_vs_plain"]["plain"]["total"] == 1.0
    assert "specagent_lossless-auto" in summary["speedup_vs_hf_prompt_lookup"]
    assert result.history["tokens"] > 0  # the auto policy kept the tenant's turns
    # The +reuse methods started later turns from earlier turns' KV (prompt and reply).
    assert summary["prefix_reuse"]["hits"] > 0
    json_path, png_path = save_agent_bench(result, tmp_path, "agent")
    assert json_path.exists()
    assert png_path.stat().st_size > 0


def test_explain_divergence_tells_a_real_difference_from_a_rounding_tie(target, tokenizer) -> None:
    import torch

    from specagent.measuring.divergence import explain_divergence

    runtime = SpecRuntime(target, tokenizer=tokenizer, policies=[PLAIN], device="cpu")
    prompt = [5, 17, 42, 9]
    reference = runtime.generate_sync(prompt, policy="plain", max_new_tokens=6).token_ids
    with torch.inference_mode():
        logits = target(input_ids=torch.tensor([prompt + reference[:2]])).logits[0, -1]
    unlikely = int(logits.argmin())
    wrong = [*reference[:2], unlikely, *reference[3:]]
    shorter = reference[:4]
    real, stopped = explain_divergence(
        runtime, [(prompt, reference, wrong), (prompt, reference, shorter)]
    )
    runtime.close()
    # A float32 target has no rounding to blame: the least likely token is a real difference.
    assert real["at"] == 2
    assert (real["plain_token"], real["token"]) == (reference[2], unlikely)
    assert real["float32_margin"] > 0
    assert real["float32_prefers"] == "plain"
    assert real["plain_margin"] == pytest.approx(real["float32_margin"], abs=1e-3)
    assert real["dtype_error"] < 1e-3  # float32 along plain's path: only summation order
    assert real["near_tie"] is False
    assert stopped == {"at": 4, "near_tie": False, "lengths": [6, 4]}


def test_explain_divergence_blames_rounding_only_within_the_dtypes_error(target, tokenizer) -> None:
    import copy

    import torch

    from specagent.measuring.divergence import explain_divergence

    half = copy.deepcopy(target).to(torch.bfloat16)
    runtime = SpecRuntime(half, tokenizer=tokenizer, policies=[PLAIN], device="cpu")
    prompt = [5, 17, 42, 9]
    with torch.inference_mode():  # the reference: the bf16 weights, computed in float32
        exact = copy.deepcopy(half).float()(input_ids=torch.tensor([prompt])).logits[0, -1]
    first, second = (int(i) for i in torch.topk(exact, 2).indices)
    (report,) = explain_divergence(runtime, [(prompt, [first], [second])])
    runtime.close()
    assert report["float32_margin"] == pytest.approx(float(exact[first] - exact[second]), abs=1e-3)
    assert report["dtype_error"] > 0  # bf16 logits are not float32's
    assert report["float32_prefers"] == ("plain" if report["float32_margin"] >= 0 else "output")
    assert report["near_tie"] == (abs(report["float32_margin"]) <= 2 * report["dtype_error"])
