"""Soak: processes make guarded calls on one journal while another SIGKILLs and restarts them.

    python benchmarks/soak.py [--seconds 60] [--procs 4] [--db PATH_OR_URL] [--kill-every 0.5] [--seed N]

Each worker process loops: a new call (fresh tool call id) or a retry of an earlier id (its own or
another worker's, now and then with other arguments), to an irreversible, a costly or a
reversible tool whose run ends at random: a value, its effect done and the response lost
(TimeoutError), a connection reset before any effect (ambiguous), or a plain error before any
effect. Every effect is appended to a side file the moment it happens (O_APPEND), outside the
journal. The supervisor SIGKILLs a random worker every ``--kill-every`` seconds on average and
starts it again, for ``--seconds``; then it stops the workers and checks:

- double effects: a call id of a tool that is not reversible whose effect happened twice (must be 0);
- values lost or changed: a call that returned a value (first run or replay) whose journaled
  call is not committed with that very value (must be 0);
- committed without effect: a committed call whose value no effect produced (must be 0);
- the hash chain and the projection (``verify()``), and crashed workers (must be 0).

It prints one ``name: value`` line per figure and ends with ``RESULT: ok`` (exit 0) or
``RESULT: FAILED`` (exit 1). The journal is a SQLite file in a temporary directory unless
``--db`` names one (a path, or a ``postgresql://`` URL of an empty database or schema).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from guard import Airlock, AirlockContext, SecurityPolicy, get_current_context, is_refusal  # noqa: E402
from guard.effect_guard import EffectGuard, InMemoryEffectStore, reversibility  # noqa: E402
from journal import open_journal  # noqa: E402
from journal.testing import EffectLog  # noqa: E402

TOOLS = {"charge": "irreversible", "send_email": "costly", "set_flag": "reversible"}
# How a tool's run ends, with its weight.
ENDINGS = (("value", 70), ("lost", 12), ("reset", 6), ("error", 12))


def append_line(path: Path, record: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, orjson.dumps(record) + b"\n")
    finally:
        os.close(fd)


def read_lines(path: Path) -> list[dict[str, Any]]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    found = []
    for line in raw.splitlines():
        try:
            found.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue  # a line torn by a kill
    return found


# -- a worker ----------------------------------------------------------------------------------


def worker(db: str, workdir: Path, index: int, seed: int, memory: bool) -> None:
    rng = random.Random(f"{seed}-{index}-{os.getpid()}")
    # --memory: each process guards with a store of its own that a kill forgets (the check must fail).
    journal = InMemoryEffectStore() if memory else open_journal(db)
    effects = EffectLog(workdir / "effects.jsonl")
    issued_path, outcomes_path = workdir / "issued.jsonl", workdir / "outcomes.jsonl"
    policy = SecurityPolicy(effect_guard=EffectGuard(store=journal))
    endings = [e for e, _ in ENDINGS]
    weights = [w for _, w in ENDINGS]

    def make(name: str) -> Any:
        def body(account: str, cents: int) -> dict[str, Any]:
            context = get_current_context()
            assert context is not None
            ending = rng.choices(endings, weights)[0]
            if ending == "error":
                raise ValueError("declined before any effect")
            if ending == "reset":
                raise ConnectionResetError("connection reset before the request was sent")
            nonce = rng.getrandbits(64)
            effects.record(context.tool_call_id, tool=name, nonce=nonce)
            if ending == "lost":
                raise TimeoutError("the response was lost after the effect")
            return {"tool": name, "account": account, "cents": cents, "nonce": nonce}

        body.__name__ = name
        return Airlock(policy)(reversibility(TOOLS[name])(body))  # type: ignore[arg-type]

    tools = {name: make(name) for name in TOOLS}
    earlier: list[dict[str, Any]] = []
    made = 0
    while True:
        if made % 50 == 0:
            earlier = read_lines(issued_path)[-5000:]
        made += 1
        if earlier and rng.random() < 0.35:
            call = dict(rng.choice(earlier))
            if rng.random() < 0.05:
                call["cents"] += 1  # the same id for other arguments: a reuse the guard refuses
        else:
            call = {"call_id": f"w{index}-{os.getpid()}-{made}", "tool": rng.choice(sorted(TOOLS)),
                    "account": f"acct_{rng.randrange(20)}", "cents": rng.choice([100, 250, 500])}
            append_line(issued_path, call)
        with AirlockContext(agent_id=f"worker-{index}", metadata={"tool_call_id": call["call_id"]}):
            try:
                result = tools[call["tool"]](call["account"], call["cents"])
            except Exception as e:
                outcome = {"call_id": call["call_id"], "kind": "raised", "type": type(e).__name__}
            else:
                if is_refusal(result):
                    outcome = {"call_id": call["call_id"], "kind": "refused", "code": result["block_reason"]}
                else:
                    outcome = {"call_id": call["call_id"], "kind": "value", "value": result}
        append_line(outcomes_path, outcome)


# -- the supervisor ----------------------------------------------------------------------------


def start_worker(db: str, workdir: Path, index: int, seed: int, memory: bool) -> subprocess.Popen[bytes]:
    log = open(workdir / f"worker-{index}.log", "ab")  # noqa: SIM115  (the child keeps it)
    try:
        return subprocess.Popen(
            [sys.executable, __file__, "--worker", str(index), "--db", db, "--workdir", str(workdir),
             "--seed", str(seed), *(["--memory"] if memory else [])],
            stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT,
        )
    finally:
        log.close()


def supervise(
    db: str, workdir: Path, seconds: float, procs: int, kill_every: float, seed: int, memory: bool
) -> dict[str, Any]:
    rng = random.Random(seed)
    workers = [start_worker(db, workdir, i, seed, memory) for i in range(procs)]
    kills = crashes = 0
    deadline = time.monotonic() + seconds
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                break
            time.sleep(min(rng.expovariate(1.0 / kill_every), deadline - now))
            for i, proc in enumerate(workers):
                if proc.poll() is not None:  # a worker is only ever meant to die by our SIGKILL
                    crashes += 1
                    workers[i] = start_worker(db, workdir, i, seed, memory)
            victim = rng.randrange(procs)
            os.kill(workers[victim].pid, signal.SIGKILL)
            workers[victim].wait()
            kills += 1
            workers[victim] = start_worker(db, workdir, victim, seed, memory)
    finally:
        for proc in workers:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return {"kills": kills, "crashes": crashes}


def check(db: str, workdir: Path) -> dict[str, Any]:
    issued = {c["call_id"]: c for c in read_lines(workdir / "issued.jsonl")}
    outcomes = read_lines(workdir / "outcomes.jsonl")
    effects = EffectLog(workdir / "effects.jsonl").entries()
    journal = open_journal(db, readonly=True)
    try:
        report = journal.verify()
        records = {r.call_id: r for r in journal.calls(limit=None)}
        stats = journal.stats()
    finally:
        journal.close()

    effect_counts = Counter(e["call_id"] for e in effects)
    nonces = {(e["call_id"], e["nonce"]) for e in effects}
    double = {c: n for c, n in effect_counts.items() if n > 1 and TOOLS[issued[c]["tool"]] != "reversible"}
    reran = sum(n - 1 for c, n in effect_counts.items() if n > 1 and TOOLS[issued[c]["tool"]] == "reversible")

    values: dict[str, list[Any]] = defaultdict(list)
    for outcome in outcomes:
        if outcome["kind"] == "value":
            values[outcome["call_id"]].append(outcome["value"])
    # A reversible call may run again while an earlier attempt still runs; the later attempt's value
    # is the one kept, so only the values of tools that are not reversible must all be the stored one.
    lost_or_changed = superseded = 0
    for call_id, seen in values.items():
        record = records.get(call_id)
        stored = None if record is None or record.value is None else orjson.loads(record.value)
        intact = record is not None and record.status == "committed" and all(v == stored for v in seen)
        if intact:
            continue
        if TOOLS[issued[call_id]["tool"]] == "reversible":
            superseded += 1
        else:
            lost_or_changed += 1
    committed_without_effect = 0
    for call_id, record in records.items():
        committed = record.status == "committed" and record.value is not None
        if committed and (call_id, orjson.loads(record.value)["nonce"]) not in nonces:
            committed_without_effect += 1

    kinds = Counter(o["kind"] for o in outcomes)
    refusals = Counter(o.get("code") for o in outcomes if o["kind"] == "refused")
    # What the journal said when it could not record: "store could not record KIND for ...: Error('...')".
    store_errors: Counter[str] = Counter()
    for name in sorted(os.listdir(workdir)):
        if name.startswith("worker-"):
            for line in (workdir / name).read_text(errors="replace").splitlines():
                found = re.search(r"store could not record (\w+) for .*?\): (.*)$", line)
                if found:
                    store_errors[f"{found.group(1)}: {re.sub(r'[0-9.]+', 'N', found.group(2))[:160]}"] += 1
    return {
        "calls issued (new ids)": len(issued),
        "calls completed": len(outcomes),
        "  returned a value": kinds["value"],
        "  a value again (a replay)": sum(len(v) - 1 for v in values.values()),
        "  raised": kinds["raised"],
        "  refused": kinds["refused"],
        **{f"    {code}": n for code, n in sorted(refusals.items())},
        "effects": len(effects),
        "reversible re-runs (allowed)": reran,
        "double effects": len(double),
        "values lost or changed": lost_or_changed,
        "reversible values superseded by a later attempt (allowed)": superseded,
        "committed without effect": committed_without_effect,
        "store errors logged": sum(store_errors.values()),
        **{f"  {message}": n for message, n in store_errors.most_common(5)},
        "journal events": report.events,
        "journal calls": stats.calls,
        **{f"  {status}": n for status, n in sorted(stats.by_status.items())},
        "chain and projection verify": "ok" if report.ok else f"FAILED at seq {report.first_bad_seq}: {report.problem}",
        "_ok": report.ok and not double and not lost_or_changed and not committed_without_effect,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--db", help="a SQLite path or a postgresql:// URL (default: a file in a temp dir)")
    parser.add_argument("--kill-every", type=float, default=0.5, help="mean seconds between kills")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true",
                        help="guard each process with its own in-memory store (shows what the checks catch)")
    opts = parser.parse_args()

    if opts.worker is not None:
        worker(opts.db, Path(opts.workdir), opts.worker, opts.seed, opts.memory)
        return

    seed = opts.seed if opts.seed is not None else random.randrange(1 << 30)
    with tempfile.TemporaryDirectory(prefix="airlock-soak-") as tmp:
        workdir = Path(opts.workdir) if opts.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        db = opts.db or str(workdir / "soak.db")
        open_journal(db).close()  # made once, before the workers race to it
        started = time.monotonic()
        run = supervise(db, workdir, opts.seconds, opts.procs, opts.kill_every, seed, opts.memory)
        elapsed = time.monotonic() - started
        figures = check(db, workdir)
    journal_kind = "PostgreSQL" if db.startswith(("postgresql://", "postgres://")) else "SQLite"
    if opts.memory:
        journal_kind += " (unused: each process guarded by its own in-memory store)"
    ok = figures.pop("_ok") and run["crashes"] == 0
    lines = {
        "journal": journal_kind,
        "seconds": f"{elapsed:.0f}",
        "processes": opts.procs,
        "seed": seed,
        "kills": run["kills"],
        "worker crashes": run["crashes"],
        **figures,
    }
    for name, value in lines.items():
        print(f"{name}: {value}")
    print(f"RESULT: {'ok' if ok else 'FAILED'}")
    sys.stdout.flush()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
