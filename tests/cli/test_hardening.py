"""What the command line must not do on hostile or broken input: run a planted module in a
child, create a store it was asked to read, print a caller's escape sequences to a terminal,
accept a private key others can read without a word, crash on a damaged probe file."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from specagent.audit import AuditStore, call_row
from specagent.cli import main
from specagent.engines.llama_cpp.probe import _kept_choices
from specagent.engines.transformers.tools import check as check_transformers
from specagent.machine import ProbeStore, describe_exit


@pytest.mark.slow  # a child process
def test_the_doctors_child_never_imports_from_the_working_directory(tmp_path, monkeypatch) -> None:
    marker = tmp_path / "planted-ran"
    (tmp_path / "json.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nraise SystemExit('planted json.py ran')\n"
    )
    monkeypatch.chdir(tmp_path)
    report = check_transformers()
    assert not marker.exists()
    assert report["runs"], report


def test_a_child_that_cannot_import_says_so() -> None:
    stderr = "Traceback ...\nModuleNotFoundError: No module named 'torch'\n"
    assert "could not import a module" in describe_exit("starting", 1, stderr)


def test_reading_a_missing_store_creates_nothing(tmp_path, capsys) -> None:
    path = tmp_path / "nowhere" / "audit.sqlite"
    assert main(["audit", "--db", f"sqlite:///{path}"]) == 2
    assert "no audit store" in capsys.readouterr().err
    assert not path.exists()
    assert not path.parent.exists()


def test_audit_tables_escape_what_a_caller_wrote(tmp_path, capsys) -> None:
    url = f"sqlite:///{tmp_path / 'audit.sqlite'}"
    store = AuditStore(url)
    row = call_row(front_door="server", status=200, key_name="k", policy="p")
    row["tenant"] = "k/\x1b]0;pwned\x07\x1b[2J"  # as an older server, or a raw insert, left it
    row["at"] = datetime.now(timezone.utc)
    store.record(row)
    assert store.flush()
    store.close()
    for fmt in ("table", "csv"):
        assert main(["audit", "--db", url, "--format", fmt]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out
        assert "\x07" not in out
        assert "\\x1b]0;pwned" in out


def test_a_tls_key_others_can_read_is_named_at_start(tmp_path, caplog) -> None:
    from argparse import Namespace

    from specagent.cli.serve import _tls

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("certificate")
    key.write_text("key")
    key.chmod(0o644)
    with caplog.at_level("WARNING", logger="specagent"):
        _tls(Namespace(ssl_certfile=cert, ssl_keyfile=key))
    assert "readable by others" in caplog.text
    caplog.clear()
    key.chmod(0o600)
    with caplog.at_level("WARNING", logger="specagent"):
        _tls(Namespace(ssl_certfile=cert, ssl_keyfile=key))
    assert "readable by others" not in caplog.text


@pytest.mark.parametrize(
    "content",
    [
        "not json at all",
        json.dumps({"entries": ["a", "list"]}),
        json.dumps({"entries": {"k": {"paths": {"repack": "yes"}}}}),
        json.dumps({"entries": {"k": {"paths": {"repack": {"enabled": "no", "reason": 1}}}}}),
        json.dumps({"entries": {"k": {"paths": "repack"}}}),
    ],
)
def test_a_damaged_probe_file_means_proving_again(tmp_path, content) -> None:
    store = ProbeStore(tmp_path)
    store.path.write_text(content)
    assert _kept_choices(store.get("k"), ["repack"]) is None
    good = {"paths": {"repack": {"enabled": False, "reason": "crashed (signal 4, SIGILL)"}}}
    store.path.write_text(json.dumps({"entries": {"k": good}}))
    kept = _kept_choices(store.get("k"), ["repack"])
    assert kept is not None
    assert not kept["repack"].enabled
