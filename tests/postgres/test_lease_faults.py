"""Faults of a PostgreSQL journal's server under guards with real processes: a server restarted and a
server frozen while a tool runs, a server at its connection limit, and guards of two hosts on one
journal. What is asserted is what a user sees: how often the tool took effect (the lines it appends
to a file), what ``airlock journal show CALL --json`` says of the call's owner, and what reconcile,
resolve and a retry do.

The rule under test (see guard/liveness.py): a pending call's owner is judged by the lease its own
pending event names and, where this host can see its process (same host name, boot and PID
namespace), by whether that process runs; it is gone only on positive evidence.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from journal import open_journal
from tests.cli_support import invoke
from tests.pgserver import PgServer, fresh_database, fresh_schema, frozen, own_cluster

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[2]
PATIENCE = 120.0  # a bound on every wait a loaded machine may need; never a measure
LEASE = 3.0

# The agent's tool and the check that asks its backend. The tool appends one line per effect to
# EFFECTS ("call_id attempt pid host"), and waits while HOLD exists, before or after its effect as
# asked; the check notes each time it is asked in CHECKED and answers from EFFECTS.
TOOLS = textwrap.dedent('''
    import os, socket, time
    from pathlib import Path

    from guard import Airlock, SecurityPolicy, get_current_context
    from guard.effect_guard import EffectGuard
    from guard.reconcile import Applied, NotApplied, reconciled_by
    from journal import open_journal

    EFFECTS = Path(os.environ["EFFECTS"])
    HOLD = Path(os.environ["HOLD"])
    CHECKED = Path(os.environ["CHECKED"])

    def effects():
        return [line.split() for line in EFFECTS.read_text().splitlines()] if EFFECTS.exists() else []

    def charge_exists(call):
        with CHECKED.open("a") as f:
            f.write(f"{call.call_id} {call.attempt}\\n")
        mine = [e for e in effects() if e[0] == call.call_id]
        if not mine:
            return NotApplied(evidence="no charge for " + call.call_id)
        return Applied(value={"charged": call.call_id, "attempt": int(mine[0][1])}, evidence="charged")

    CHECKS = {"charge": charge_exists}

    def wait_while_held():
        while HOLD.exists():
            time.sleep(0.05)

    def make_charge(store, lease=None, hold=None, work=0.0):
        journal = open_journal(store) if isinstance(store, str) else store
        policy = SecurityPolicy(effect_guard=EffectGuard(store=journal, lease=lease))

        @reconciled_by(charge_exists)
        @Airlock(policy=policy)
        def charge(account: str, cents: int) -> dict:
            ctx = get_current_context()
            if hold == "before":
                print("started", flush=True)
                wait_while_held()
            with EFFECTS.open("a") as f:
                f.write(f"{ctx.tool_call_id} {ctx.attempt} {os.getpid()} {socket.gethostname()}\\n")
            if hold == "after":
                print("started", flush=True)
                wait_while_held()
            time.sleep(work)
            return {"charged": ctx.tool_call_id, "attempt": ctx.attempt}

        return charge
''')

# One guarded call: ``child.py DB CALL_ID CONFIG`` (CONFIG: JSON with lease, hold, journal options,
# and wait_go: say "ready" and wait for the file GO before calling). Prints "result " and the
# value, or the refusal's code, as JSON.
CHILD = textwrap.dedent('''
    import json, logging, os, sys, time
    from pathlib import Path

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")

    from guard import AirlockContext, is_refusal
    from journal import open_journal
    from agent_tools import make_charge

    db, call_id, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    store = open_journal(db, **config.get("journal", {}))
    charge = make_charge(store, lease=config.get("lease"), hold=config.get("hold"))
    if config.get("wait_go"):
        print("ready", flush=True)
        go = Path(os.environ["GO"])
        while not go.exists():
            time.sleep(0.01)
    with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": call_id}):
        result = charge("acct_1", 500)
    print("result", json.dumps(result.get("block_reason") if is_refusal(result) else result), flush=True)
''')

# Many guarded calls from one process: ``many.py DB NAME SHARED``: once GO exists, open the journal
# (again and again while the server refuses the connection), call NAME-0..NAME-2 once each, then
# shared-0..shared-(SHARED-1), each again while it is refused store_unavailable. Prints "report "
# and a JSON object: the errors that refused the open, and each call's id and result.
MANY = textwrap.dedent('''
    import json, logging, os, sys, time
    from pathlib import Path

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")

    from guard import AirlockContext, is_refusal
    from journal import open_journal
    from journal.errors import JournalError
    from agent_tools import make_charge

    db, name, shared = sys.argv[1], sys.argv[2], int(sys.argv[3])
    go = Path(os.environ["GO"])
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.01)
    deadline = time.monotonic() + float(os.environ["PATIENCE"])
    opens_refused = []
    journal = None
    while journal is None:
        try:
            journal = open_journal(db, busy_timeout=3.0, connect_timeout=2.0, timeout=5.0)
        except JournalError as e:
            opens_refused.append(str(e))
            if time.monotonic() > deadline:
                print("report", json.dumps({"opens_refused": opens_refused, "results": None}), flush=True)
                sys.exit(0)
            time.sleep(0.1)
    charge = make_charge(journal, lease=0.9, work=0.3)

    def call(call_id):
        with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": call_id}):
            result = charge("acct_1", 1)
        return {"code": result.get("block_reason")} if is_refusal(result) else {"value": result}

    results = []
    for k in range(3):
        results.append([f"{name}-{k}", call(f"{name}-{k}")])
    for k in range(shared):
        for _ in range(30):
            result = call(f"shared-{k}")
            results.append([f"shared-{k}", result])
            if result.get("code") != "store_unavailable":
                break
            time.sleep(0.1)
    journal.close()
    print("report", json.dumps({"opens_refused": opens_refused, "results": results}), flush=True)
''')


# -- a server that takes few sessions ---------------------------------------------------------------


MAX_CONNECTIONS = 12


@pytest.fixture
def limited_server() -> Iterator[PgServer]:
    """A cluster that takes at most MAX_CONNECTIONS sessions."""
    srv = own_cluster()
    try:
        srv.stop("fast")
        opts = (f"-p {srv.port} -k {srv.root} -c listen_addresses=127.0.0.1 -c shared_buffers=32MB"
                f" -c max_connections={MAX_CONNECTIONS}")
        srv._cmd("pg_ctl", "-D", str(srv.datadir), "-l", str(srv.logfile), "-o", opts, "-w", "-t", "600", "start",
                 timeout=660)
        yield srv
    finally:
        srv.destroy()


# -- processes ------------------------------------------------------------------------------------


def can_unshare_uts() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("hostname") is None:
        return False
    try:
        tried = subprocess.run(["unshare", "--uts", "sh", "-c", "hostname airlock-probe && true"],
                               capture_output=True, timeout=PATIENCE)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return tried.returncode == 0


needs_unshare_uts = pytest.mark.skipif(
    not can_unshare_uts(), reason="simulating another host needs root, unshare --uts and hostname")


def on_host(name: str) -> list[str]:
    """A command prefix that runs the command under the host name ``name`` (a UTS namespace of its
    own; the same boot, PID namespace and network: only the host name tells it from this host)."""
    return ["unshare", "--uts", "sh", "-c", f'hostname {name} && exec "$0" "$@"']


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    (tmp_path / "agent_tools.py").write_text(TOOLS)
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "many.py").write_text(MANY)
    for name in ("EFFECTS", "HOLD", "CHECKED", "GO"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("PATIENCE", str(PATIENCE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("agent_tools", None)


_spawned: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_process_left() -> Iterator[None]:
    """Every process a test started is killed (SIGKILL, also when stopped) and reaped at its end."""
    yield
    while _spawned:
        proc = _spawned.pop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(PATIENCE)


def spawn(agent: Path, name: str, argv: list[str], prefix: Sequence[str] = (),
          env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``argv`` (under ``prefix``, with ``env`` added to the environment); its stdout is read
    by the test, its stderr goes to NAME.err."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(agent), str(ROOT)]), **(env or {})}
    with (agent / f"{name}.err").open("w") as err:
        proc = subprocess.Popen([*prefix, *argv], stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=agent)
    _spawned.append(proc)
    return proc


def guard_process(agent: Path, name: str, db: str, call_id: str, prefix: Sequence[str] = (),
                  env: dict[str, str] | None = None, **config: Any) -> subprocess.Popen[str]:
    return spawn(agent, name, [sys.executable, "child.py", db, call_id, json.dumps(config)], prefix, env)


def read_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], PATIENCE)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        proc.wait(PATIENCE)
        raise AssertionError(f"the process said nothing (exit {proc.returncode})")
    return line.strip()


def result_of(proc: subprocess.Popen[str]) -> Any:
    """What the guarded call in ``proc`` returned (a value, or a refusal's code); the process ends."""
    line = read_line(proc)
    assert line.startswith("result "), line
    proc.wait(PATIENCE)
    return json.loads(line.removeprefix("result "))


def stderr_of(agent: Path, name: str) -> str:
    return (agent / f"{name}.err").read_text()


def wait_until(done: Callable[[], bool], what: str) -> None:
    """Poll ``done`` until it holds; only a test gone wrong waits PATIENCE."""
    deadline = time.monotonic() + PATIENCE
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def airlock_on(agent: Path, host: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    """``airlock ARGS`` in a process of its own, under the host name ``host`` (None: this host's)."""
    env = {k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"}
    env["PYTHONPATH"] = os.pathsep.join([str(agent), str(ROOT)])
    prefix = on_host(host) if host is not None else []
    return subprocess.run([*prefix, sys.executable, "-m", "cli", *args], capture_output=True, text=True, env=env,
                          cwd=agent, timeout=PATIENCE)


# -- what the journal says ----------------------------------------------------------------------


def effects(agent: Path) -> list[list[str]]:
    """Each effect the tool made: [call_id, attempt, pid, host]."""
    path = agent / "effects"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def checks_asked(agent: Path) -> list[str]:
    path = agent / "checked"
    return path.read_text().splitlines() if path.exists() else []


def shown(db: str, call_id: str) -> dict[str, Any]:
    result = invoke("journal", "show", call_id, "--db", db, "--json")
    assert result.exit_code == 0, result.output
    found: dict[str, Any] = json.loads(result.stdout)
    return found


def lease_of(db: str, call_id: str) -> tuple[bool, datetime]:
    """Whether the lease the call's current pending event names still runs by the server's clock,
    and when it runs out."""
    with open_journal(db, create=False) as j:
        holder = [(e.owner or {}).get("lease") for e in j.call_events(call_id) if e.kind == "pending"][-1]
    with psycopg.connect(db, connect_timeout=30) as conn:
        row = conn.execute("SELECT expires_at > clock_timestamp(), expires_at FROM leases "
                           "WHERE call_id = %s AND holder = %s", (call_id, holder)).fetchone()
    assert row is not None, "the running call's lease is not in the store"
    return bool(row[0]), row[1]


def reconcile_outcomes(output: str) -> list[tuple[str, str]]:
    return [(r["call_id"], r["outcome"]) for r in map(json.loads, output.splitlines())]


def history(db: str, call_id: str) -> list[tuple[str, int, str]]:
    with open_journal(db, create=False) as j:
        return [(e.kind, e.attempt, e.actor) for e in j.call_events(call_id)]


def assert_left_alone(agent: Path, db: str, call_id: str) -> None:
    """From this host, the call's owner is alive: show says so, reconcile skips it, resolve needs
    --force, and a retry is refused without its check being asked."""
    call = shown(db, call_id)
    assert (call["status"], call["owner_state"]) == ("pending", "alive"), call
    assert "pending (owner alive)" in invoke("journal", "show", "--db", db).stdout
    asked = invoke("journal", "reconcile", "--with", "agent_tools:CHECKS", "--db", db, "--json")
    assert asked.exit_code == 0, asked.output
    outcomes = reconcile_outcomes(asked.stdout)
    assert (call_id, "skipped") in outcomes and {o for _, o in outcomes} == {"skipped"}, outcomes
    refused = invoke("journal", "resolve", call_id, "--not-applied", "--reason", "looks stuck", "--db", db)
    assert refused.exit_code == 1 and "--force" in refused.output, refused.output
    retry = guard_process(agent, "retry", db, call_id, lease=LEASE)
    assert result_of(retry) == "effect_status_unknown"
    assert checks_asked(agent) == []
    assert shown(db, call_id)["status"] == "pending"


def kinds(db: str, call_id: str) -> list[str]:
    return [kind for kind, _, _ in history(db, call_id)]


# -- 1. a server restart -------------------------------------------------------------------------


def test_a_lease_outlives_a_server_restart_and_the_call_is_reconciled_once_after_a_kill(
    agent: Path, own_server: PgServer,
) -> None:
    db = fresh_database(own_server)
    (agent / "hold").touch()
    child = guard_process(agent, "child", db, "call_r", lease=LEASE, hold="after")
    assert read_line(child) == "started"
    # Another call runs across the restart, and finishes after it.
    (agent / "hold_s").touch()
    finisher = guard_process(agent, "finisher", db, "call_s", env={"HOLD": str(agent / "hold_s")},
                             lease=LEASE, hold="after")
    assert read_line(finisher) == "started"
    before = shown(db, "call_r")
    assert (before["status"], before["owner_state"]) == ("pending", "alive") and before["lease_expires_at"]

    own_server.stop("fast")
    try:
        # While the server is down, the child's renewals fail (the guard logs each) and its tool runs on.
        wait_until(lambda: "could not renew the lease of call_r" in stderr_of(agent, "child"),
                   "the child never tried to renew its lease while the server was down")
        # The child is paused across the restart, so that it cannot renew the moment the server is
        # back: its lease then runs out by the server's clock, a state the test sees, not a race.
        child.send_signal(signal.SIGSTOP)
    finally:
        own_server.start()
    wait_until(lambda: not lease_of(db, "call_r")[0], "the paused child's lease never ran out")
    # The lease is no evidence any more; the process this host sees is: the owner is alive.
    assert_left_alone(agent, db, "call_r")

    child.send_signal(signal.SIGCONT)
    _, ran_out_at = lease_of(db, "call_r")
    # The renewal that finds the connection of the old server dead is tried again on a new one.
    wait_until(lambda: lease_of(db, "call_r")[0] and lease_of(db, "call_r")[1] > ran_out_at,
               "the lease was never renewed after the restart")
    renewed = shown(db, "call_r")
    assert renewed["owner_state"] == "alive" and renewed["lease_expires_at"] > before["lease_expires_at"]
    assert_left_alone(agent, db, "call_r")
    assert shown(db, "call_s")["owner_state"] == "alive"

    # Its outcome, written on a connection to the old server, is recorded once: the call committed.
    (agent / "hold_s").unlink()
    assert result_of(finisher) == {"charged": "call_s", "attempt": 1}
    assert kinds(db, "call_s") == ["pending", "committed"]
    assert sorted(e[0] for e in effects(agent)) == ["call_r", "call_s"]

    child.send_signal(signal.SIGKILL)
    child.wait(PATIENCE)
    wait_until(lambda: shown(db, "call_r")["owner_state"] == "gone", "the killed child's lease never ran out")

    # Two reconcilers at once: the call is settled once.
    reconcilers = [spawn(agent, f"reconciler{i}", [sys.executable, "-m", "cli", "journal", "reconcile", "--with",
                                                   "agent_tools:CHECKS", "--db", db, "--json"]) for i in (1, 2)]
    outcomes: list[tuple[str, str]] = []
    for proc in reconcilers:
        out, _ = proc.communicate(timeout=PATIENCE)
        assert proc.returncode == 0, stderr_of(agent, f"reconciler{reconcilers.index(proc) + 1}")
        if out.strip() != "No call in doubt.":
            outcomes += reconcile_outcomes(out)
    assert outcomes.count(("call_r", "applied")) == 1, outcomes
    assert {o for _, o in outcomes} <= {"applied", "skipped"}, outcomes
    again = invoke("journal", "reconcile", "--with", "agent_tools:CHECKS", "--db", db)
    assert again.exit_code == 0 and again.output == "No call in doubt.\n"

    assert kinds(db, "call_r") == ["pending", "refused", "refused", "committed"]
    assert history(db, "call_r")[-1] == ("committed", 1, "reconciler:charge_exists")
    # The agent's retry gets the backend's value; the tool never runs again.
    assert result_of(guard_process(agent, "late", db, "call_r", lease=LEASE)) == {"charged": "call_r", "attempt": 1}
    assert sorted(e[:2] for e in effects(agent)) == [["call_r", "1"], ["call_s", "1"]]
    with open_journal(db, create=False) as j:
        assert j.verify().ok


# -- 2. a server frozen mid-call -------------------------------------------------------------------

# Small deadlines, so that a renewal sent to the frozen server is cut off by the client in seconds.
QUICK = {"busy_timeout": 1.0, "connect_timeout": 1.0, "timeout": 2.0}


def freeze_until_the_lease_runs_out(agent: Path, own_server: PgServer, db: str, child: subprocess.Popen[str],
                                    call_id: str) -> None:
    """Freeze the server while the child's tool runs until the child has failed to renew its lease;
    pause the child (it cannot renew the moment the server thaws), thaw the server, and wait until
    the lease has run out by the server's clock. The child is left paused.

    A renewal is cut off by the child's own deadline (QUICK: 1 + 2 s, no less than LEASE) after it
    was sent, and the child renews every LEASE / 3: once one is reported cut off, the last that
    landed is at least LEASE old, and the lease has run out by the server's clock while it was
    frozen. The child is paused only so that no renewal of its can land between the thaw and the
    checks: which of the two comes first would otherwise be a race."""
    with frozen(own_server):
        wait_until(lambda: f"could not renew the lease of {call_id}" in stderr_of(agent, "child"),
                   "the child's renewal was never cut off while the server was frozen")
        child.send_signal(signal.SIGSTOP)
    # The renewal cut off may still be carried out as the server thaws (it reached the server's
    # socket): then the lease runs out that much later, the child being paused.
    wait_until(lambda: not lease_of(db, call_id)[0], "the paused child's lease never ran out")


def test_a_server_frozen_past_the_lease_leaves_a_running_owner_alive_and_never_runs_it_again(
    agent: Path, own_server: PgServer,
) -> None:
    db = fresh_database(own_server)
    (agent / "hold").touch()
    child = guard_process(agent, "child", db, "call_f", lease=LEASE, hold="after", journal=QUICK)
    assert read_line(child) == "started"
    assert shown(db, "call_f")["owner_state"] == "alive"

    freeze_until_the_lease_runs_out(agent, own_server, db, child, "call_f")
    # The lease ran out, but the child runs on this host: its owner is alive, and nothing runs it again.
    assert_left_alone(agent, db, "call_f")
    child.send_signal(signal.SIGCONT)
    wait_until(lambda: lease_of(db, "call_f")[0], "the lease was never renewed after the freeze")
    assert_left_alone(agent, db, "call_f")

    (agent / "hold").unlink()
    assert result_of(child) == {"charged": "call_f", "attempt": 1}
    assert [e[:2] for e in effects(agent)] == [["call_f", "1"]]
    assert kinds(db, "call_f") == ["pending", "refused", "refused", "committed"]
    with open_journal(db, create=False) as j:
        record = j.call("call_f")
        assert record is not None and (record.status, record.attempt) == ("committed", 1)
        assert j.verify().ok
    assert result_of(guard_process(agent, "late", db, "call_f")) == {"charged": "call_f", "attempt": 1}
    assert len(effects(agent)) == 1


@needs_unshare_uts
def test_a_server_frozen_past_the_lease_of_another_hosts_guard_is_fenced_by_the_attempt(
    agent: Path, own_server: PgServer,
) -> None:
    # The guard runs under another host name: this host cannot see its process, so the lease is
    # the only evidence of its owner. A frozen server keeps its renewals from landing, and the lease
    # runs out by the server's clock: from here the owner is then gone, as the contract says, and a
    # reconciler whose backend has not seen the charge yet releases the call, so that a retry runs
    # it again as attempt 2. The tool of attempt 1 then finishes: it, too, takes effect (two effects
    # for one id: across hosts at most once holds only while leases are renewed), and its late
    # outcome is appended with its own attempt, which fences it: the call's record stays attempt 2's,
    # and a replay returns attempt 2's value.
    db = fresh_database(own_server)
    (agent / "hold").touch()
    child = guard_process(agent, "child", db, "call_x", on_host("airlock-other-host"),
                          lease=LEASE, hold="before", journal=QUICK)
    assert read_line(child) == "started"
    assert shown(db, "call_x")["owner_state"] == "alive"  # its lease runs
    skipped = invoke("journal", "reconcile", "--with", "agent_tools:CHECKS", "--db", db, "--json")
    assert reconcile_outcomes(skipped.stdout) == [("call_x", "skipped")]

    freeze_until_the_lease_runs_out(agent, own_server, db, child, "call_x")
    assert shown(db, "call_x")["owner_state"] == "gone"
    settled = invoke("journal", "reconcile", "--with", "agent_tools:CHECKS", "--db", db, "--json")
    assert settled.exit_code == 0, settled.output
    assert reconcile_outcomes(settled.stdout) == [("call_x", "not_applied")]
    assert result_of(guard_process(agent, "retry", db, "call_x", lease=LEASE)) == {"charged": "call_x", "attempt": 2}

    child.send_signal(signal.SIGCONT)
    (agent / "hold").unlink()
    assert result_of(child) == {"charged": "call_x", "attempt": 1}  # its caller still gets its value

    assert sorted(e[1] for e in effects(agent)) == ["1", "2"]
    assert [e[3] for e in effects(agent) if e[1] == "1"] == ["airlock-other-host"]
    assert history(db, "call_x") == [
        ("pending", 1, "guard"),
        ("released", 1, "reconciler:charge_exists"),
        ("pending", 2, "guard"),
        ("committed", 2, "guard"),
        ("committed", 1, "guard"),  # late: appended, not taken into the record
    ]
    with open_journal(db, create=False) as j:
        record = j.call("call_x")
        assert record is not None and (record.status, record.attempt) == ("committed", 2)
        assert record.value is not None and json.loads(record.value) == {"charged": "call_x", "attempt": 2}
        assert j.verify().ok
    shown_now = shown(db, "call_x")
    assert (shown_now["status"], shown_now["attempt"], shown_now["owner_state"]) == ("committed", 2, None)
    assert result_of(guard_process(agent, "late", db, "call_x")) == {"charged": "call_x", "attempt": 2}
    assert len(effects(agent)) == 2


# -- 3. a server at its connection limit ----------------------------------------------------------

GUARDS = 16
NEIGHBOURS = 4  # sessions of another application, held through the run: the guards share the rest
SHARED_IDS = 2


def test_guards_past_the_connection_limit_fail_closed_and_never_run_a_call_twice(
    agent: Path, limited_server: PgServer,
) -> None:
    db = fresh_database(limited_server)
    open_journal(db).close()  # the schema is made once, before the guards race
    neighbours = [psycopg.connect(limited_server.dsn, connect_timeout=30) for _ in range(NEIGHBOURS)]
    try:
        guards = [spawn(agent, f"guard{i}", [sys.executable, "many.py", db, f"p{i}", str(SHARED_IDS)])
                  for i in range(GUARDS)]
        for proc in guards:
            assert read_line(proc) == "ready"
        (agent / "go").touch()  # all at once
        reports = []
        for i, proc in enumerate(guards):
            line = read_line(proc)
            assert line.startswith("report "), line
            reports.append(json.loads(line.removeprefix("report ")))
            proc.wait(PATIENCE)
            assert proc.returncode == 0, stderr_of(agent, f"guard{i}")
    finally:
        for conn in neighbours:
            conn.close()

    for i in range(GUARDS):
        assert "Traceback" not in stderr_of(agent, f"guard{i}"), stderr_of(agent, f"guard{i}")
    assert "too many clients" in limited_server.logfile.read_text(), "the guards never reached the limit"
    for report in reports:
        assert report["results"] is not None, report["opens_refused"][-1]  # opened within PATIENCE
        for error in report["opens_refused"]:  # a clear error at open, nothing half made
            assert "cannot be reached" in error and "too many clients" in error, error

    made = Counter(e[0] for e in effects(agent))
    assert all(n == 1 for n in made.values()), made  # no tool ran twice for one id
    with open_journal(db, create=False) as j:
        # Never an effect without its pending record: the attempt, recorded by the process that ran it.
        for call_id, attempt, pid, _ in effects(agent):
            owners = [(e.owner or {}).get("pid") for e in j.call_events(call_id)
                      if e.kind == "pending" and e.attempt == int(attempt)]
            assert owners == [int(pid)], (call_id, attempt, owners)
        for report in reports:
            for call_id, result in report["results"]:
                if "value" in result:
                    assert result["value"]["charged"] == call_id and made[call_id] == 1, (call_id, result)
                elif call_id.startswith("shared-"):
                    assert result["code"] in ("store_unavailable", "effect_status_unknown"), (call_id, result)
                else:  # an id of its own, called once: it ran once, or it was refused and did not run
                    assert result["code"] == "store_unavailable" and made[call_id] == 0, (call_id, result)
                    record = j.call(call_id)
                    assert record is None or record.status == "pending", record
        # Every value given for one id is the one effect's.
        for call_id in made:
            values = {json.dumps(result["value"], sort_keys=True) for report in reports
                      for got, result in report["results"] if got == call_id and "value" in result}
            assert len(values) <= 1, (call_id, values)
        assert j.verify().ok
    verified = invoke("journal", "verify", "--db", db)
    assert verified.exit_code == 0, verified.output


# -- 4. guards of two hosts on one journal --------------------------------------------------------


@needs_unshare_uts
def test_guards_of_two_hosts_race_one_call_and_each_sees_the_others_call_alive(agent: Path) -> None:
    # No lease: a pending call's owner on another host cannot be seen, so nothing says it is gone,
    # and it is alive to every process that cannot see it; on its own host, its process is the evidence.
    db = fresh_schema()
    (agent / "hold").touch()
    hosts = {"a": "airlock-host-a", "b": "airlock-host-b"}
    racers = {side: guard_process(agent, f"racer_{side}", db, "call_1", on_host(host), hold="after", wait_go=True)
              for side, host in hosts.items()}
    for proc in racers.values():
        assert read_line(proc) == "ready"
    (agent / "go").touch()
    said = {side: read_line(proc) for side, proc in racers.items()}
    assert sorted(said.values()) == ['result "effect_status_unknown"', "started"], said
    winner = next(side for side, line in said.items() if line == "started")
    loser = "b" if winner == "a" else "a"
    racers[loser].wait(PATIENCE)
    assert [e[0] for e in effects(agent)] == ["call_1"] and effects(agent)[0][3] == hosts[winner]

    # Each host's retries of the other's call, and of its own.
    for side in (loser, winner):
        retry = guard_process(agent, f"retry_{side}", db, "call_1", on_host(hosts[side]))
        assert result_of(retry) == "effect_status_unknown"
    # Each host, and this one, sees the call's owner alive, and neither reconciles nor resolves it.
    for host in (*hosts.values(), None):
        show = airlock_on(agent, host, "journal", "show", "call_1", "--db", db, "--json")
        assert show.returncode == 0, show.stderr
        assert json.loads(show.stdout)["owner_state"] == "alive", (host, show.stdout)
    for host in hosts.values():
        asked = airlock_on(agent, host, "journal", "reconcile", "--with", "agent_tools:CHECKS", "--db", db, "--json")
        assert asked.returncode == 0, asked.stderr
        assert reconcile_outcomes(asked.stdout) == [("call_1", "skipped")], (host, asked.stdout)
        refused = airlock_on(agent, host, "journal", "resolve", "call_1", "--not-applied", "--reason", "stuck",
                             "--db", db)
        assert refused.returncode == 1 and "--force" in refused.stderr, (host, refused.stderr)
    assert checks_asked(agent) == [] and len(effects(agent)) == 1

    # The winner is killed. Only its own host can tell: there its process has ended.
    racers[winner].send_signal(signal.SIGKILL)
    racers[winner].wait(PATIENCE)
    other = airlock_on(agent, hosts[loser], "journal", "show", "call_1", "--db", db, "--json")
    assert json.loads(other.stdout)["owner_state"] == "alive", other.stdout
    asked = airlock_on(agent, hosts[loser], "journal", "reconcile", "--with", "agent_tools:CHECKS", "--db", db,
                       "--json")
    assert reconcile_outcomes(asked.stdout) == [("call_1", "skipped")], asked.stdout
    assert checks_asked(agent) == []
    own = airlock_on(agent, hosts[winner], "journal", "show", "call_1", "--db", db, "--json")
    assert json.loads(own.stdout)["owner_state"] == "gone", own.stdout
    settled = airlock_on(agent, hosts[winner], "journal", "reconcile", "--with", "agent_tools:CHECKS", "--db", db,
                         "--json")
    assert settled.returncode == 0, settled.stderr
    assert reconcile_outcomes(settled.stdout) == [("call_1", "applied")], settled.stdout

    for side in (loser, winner):
        retry = guard_process(agent, f"replay_{side}", db, "call_1", on_host(hosts[side]))
        assert result_of(retry) == {"charged": "call_1", "attempt": 1}
    assert len(effects(agent)) == 1
    assert kinds(db, "call_1") == ["pending", "refused", "refused", "refused", "committed", "replayed", "replayed"]
    with open_journal(db, create=False) as j:
        assert j.verify().ok
