"""Constrained output: valid by construction even from a random tiny model, composed with
speculation, and still exactly lossless with respect to the constrained target."""

from __future__ import annotations

import copy
import json

import jsonschema
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specagent import InvalidRequestError, Policy, SpecRuntime
from specagent.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
from specagent.decoding.loop import speculative_generate
from specagent.decoding.sampling import SamplingParams, logits_to_probs, make_generator
from specagent.decoding.schedule import FixedSchedule
from specagent.engines.transformers import ModelRunner
from specagent.grammar import Constraint, compile_constraint

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}

POLICIES = [
    Policy(
        name="exact",
        description="d",
        mode="lossless",
        drafter={"kind": "draft_model", "num_speculative_tokens": 4, "adaptive": False},
    ),
    Policy(
        name="lookup",
        description="d",
        mode="lossless",
        drafter={"kind": "prompt_lookup", "num_speculative_tokens": 6},
    ),
    Policy(
        name="fast",
        description="d",
        mode="relaxed",
        drafter={"kind": "draft_model", "num_speculative_tokens": 4, "adaptive": False},
        acceptance={"rule": "lenience", "lenience": 0.3},
    ),
]


@pytest.fixture(scope="module")
def runtime(target, draft, tokenizer):
    rt = SpecRuntime(
        target=target, draft=draft, tokenizer=tokenizer, policies=POLICIES, device="cpu"
    )
    yield rt
    rt.close()


@pytest.mark.parametrize("policy", ["exact", "lookup", "fast"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_is_valid_from_a_random_model(runtime, policy, temperature) -> None:
    for seed in range(3):
        result = runtime.generate_sync(
            'Weather for {"city": "Paris"} please',
            policy=policy,
            temperature=temperature,
            seed=seed,
            max_new_tokens=200,
            constraint=Constraint.json_schema(SCHEMA),
        )
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), SCHEMA)


def test_tool_call_constraint_gives_a_valid_call(runtime) -> None:
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "parameters": {
                    "type": "object",
                    "properties": {"zone": {"enum": ["utc", "cet"]}},
                    "required": ["zone"],
                    "additionalProperties": False,
                },
            },
        },
    ]
    for seed in range(4):
        result = runtime.generate_sync(
            "Call a tool",
            policy="exact",
            temperature=1.0,
            seed=seed,
            max_new_tokens=200,
            constraint=Constraint.tool_call(tools),
        )
        call = json.loads(result.text)
        assert call["name"] in {"get_weather", "get_time"}
        schema = tools[0 if call["name"] == "get_weather" else 1]["function"]["parameters"]
        jsonschema.validate(call["arguments"], schema)


def test_regex_and_lark_constraints(runtime) -> None:
    result = runtime.generate_sync(
        "Code:",
        policy="exact",
        temperature=1.0,
        seed=1,
        max_new_tokens=50,
        constraint=Constraint.regex(r"[A-Z]{3}-[0-9]{2}"),
    )
    assert len(result.text) == 6
    assert result.text[3] == "-"
    lark = 'start: "yes" | "no"'
    result = runtime.generate_sync(
        "Answer:", policy="lookup", max_new_tokens=10, constraint=Constraint.lark(lark)
    )
    assert result.text in {"yes", "no"}


def test_invalid_grammar_is_a_clear_error(runtime) -> None:
    with pytest.raises(InvalidRequestError, match="invalid lark constraint"):
        runtime.generate_sync("x", constraint=Constraint.lark("start: undefined_rule"))
    with pytest.raises(InvalidRequestError, match="at least one tool"):
        Constraint.tool_call([])


# --------------------------------------------------------------------- lossless under a grammar

PATTERN = r"[a-e]{2,4}"
STEPS = 4
END = -1


def exact_constrained_marginals(model, tokenizer, prompt: list[int], constraint_factory):
    """P(token at position t) for the target constrained by the grammar, by enumerating every
    grammar-allowed path; END marks positions after the grammar completed."""
    marginals: list[dict[int, float]] = [{} for _ in range(STEPS)]
    state = constraint_factory()

    def walk(prefix: list[int], prob: float) -> None:
        t = len(prefix)
        if t == STEPS:
            return
        if state.is_stopped():
            for pos in range(t, STEPS):
                marginals[pos][END] = marginals[pos].get(END, 0.0) + prob
            return
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + prefix])).logits[0, -1].double()
        logits = logits.masked_fill(~state.allowed(), float("-inf"))
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0)).double()
        for token in torch.nonzero(probs > 0).flatten().tolist():
            p = prob * float(probs[token])
            marginals[t][token] = marginals[t].get(token, 0.0) + p
            state.consume([token])
            walk([*prefix, token], p)
            state.rollback(1)

    walk([], 1.0)
    return marginals


