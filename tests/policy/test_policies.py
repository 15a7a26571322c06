"""Policy loading: the shipped policies, every error path, lookup and routing."""

from __future__ import annotations

from pathlib import Path

import pytest

from specagent import (
    Policy,
    PolicyError,
    PolicyNotFoundError,
    PolicySet,
    load_policies,
    load_policy,
    shipped_policies,
)
from specagent.policy import SHIPPED_POLICIES

SHIPPED = SHIPPED_POLICIES  # the package directory

VALID = """\
name: {name}
description: A test policy.
mode: relaxed
drafter: {{kind: prompt_lookup, num_speculative_tokens: 4}}
acceptance: {{rule: typical, epsilon: 0.2, delta: 0.1}}
match: {{tags: [notes]}}
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_shipped_policies_cover_both_modes_and_keep_sensitive_text_to_the_call() -> None:
    policies = load_policies(SHIPPED)
    shipped = [p for p in policies if p.name != "default"]
    assert len(shipped) >= 5
    assert {p.mode for p in shipped} == {"lossless", "relaxed"}
    # auto: history, the draft model where the runtime has one, or plain decoding, per step.
    assert {p.drafter.kind for p in shipped} == {"auto"}
    for name in ("legal-drafting", "medical-summary"):
        assert policies[name].drafter.history == "call"  # confidential: nothing kept
    for policy in shipped:
        assert policy.mode in policy.description.lower() or "exact" in policy.description.lower()
    assert policies.default.mode == "lossless"


def test_shipped_policies_are_found_from_any_directory_and_a_directory_overrides_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # nowhere near the source tree's files
    shipped = shipped_policies()
    assert "customer-reply" in shipped
    assert shipped.default.name == "default"
    extra = tmp_path / "mine"
    extra.mkdir()
    write(extra, "customer-reply", VALID.format(name="customer-reply"))
    write(extra, "notes", VALID.format(name="notes"))
    merged = load_policies(extra, extends=shipped)
    assert merged["customer-reply"].mode == "relaxed"  # the directory's file wins
    assert shipped["customer-reply"].mode == "lossless"  # the shipped set is untouched
    assert merged["legal-drafting"] == shipped["legal-drafting"]  # the rest is kept
    assert "notes" in merged
    assert sorted(p.name for p in merged.defined()) == sorted(
        [*(p.name for p in shipped.defined()), "notes"]
    )


def test_valid_file_loads(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, "notes", VALID.format(name="notes")))
    assert policy.mode == "relaxed"
    assert policy.acceptance is not None
    assert policy.acceptance.rule == "typical"
    assert policy.relaxed_rule() is not None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: x\ndescription: d\nmode: lossless\nspeed: 11\n", r"field 'speed': unknown field"),
        (
            "name: x\ndescription: d\nmode: lossless\ndrafter: {kind: draft_model, k: 3}\n",
            r"field 'drafter.k': unknown field",
        ),
        ("name: x\ndescription: d\nmode: fast\n", r"field 'mode'.*'lossless' or 'relaxed'.*fast"),
        (
            "name: x\ndescription: d\nmode: lossless\nsampling: {temperature: hot}\n",
            r"field 'sampling.temperature'.*valid number.*hot",
        ),
        (
            "name: x\ndescription: d\nmode: lossless\ndrafter: {num_speculative_tokens: 0}\n",
            r"field 'drafter.num_speculative_tokens'.*greater than or equal to 1",
        ),
        (
            "name: x\ndescription: d\nmode: relaxed\ndrafter: {kind: prompt_lookup}\n"
            "acceptance: {rule: magic}\n",
            r"field 'acceptance'.*'magic'.*'typical', 'top_k', 'lenience'",
        ),
        (
            "name: x\ndescription: d\nmode: relaxed\ndrafter: {kind: prompt_lookup}\n"
            "acceptance: {rule: top_k, epsilon: 0.3}\n",
            r"field 'acceptance.epsilon': unknown field",
        ),
        (
            "name: x\ndescription: d\nmode: lossless\nacceptance: {rule: typical}\n",
            r"field 'acceptance': a lossless policy must not have an acceptance block",
        ),
        (
            "name: x\ndescription: d\nmode: relaxed\n",
            r"field 'acceptance': a relaxed policy needs an acceptance block",
        ),
        (
            "name: x\ndescription: d\nmode: relaxed\ndrafter: {kind: none}\n"
            "acceptance: {rule: typical}\n",
            r"field 'acceptance': a relaxed policy needs a drafter",
        ),
        (
            "name: x\ndescription: d\nmode: lossless\ndrafter: {kind: prompt_lookup, "
            "history: tenant}\n",
            r"field 'drafter.history': unknown field",
        ),
        (
            "name: x\ndescription: d\nmode: lossless\ndrafter: {kind: draft_model, "
            "fallback: {kind: prompt_lookup, tree: true}}\n",
            r"field 'drafter.fallback.tree': unknown field",
        ),
        (
            "name: x\ndescription: d\nmode: lossless\ndrafter: {kind: early_exit, "
            "fallback: none}\n",
            r"field 'drafter.fallback': unknown field",
        ),
        (
            "name: x\ndescription: d\nmode: lossless\ndrafter: {kind: draft_model, "
            "fallback: {kind: auto, history: everyone}}\n",
            r"field 'drafter.fallback.history'.*'none', 'call', 'policy', 'tenant' or 'runtime'",
        ),
        (
            "name: x\ndescription: d\nmode: lossless\ndrafter: {kind: lookup}\n",
            r"field 'drafter': unknown drafter 'lookup'; expected one of \[.*'prompt_lookup'",
        ),
        ("name: x\nmode: lossless\n", r"field 'description': Field required"),
        ("- just\n- a list\n", r"expected a mapping of policy fields, got list"),
    ],
)
def test_schema_errors_name_file_field_and_expectation(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = write(tmp_path, "x", text)
    with pytest.raises(PolicyError, match=expected) as info:
        load_policy(path)
    assert str(path) in str(info.value)


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "x", "name: x\ndescription: d\nmode: [lossless\nsampling: {}\n")
    with pytest.raises(PolicyError, match=r"x\.yaml: line \d+, column \d+: invalid YAML"):
        load_policy(path)


def test_yaml_is_data_not_code(tmp_path: Path) -> None:
    path = write(tmp_path, "x", "!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(PolicyError, match="invalid YAML"):
        load_policy(path)


def test_name_must_match_file_name(tmp_path: Path) -> None:
    path = write(tmp_path, "notes", VALID.format(name="other"))
    with pytest.raises(
        PolicyError, match=r"field 'name': expected the file name 'notes', got 'other'"
    ):
        load_policy(path)


def test_directory_errors(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="does not exist"):
        load_policies(tmp_path / "missing")
    with pytest.raises(PolicyError, match=r"holds no \*\.yaml files"):
        load_policies(tmp_path)
    (tmp_path / "notes.yaml").write_text(VALID.format(name="notes"))
    (tmp_path / "notes.yml").write_text(VALID.format(name="notes"))
    with pytest.raises(PolicyError, match="two policies are named 'notes'"):
        load_policies(tmp_path)


def test_unknown_name_lists_known_names(tmp_path: Path) -> None:
    write(tmp_path, "notes", VALID.format(name="notes"))
    policies = load_policies(tmp_path)
    with pytest.raises(
        PolicyNotFoundError, match=r"no policy named 'legl'; known policies: default, notes"
    ):
        policies.get("legl")
    with pytest.raises(LookupError):
        policies["legl"]


def test_routing_by_tags_and_lossless_default(tmp_path: Path) -> None:
    policies = load_policies(SHIPPED)
    assert policies.route(["summary", "internal"]).name == "internal-summary"
    assert policies.route(["legal"]).name == "legal-drafting"
    assert policies.route(["unrelated"]).mode == "lossless"
    assert policies.route([]).name == "default"
    assert policies.resolve("meeting-notes", ["legal"]).name == "meeting-notes"  # a name wins
    # a tie between a relaxed and a lossless policy goes to the lossless one
    tie = PolicySet(
        [
            Policy(
                name="a-fast",
                description="d",
                mode="relaxed",
                drafter={"kind": "prompt_lookup"},
                acceptance={"rule": "typical"},
                match={"tags": ["shared"]},
            ),
            Policy(name="b-exact", description="d", mode="lossless", match={"tags": ["shared"]}),
        ]
    )
    assert tie.route(["shared"]).name == "b-exact"


def test_default_policy_must_be_lossless() -> None:
    relaxed_default = Policy(
        name="default",
        description="d",
        mode="relaxed",
        drafter={"kind": "prompt_lookup"},
        acceptance={"rule": "typical"},
    )
    with pytest.raises(PolicyError, match="default policy must be lossless"):
        PolicySet([relaxed_default])


def test_policies_are_immutable() -> None:
    policy = Policy(name="x", description="d", mode="lossless")
    with pytest.raises(Exception, match="frozen"):
        policy.mode = "relaxed"  # type: ignore[misc]


ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_lists_every_package_and_takes_the_policies_from_the_top_level() -> None:
    """pyproject.toml lists the packages (the shipped policies enter the wheel from policies/
    as ``specagent._shipped_policies``): the list must name every package directory, and a
    source checkout finds the policies in policies/ (one copy)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "specagent").rglob("__init__.py")
    } | {"langchain_specagent"}
    assert set(config["packages"]) == found | {"specagent._shipped_policies"}
    assert config["package-dir"]["specagent._shipped_policies"] == "policies"
    assert SHIPPED == ROOT / "policies"
    assert not (ROOT / "specagent" / "data" / "policies").exists()


