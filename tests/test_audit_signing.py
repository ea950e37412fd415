"""Signed exports: ``keygen``, ``export --sign`` and ``verify --export ... --public-key``, on both
stores; several exports and the journal verified as one chain."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from journal import SQLiteJournal, open_journal
from tests.cli_support import ROOT, Tools, invoke, seed

KEY_HEX = 64


@pytest.fixture
def key(tmp_path: Path) -> tuple[Path, str]:
    """A private key file and its public key (hex), made by keygen."""
    path = tmp_path / "audit-key.pem"
    made = invoke("journal", "keygen", "--output", str(path))
    assert made.exit_code == 0, made.output
    return path, made.stdout.strip()


@pytest.fixture
def db(seeded_db: str) -> str:
    """A seeded journal: a SQLite file, or a PostgreSQL database (``seeded_db``)."""
    return seeded_db


def signed_export(db: str, output: Path, key: Path, *args: str) -> Path:
    done = invoke("journal", "export", "--db", db, "--output", str(output), "--sign", str(key), *args)
    assert done.exit_code == 0, done.output
    return output.with_name(output.name + ".manifest.json")


def verify(*args: str) -> Any:
    return invoke("journal", "verify", *args)


# -- keygen ----------------------------------------------------------------------------------------


def test_keygen_writes_a_private_key_only_its_owner_reads_and_prints_the_public_key(tmp_path: Path) -> None:
    path = tmp_path / "k.pem"
    made = invoke("journal", "keygen", "--output", str(path))
    assert made.exit_code == 0, made.output
    public = made.stdout.strip()
    assert len(public) == KEY_HEX and int(public, 16) >= 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert f"The public key ({public}) went to standard output" in made.stderr  # not "the line above": piped

    again = invoke("journal", "keygen", "--output", str(path))
    assert again.exit_code == 1
    assert again.stderr == f"Error: {path} exists: keep that key, or replace it with --force\n"
    assert again.stdout == ""

    before = path.read_bytes()
    forced = invoke("journal", "keygen", "--output", str(path), "--force")
    assert forced.exit_code == 0
    assert path.read_bytes() != before and forced.stdout.strip() != public
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("command", [
    ["journal", "keygen", "--output", "{dir}/k.pem"],
    ["journal", "export", "--db", "{dir}/j.db", "--output", "{dir}/e.jsonl", "--sign", "{dir}/k.pem"],
    ["journal", "verify", "--export", "{dir}/e.jsonl", "--public-key", "ab" * 32],
    ["journal", "checkpoint", "--db", "{dir}/j.db", "--sign", "{dir}/k.pem"],
])
def test_without_cryptography_signing_is_one_error_naming_the_install(tmp_path: Path, command: list[str]) -> None:
    seed(tmp_path / "j.db")
    (tmp_path / "k.pem").write_bytes(b"not read")
    (tmp_path / "e.jsonl").write_bytes(b"")
    (tmp_path / "e.jsonl.manifest.json").write_bytes(b"{}")
    before = sorted(p.name for p in tmp_path.iterdir())
    # The package made unimportable, as where the extra is not installed.
    script = "import sys; sys.modules['cryptography'] = None; from cli.main import main; main()"
    done = subprocess.run([sys.executable, "-c", script, *[a.format(dir=tmp_path) for a in command]],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"})
    assert done.returncode == 1, done.stderr
    assert done.stderr == "Error: signing needs the cryptography package: pip install 'airlock-journal[sign]'\n"
    assert done.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


# -- export --sign and verify --public-key ----------------------------------------------------------


def test_a_signed_export_has_a_manifest_and_verifies_with_the_public_key(
    db: str, tmp_path: Path, key: tuple[Path, str]
) -> None:
    key_file, public = key
    output = tmp_path / "audit.jsonl"
    manifest_file = signed_export(db, output, key_file)
    manifest = orjson.loads(manifest_file.read_bytes())
    lines = [orjson.loads(line) for line in output.read_bytes().splitlines()]
    import hashlib

    assert manifest["events"] == len(lines) > 0
    assert (manifest["first_seq"], manifest["last_seq"]) == (1, lines[-1]["seq"])
    assert manifest["head_hash"] == lines[-1]["hash"] and manifest["first_prev_hash"] == "0" * 64
    assert manifest["sha256"] == hashlib.sha256(output.read_bytes()).hexdigest()
    assert manifest["bytes"] == output.stat().st_size
    assert manifest["filters"] == {"call_id": None, "tool": None, "agent_id": None, "since": None, "until": None}
    assert manifest["redacted"] == [] and manifest["created_at"].endswith("Z")
    assert manifest["public_key"] == public and len(manifest["signature"]) == 128
    with open_journal(db, readonly=True) as journal:
        head = journal.head()

    for given in (public, public.upper(), str(tmp_path / "audit-key.pub")):
        (tmp_path / "audit-key.pub").write_text(public + "\n")
        ok = verify("--export", str(output), "--public-key", given)
        assert ok.exit_code == 0, ok.output
        assert ok.stdout == f"OK: {head[0]} events, head {head[1]}\n"

    other = invoke("journal", "keygen", "--output", str(tmp_path / "other.pem")).stdout.strip()
    wrong = verify("--export", str(output), "--public-key", other)
    assert wrong.exit_code == 1
    assert wrong.stderr == (f"Error: {manifest_file} does not verify: it is signed by another key ({public}), "
                            f"not by {other}\n")
    private = verify("--export", str(output), "--public-key", str(key_file))
    assert private.exit_code == 1 and "holds a private key: give the public key" in private.stderr


def test_a_signed_export_of_a_filter_records_it_and_verifies_with_its_gaps(
    db: str, tmp_path: Path, key: tuple[Path, str]
) -> None:
    key_file, public = key
    output = tmp_path / "charges.jsonl"
    manifest_file = signed_export(db, output, key_file, "--call", "call-timeout", "--redact", "value",
                                  "--since", "2000-01-01")
    manifest = orjson.loads(manifest_file.read_bytes())
    assert manifest["filters"]["call_id"] == "call-timeout"
    assert manifest["filters"]["since"] == "2000-01-01T00:00:00.000000Z"
    assert manifest["redacted"] == ["value"] and manifest["events"] == 3
    ok = verify("--export", str(output), "--public-key", public)  # its gaps explained by its signed filters
    assert ok.exit_code == 0, ok.output
    plain = verify("--export", str(output))
    assert plain.exit_code == 1 and "add --allow-gaps" in plain.stderr


def test_sign_needs_an_output_file_in_jsonl(db: str, tmp_path: Path, key: tuple[Path, str]) -> None:
    key_file, _ = key
    for args in ([], ["--output", "-"], ["--output", str(tmp_path / "e.csv"), "--format", "csv"]):
        result = invoke("journal", "export", "--db", db, "--sign", str(key_file), *args)
        assert result.exit_code == 2, result.output
        assert result.stderr == ("Error: --sign writes a manifest beside the export: it needs --output FILE, in "
                                 "the jsonl format\n")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("journal.db")) == ["audit-key.pem"]
    not_a_key = tmp_path / "not-a-key.pem"
    not_a_key.write_text("hello\n")
    bad = invoke("journal", "export", "--db", db, "--sign", str(not_a_key), "--output", str(tmp_path / "e.jsonl"))
    assert bad.exit_code == 1
    assert bad.stderr == f"Error: {not_a_key} is not a PEM private key (airlock journal keygen writes one)\n"
    assert not (tmp_path / "e.jsonl").exists()


def test_public_key_goes_with_an_export_or_a_checkpoint(tmp_path: Path) -> None:
    result = verify("--db", str(tmp_path / "j.db"), "--public-key", "ab" * 32)
    assert result.exit_code == 2
    assert result.stderr == "Error: --public-key goes with --export FILE or --checkpoint FILE\n"


def test_an_export_without_its_manifest_does_not_verify_with_a_public_key(
    tmp_path: Path, key: tuple[Path, str]
) -> None:
    seed(tmp_path / "j.db")
    output = tmp_path / "e.jsonl"
    assert invoke("journal", "export", "--db", str(tmp_path / "j.db"), "-o", str(output)).exit_code == 0
    result = verify("--export", str(output), "--public-key", key[1])
    assert result.exit_code == 1
    assert result.stderr == (f"Error: {output} has no manifest {output}.manifest.json: export it with --sign to "
                             "check its signature\n")


# -- every byte -------------------------------------------------------------------------------------


def test_every_byte_changed_in_a_signed_export_or_its_manifest_fails_verify_with_the_reason(
    tmp_path: Path, key: tuple[Path, str]
) -> None:
    key_file, public = key
    path = tmp_path / "small.db"
    with SQLiteJournal(path) as journal:
        tools = Tools(journal)
        tools.call("call-1", tools.charge, account="a", cents=1)
    output = tmp_path / "small.jsonl"
    manifest_file = signed_export(str(path), output, key_file)
    assert verify("--export", str(output), "--public-key", public).exit_code == 0
    export_bytes, manifest_bytes = output.read_bytes(), manifest_file.read_bytes()

    def flipped(target: Path, original: bytes, index: int, mask: int) -> Any:
        changed = bytearray(original)
        changed[index] ^= mask
        target.write_bytes(bytes(changed))
        try:
            return verify("--export", str(output), "--public-key", public)
        finally:
            target.write_bytes(original)

    for index in range(len(export_bytes)):
        result = flipped(output, export_bytes, index, 0x01)
        assert result.exit_code == 1, (index, result.output)
        assert result.stderr.startswith(f"Error: {output} does not verify: its sha256 is "), (index, result.stderr)
        assert result.stderr.endswith("the file has been changed since it was signed\n")
    reasons = set()
    for mask in (0x01, 0x20):  # a bit; a letter's case
        for index in range(len(manifest_bytes)):
            result = flipped(manifest_file, manifest_bytes, index, mask)
            assert result.exit_code == 1, (mask, index, result.output)
            assert result.stderr.startswith(f"Error: {manifest_file} does not verify: "), (index, result.stderr)
            reasons.add(result.stderr.split(": ", 2)[2].split(" (")[0].split(": ")[0].strip())
    assert {"its signature does not match its contents", "it is not JSON", "it lacks format",
            "its signature is not 128 lowercase hex digits"} <= reasons, reasons
    assert verify("--export", str(output), "--public-key", public).exit_code == 0  # all put back


# -- several exports and the journal as one chain ----------------------------------------------------


def _split_at(db: str, seq: int) -> str:
    """The ``at`` of event ``seq``: exports --until it and --since it split the log there."""
    with open_journal(db, readonly=True) as journal:
        event = next(iter(journal.events(after_seq=seq - 1)))
    return event.export()["at"]


def test_exports_and_the_journal_verify_as_one_chain(db: str, tmp_path: Path, key: tuple[Path, str]) -> None:
    key_file, public = key
    with open_journal(db, readonly=True) as journal:
        head_seq, head_hash = journal.head()
    split = _split_at(db, 5)
    first, second = tmp_path / "a1.jsonl", tmp_path / "a2.jsonl"
    signed_export(db, first, key_file, "--until", split)
    signed_export(db, second, key_file, "--since", split)
    assert orjson.loads((tmp_path / "a1.jsonl.manifest.json").read_bytes())["last_seq"] == 4

    both = verify("--export", str(first), "--export", str(second))
    assert both.exit_code == 0, both.output
    assert both.stdout == f"OK: {head_seq} events, head {head_hash}\n"
    signed = verify("--export", str(first), "--export", str(second), "--public-key", public, "--db", db)
    assert signed.exit_code == 0, signed.output
    assert signed.stdout == f"OK: {head_seq} events, head {head_hash}\n"

    swapped = verify("--export", str(second), "--export", str(first))
    assert swapped.exit_code == 1
    assert swapped.stderr.startswith(f"Error: {second} does not verify at seq 5: the first event is seq 5, not seq 1")
    twice = verify("--export", str(first), "--export", str(first))
    assert twice.exit_code == 1 and "seq 1 does not follow seq 4" in twice.stderr

    # The journal goes on after the exports: new events join the chain they end.
    with open_journal(db) as journal:
        tools = Tools(journal)
        tools.call("call-later", tools.charge, account="acct_5", cents=5)
        later_seq, later_hash = journal.head()
    joined = verify("--export", str(first), "--export", str(second), "--db", db)
    assert joined.exit_code == 0, joined.output
    assert joined.stdout == f"OK: {later_seq} events, head {later_hash}\n"


def test_a_journal_cut_short_before_the_end_of_the_exports_does_not_join_them(
    tmp_path: Path, key: tuple[Path, str]
) -> None:
    path = tmp_path / "journal.db"
    seed(path)
    output = tmp_path / "all.jsonl"
    signed_export(str(path), output, key[0])
    import sqlite3

    conn = sqlite3.connect(path)
    conn.execute("DROP TRIGGER events_no_delete")
    last = conn.execute("SELECT max(seq) FROM events").fetchone()[0]
    conn.execute("DELETE FROM events WHERE seq > ?", (last - 2,))
    conn.commit()
    conn.close()
    assert invoke("journal", "rebuild", "--db", str(path)).exit_code == 0  # the projection made to agree
    alone = verify("--db", str(path))
    assert alone.exit_code == 0, alone.output  # a shorter log, consistent with itself
    joined = verify("--export", str(output), "--public-key", key[1], "--db", str(path))
    assert joined.exit_code == 1
    assert joined.stderr == (f"Error: {path} does not verify at seq {last - 1}: its log ends at seq {last - 2}, "
                             f"before seq {last} where {output} ends: events have been removed from its end\n")