@pytest.mark.slow
def test_lossless_with_grammar_matches_the_constrained_target(target, draft, tokenizer) -> None:
    prompt = tokenizer.encode("abc abd")
    vocab = target.config.vocab_size

    def factory():
        return compile_constraint(Constraint.regex(PATTERN), tokenizer, vocab, eos_token_ids=[])

    marginals = exact_constrained_marginals(target, tokenizer, prompt, factory)
    runner = ModelRunner(target)
    counts: list[dict[int, int]] = [{} for _ in range(STEPS)]
    n = 1500
    for seed in range(n):
        drafter = DraftModelDrafter(ModelRunner(draft)) if seed % 2 else PromptLookupDrafter()
        events = list(
            speculative_generate(
                runner,
                prompt,
                params=SamplingParams(temperature=1.0),
                generator=make_generator(seed),
                max_new_tokens=STEPS,
                drafter=drafter,
                schedule=FixedSchedule(3),
                constraint=factory(),
            )
        )
        output = events[-1].output_ids
        for t in range(STEPS):
            token = output[t] if t < len(output) else END
            counts[t][token] = counts[t].get(token, 0) + 1
    for t in range(STEPS):
        keys = sorted(marginals[t])
        expected = np.array([marginals[t][k] for k in keys]) * n
        observed = np.array([counts[t].get(k, 0) for k in keys])
        assert observed.sum() == n  # nothing outside the grammar was ever emitted
        big = expected >= 5
        obs = np.append(observed[big], observed[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3, t


def test_answers_may_be_pretty_printed_tool_calls_stay_compact(tokenizer) -> None:
    """A response format lets the model write JSON with line breaks (bounded); a tool call is
    compact JSON, so the grammar forces its braces and separators."""
    vocab = len(tokenizer)
    eos = [tokenizer.eos_token_id]
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    pretty = '{\n  "a": "x"\n}'
    answer = compile_constraint(
        Constraint.json_schema(schema, strict=True, compact=False), tokenizer, vocab, eos
    )
    answer.consume(tokenizer.encode(pretty))
    compact = compile_constraint(Constraint.json_schema(schema, strict=True), tokenizer, vocab, eos)
    with pytest.raises(RuntimeError, match="rejected"):
        compact.consume(tokenizer.encode(pretty))
    endless = compile_constraint(Constraint.json_object(compact=False), tokenizer, vocab, eos)
    with pytest.raises(RuntimeError, match="rejected"):
        endless.consume(tokenizer.encode("{" + " " * 40))  # blanks are bounded per gap


def test_response_formats_are_told_to_the_model() -> None:
    from specagent.calls import CallSpec

    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    with_system = CallSpec.build(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"}],
        response_format=fmt,
    )
    assert with_system.messages[0]["content"].startswith("Be brief.\n\nReply with one JSON")
    assert json.dumps(schema) in with_system.messages[0]["content"]
    added = CallSpec.build([{"role": "user", "content": "Oslo?"}], response_format=fmt)
    assert [m["role"] for m in added.messages] == ["system", "user"]
    json_mode = CallSpec.build(
        [{"role": "user", "content": "Oslo?"}], response_format={"type": "json_object"}
    )
    assert json_mode.messages[0]["content"] == "Reply with one JSON object and nothing else."
    silent = CallSpec.build(
        [{"role": "user", "content": "Oslo?"}], response_format=fmt, describe_format=False
    )
    assert silent.messages == [{"role": "user", "content": "Oslo?"}]


def test_a_runtime_converts_its_tokenizer_at_start_not_in_a_call(
    target, draft, tokenizer, monkeypatch
) -> None:
    """llguidance's conversion of the tokenizer holds the GIL for about a second on a real
    vocabulary: the worker does it once, first thing at its start, so the first constrained call
    (a server's first ``tool_choice: "required"``) does not stall other calls' streams."""
    import llguidance.hf

    conversions: list[int] = []
    convert = llguidance.hf.from_tokenizer

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        conversions.append(1)
        return convert(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", counted)
    tok = copy.deepcopy(tokenizer)  # one this process has not converted yet
    rt = SpecRuntime(target=target, draft=draft, tokenizer=tok, policies=POLICIES, device="cpu")
    try:
        assert rt.start().wait_measured(timeout=300)
        assert len(conversions) == 1
        out = rt.generate_sync(
            "Weather?",
            policy="lookup",
            max_new_tokens=40,
            constraint=Constraint.json_schema(SCHEMA),
        )
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert len(conversions) == 1  # the call compiled its grammar only
    finally:
        rt.close()
