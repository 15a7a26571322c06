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


def test_every_error_the_package_raises_is_in_the_tree() -> None:
    """Each ``SpecAgentError`` subclass anywhere in the package is defined in ``errors``,
    exported from the package and drawn in the tree its docstring shows."""
    import importlib
    import pkgutil

    from specagent import errors

    for info in pkgutil.walk_packages(specagent.__path__, "specagent."):
        if info.name.endswith(("__main__", "probe_child")):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:  # an optional extra that is not installed
            continue
    found: set[type] = set()
    pending = [specagent.SpecAgentError]
    while pending:
        cls = pending.pop()
        found.add(cls)
        pending.extend(cls.__subclasses__())
    for cls in found:
        assert cls.__module__ == "specagent.errors", cls
        assert cls.__name__ in errors.__all__, cls
        assert cls.__name__ in specagent.__all__, cls
        assert f" {cls.__name__}\n" in (errors.__doc__ or "") or f" {cls.__name__} " in (
            errors.__doc__ or ""
        ), cls


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