@pytest.mark.slow
def test_the_built_wheel_holds_the_shipped_policies(tmp_path: Path) -> None:
    import subprocess
    import sys
    import zipfile

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("specagent-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for policy in (ROOT / "policies").glob("*.yaml"):
        assert f"specagent/_shipped_policies/{policy.name}" in names
    assert "langchain_specagent/chat_models.py" in names
    assert "specagent/data/agent_episodes.jsonl" in names


def _drafter(block: dict) -> Policy:
    return Policy.model_validate(
        {"name": "x", "description": "d", "mode": "lossless", "drafter": block}
    )


def test_each_drafter_kind_is_its_own_block_named_by_the_registry() -> None:
    from specagent.decoding.registry import DRAFTERS

    for name, kind in DRAFTERS.items():
        assert kind.config().kind == name
        policy = _drafter({"kind": name})
        assert type(policy.drafter) is kind.config
        assert Policy.model_validate(policy.model_dump()) == policy
    assert _drafter({}).drafter.kind == "draft_model"  # a block that names no kind


def test_a_fallback_is_its_own_kind_written_flat_or_as_a_block() -> None:
    flat = _drafter(
        {
            "kind": "draft_model",
            "num_speculative_tokens": 9,
            "min_ngram": 2,
            "fallback": "early_exit",
            "early_exit_layers": 2,
        }
    ).drafter
    nested = _drafter(
        {
            "kind": "draft_model",
            "num_speculative_tokens": 9,
            "min_ngram": 2,
            "fallback": {"kind": "early_exit", "early_exit_layers": 2},
        }
    ).drafter
    assert flat == nested
    fallback = nested.fallback_block()
    assert fallback is not None
    assert fallback.kind == "early_exit"
    # What the fallback does not set it takes from the block it stands in for, where it has it.
    assert (fallback.num_speculative_tokens, fallback.min_ngram) == (9, 2)
    assert fallback.early_exit_layers == 2  # type: ignore[attr-defined]
    own = _drafter(
        {"kind": "draft_model", "num_speculative_tokens": 9, "fallback": {"kind": "suffix"}}
    ).drafter.fallback_block()
    assert own is not None
    assert own.num_speculative_tokens == 9
    assert own.history_scope() == "call"
    with pytest.raises(ValueError, match=r"unknown drafter 'draft_model' for a fallback"):
        _drafter({"kind": "draft_model", "fallback": {"kind": "draft_model"}})


def test_a_fixed_k_reaches_the_fallback_and_turns_adaptive_choices_off() -> None:
    drafter = _drafter(
        {"kind": "draft_model", "num_speculative_tokens": 9, "fallback": "prompt_lookup"}
    ).drafter
    fixed = drafter.fixed(3)
    fallback = fixed.fallback_block()
    assert fixed.num_speculative_tokens == 3
    assert not fixed.adaptive  # type: ignore[attr-defined]
    assert fallback is not None
    assert fallback.num_speculative_tokens == 3
    assert not fallback.adaptive  # type: ignore[attr-defined]
    assert _drafter({"kind": "suffix"}).drafter.fixed(5).num_speculative_tokens == 5


def test_a_reproducible_policy_checks_its_fallbacks_history_too() -> None:
    with pytest.raises(ValueError, match=r"drafts from its own call only.*'tenant'"):
        Policy.model_validate(
            {
                "name": "x",
                "description": "d",
                "mode": "lossless",
                "reproducible": True,
                "drafter": {"kind": "draft_model", "fallback": "suffix", "history": "tenant"},
            }
        )
