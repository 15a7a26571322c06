"""The public surface is what the README and docs name, sorted, and nothing private leaks."""

from __future__ import annotations

import specagent


def test_all_is_sorted_and_complete() -> None:
    assert specagent.__all__ == sorted(specagent.__all__)
    for name in specagent.__all__:
        assert hasattr(specagent, name), name
    for name in (
        "SpecRuntime",
        "Policy",
        "PolicySet",
        "load_policies",
        "SpecStats",
        "GenerationResult",
    ):
        assert name in specagent.__all__


def test_errors_form_one_tree() -> None:
    from specagent import errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), specagent.SpecAgentError)
    assert issubclass(specagent.PolicyNotFoundError, specagent.PolicyError)
    assert issubclass(specagent.InvalidRequestError, ValueError)
    assert issubclass(specagent.ContextLengthError, specagent.InvalidRequestError)


def test_spec_stats_fields_follow_the_design() -> None:
    import dataclasses

    fields = {f.name for f in dataclasses.fields(specagent.SpecStats)}
    assert {
        "policy",
        "mode",
        "drafter",
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "acceptance_rate",
        "mean_acceptance_length",
        "accepted_per_position",
        "ttft_s",
        "latency_s",
        "tokens_per_s",
        "divergence",
    } <= fields
    result_fields = {f.name for f in dataclasses.fields(specagent.GenerationResult)}
    assert {"text", "token_ids", "finish_reason", "usage", "stats"} <= result_fields
