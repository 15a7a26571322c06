"""The drafting replay (``benchmarks/replay_agent_drafting.py``) on a tiny pair: against its
oracle target it must take the same steps a real run takes, or its numbers compare nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from conftest import PinnedCosts

from specagent import RuntimeOptions, SpecRuntime
from specagent.measuring.agent_bench import agent_policies

ROOT = Path(__file__).resolve().parents[1]


def _replay_module() -> ModuleType:
    path = ROOT / "benchmarks" / "replay_agent_drafting.py"
    spec = importlib.util.spec_from_file_location("replay_agent_drafting", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_replay_takes_the_real_runs_steps(target, draft, tokenizer) -> None:
    replay = _replay_module()
    policies = {p.name: p for p in agent_policies(True)}
    # Costs where drafting pays (as on a GPU), the same for the real run and the replay; the
    # draft's head cut to its first rows, as on the real pair (its forwards then carry `vocab`).
    runtime = SpecRuntime(
        target,
        draft,
        tokenizer,
        list(policies.values()),
        "cpu",
        options=RuntimeOptions(probe_store=PinnedCosts()),
        engine_options={"draft_head_rows": 64},
    )
    assert runtime.draft_head_rows == 64
    runtime.wait_measured(timeout=600)
    prompt = tokenizer("def f(x):\n    return x + 1\n\ndef f(x):")["input_ids"]
    max_new_tokens = 16
    plain = runtime.generate_sync(prompt, policy="lossless-plain", max_new_tokens=max_new_tokens)
    traces = {
        "max_new_tokens": max_new_tokens,
        "eos_token_ids": list(runtime.eos_token_ids),
        "episodes": {"one": [{"prompt": prompt, "output": plain.token_ids}]},
    }
    for name in ("lossless-draft_model", "lossless-auto"):
        # Its tenant's history is empty, as the replay's is when it starts.
        real = runtime.generate_sync(
            prompt, policy=name, max_new_tokens=max_new_tokens, tenant="real"
        )
        assert real.token_ids == plain.token_ids  # float32: lossless greedy is plain greedy
        (replayed,) = replay.replay_specagent(runtime, policies[name], traces)["one"]
        assert replayed.accepted == real.stats.accepted_by_source, name
        # Each verification emits its accepted tokens and one of the target's own.
        steps = len(plain.token_ids) - real.stats.num_accepted_tokens
        assert replayed.target_forwards == steps, name
        assert replayed.draft_forwards > 0, name
        assert sum(replayed.accepted.values()) > 0, name
    # Plain decoding: one forward per emitted token (the first one's prompt rows left out).
    (steps,) = replay.replay_specagent(runtime, policies["lossless-plain"], traces)["one"]
    assert steps.target_forwards == len(plain.token_ids)
    single = runtime.step_costs(policies["lossless-plain"]).verify_cost(1)
    assert steps.target_units == len(plain.token_ids) * single
    runtime.close()
