"""The operator console's routes, through Starlette's test client, on SQLite and PostgreSQL: the
sign-in and its refusals (401, CSRF, read-only 403), each page's content, filters and paging,
the streamed export, redaction, and each action's review, confirmation and compare-and-set.

What an action appended is checked by opening the journal again, as the CLI tests do.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.testclient import TestClient

from cli.console.app import create_app
from cli.console.state import Console
from journal import Journal, open_journal
from journal.chain import verify_lines
from tests.cli_support import Tools, invoke
from tests.journals import JOURNAL_PARAMS, Database, JournalFactory, journal_factory
from tests.test_console_support import (
    SECRET_ARGUMENT,
    SECRET_VALUE,
    leave_pending,
    pending_in_this_process,
    seed_console,
)

DASH = "\N{EN DASH}"  # between the ends of a range, as a page writes it
READ_PAGES = ("/", "/calls", "/in-doubt", "/approvals", "/verify", "/export")


def _new_target(made: JournalFactory, directory: Path) -> str:
    """A journal seeded by ``seed_console``, with ``call-orphan`` pending and its owner gone."""
    target = made.target(directory)
    with made.open(target) as journal:
        seed_console(journal)
    leave_pending(target, "call-orphan")
    return target


@pytest.fixture(scope="module", params=JOURNAL_PARAMS)
def seeded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """One seeded journal per store for the tests that only read (module-wide: seeding runs a process)."""
    return _new_target(journal_factory(request), tmp_path_factory.mktemp("console"))


@pytest.fixture
def fresh(journal_kind: JournalFactory, tmp_path: Path) -> str:
    """A seeded journal of its own, of every store (tests/conftest.py), for a test that writes."""
    return _new_target(journal_kind, tmp_path)


@dataclass
class Signed:
    """A test client signed in to a console, and the console."""

    client: TestClient
    console: Console

    def get(self, path: str, **kw: Any) -> Any:
        return self.client.get(path, **kw)

    def csrf(self, path: str = "/calls/call-timeout") -> str:
        found = re.search(r'name="csrf_token" value="([^"]+)"', self.get(path).text)
        assert found, f"no form on {path}"
        return found.group(1)

    def post(self, path: str, fields: dict[str, str], csrf: str | None = None) -> Any:
        token = self.console.sessions.csrf(_session_of(self)) if csrf is None else csrf
        return self.client.post(path, data={"csrf_token": token or "", **fields})


def _session_of(signed: Signed) -> str | None:
    return signed.client.cookies.get(signed.console.sessions.cookie)


@contextmanager
def console_for(target: str, *, allow_write: bool = False, redact: frozenset[str] = frozenset(),
                operator: str = "alice", sign_in: bool = True) -> Iterator[Signed]:
    """A console over ``target`` (read-only open, as ``serve`` makes it) and a client, signed in
    through the one-time token unless ``sign_in`` is false."""
    journal = open_journal(target, readonly=True, create=False)
    console = Console(journal=journal, target=target, allow_write=allow_write, operator=operator, redact=redact)
    try:
        with TestClient(create_app(console), follow_redirects=False) as client:
            signed = Signed(client, console)
            if sign_in:
                answer = client.get(f"/?token={console.sessions.token}")
                assert answer.status_code == 303, answer.text
            yield signed
    finally:
        journal.close()


def reopened(target: str) -> Journal:
    return open_journal(target, readonly=True, create=False)


def text_of(page: str) -> str:
    """The page's text, roughly as a reader sees it: tags dropped, entities read, whitespace collapsed."""
    spaced = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)).strip()
    return html.unescape(re.sub(r" ([,.;:)])", r"\1", spaced))


def call_ids_listed(page: str) -> list[str]:
    """The call ids linked from a list of calls, in order."""
    return [html.unescape(m) for m in re.findall(r'<a href="/calls/[^"]+"><code>(.*?)</code></a>', page)]


# -- the gate ------------------------------------------------------------------------------------


def test_every_request_without_a_session_gets_401(seeded: str) -> None:
    with console_for(seeded, allow_write=True, sign_in=False) as signed:
        for path in (*READ_PAGES, "/calls/call-ok", "/events/1", "/export/download", "/verify/run",
                     "/static/console.css", "/no-such-page"):
            answer = signed.get(path)
            assert answer.status_code == 401, path
            assert "one-time URL" in answer.text
        for path in ("/resolve", "/decide"):
            assert signed.client.post(path, data={"call_id": "call-timeout"}).status_code == 401
        # A cookie the server never gave is no session.
        signed.client.cookies.set(signed.console.sessions.cookie, "made-up")
        assert signed.get("/").status_code == 401


def test_the_token_url_signs_in_once_and_leads_to_the_page_without_it(seeded: str) -> None:
    with console_for(seeded, sign_in=False) as signed:
        token = signed.console.sessions.token
        answer = signed.get(f"/calls?status=unknown&token={token}")
        assert answer.status_code == 303
        assert answer.headers["location"] == "/calls?status=unknown"
        cookie = answer.headers["set-cookie"]
        assert cookie.startswith(f"{signed.console.sessions.cookie}=")
        assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower() and "Path=/" in cookie
        assert token not in cookie
        page = signed.get("/calls?status=unknown")
        assert page.status_code == 200 and "call-timeout" in page.text
        # Signed in already: the token is only taken off the URL.
        assert signed.get(f"/verify?token={token}").headers["location"] == "/verify"
        # Another browser with the same URL is refused: it worked once.
        with TestClient(create_app(signed.console), follow_redirects=False) as other:
            assert other.get(f"/?token={token}").status_code == 401
            assert other.get("/?token=wrong").status_code == 401
            assert other.get("/").status_code == 401


def test_a_post_without_the_sessions_csrf_token_is_refused_403(fresh: str) -> None:
    with console_for(fresh, allow_write=True) as signed:
        before = signed.console.journal.head()
        fields = {"call_id": "call-timeout", "outcome": "not_applied", "reason": "no charge", "step": "confirm"}
        for csrf in ("", "wrong", signed.csrf() + "x"):
            answer = signed.post("/resolve", fields, csrf=csrf)
            assert answer.status_code == 403, csrf
            assert "CSRF token" in answer.text
        decide = {"call_id": "call-approve", "decision": "approve", "reason": "ok", "step": "confirm"}
        assert signed.post("/decide", decide, csrf="wrong").status_code == 403
        # Another session's token is no good either.
        with console_for(fresh, allow_write=True) as other:
            assert signed.post("/resolve", fields, csrf=other.csrf()).status_code == 403
    with reopened(fresh) as j:
        assert j.head() == before
        assert j.call("call-timeout").status == "unknown"  # type: ignore[union-attr]


def test_a_read_only_console_offers_no_action_and_refuses_every_post_403(seeded: str) -> None:
    with console_for(seeded) as signed:
        before = signed.console.journal.head()
        for path in ("/calls/call-timeout", "/calls/call-orphan", "/calls/call-approve", "/approvals"):
            page = signed.get(path).text
            assert "<form" not in page.replace('<form class="filters"', ""), path
            for button in ("Resolve as applied", "Resolve as not applied", ">Approve<", ">Deny<"):
                assert button not in page, (path, button)
        assert "Read-only" in signed.get("/").text
        csrf = signed.console.sessions.csrf(_session_of(signed)) or ""
        fields = {"csrf_token": csrf, "call_id": "call-timeout", "outcome": "applied", "reason": "x",
                  "step": "confirm"}
        for path in ("/resolve", "/decide"):
            answer = signed.client.post(path, data=fields)
            assert answer.status_code == 403, path
            assert "--allow-write" in answer.text
        assert signed.console.journal.head() == before


def test_every_response_forbids_scripts_frames_and_assets_from_elsewhere(seeded: str) -> None:
    with console_for(seeded, allow_write=True) as signed:
        for path in (*READ_PAGES, "/calls/call-timeout", "/static/console.css"):
            answer = signed.get(path)
            assert answer.status_code == 200, path
            policy = answer.headers["content-security-policy"]
            assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
            assert answer.headers["x-frame-options"] == "DENY"
            assert answer.headers["cache-control"] == "no-store"
            # Nothing from the network: no script, no remote stylesheet, font or image.
            assert "<script" not in answer.text
            assert not re.search(r"""(src|href)=["']?(https?:)?//""", answer.text), path
            assert "@import" not in answer.text and "url(" not in answer.text
        css = signed.get("/static/console.css")
        assert css.headers["content-type"].startswith("text/css")


# -- the pages -----------------------------------------------------------------------------------


def test_the_navigation_names_every_page_and_marks_the_current_one(seeded: str) -> None:
    names = {"/": "Overview", "/calls": "Calls", "/in-doubt": "In doubt", "/approvals": "Approvals",
             "/verify": "Verify", "/export": "Export"}
    with console_for(seeded) as signed:
        for path, name in names.items():
            page = signed.get(path).text
            nav = page[page.index('<nav class="pages" aria-label="Console">'):page.index("</nav>")]
            for href, label in names.items():
                assert f'href="{href}"' in nav and f">{label}</a>" in nav
            assert re.search(rf'<a href="{re.escape(path)}" aria-current="page">{name}</a>', nav), path
            assert f"<h1>{name}</h1>" in page
            assert f"<title>{name} · Airlock console</title>" in page


def test_every_form_control_has_a_visible_label(fresh: str) -> None:
    with open_journal(fresh) as writer, pending_in_this_process(writer, "call-live"), \
            console_for(fresh, allow_write=True) as signed:
        for path in ("/calls", "/approvals", "/export", "/calls/call-timeout", "/calls/call-live",
                     "/calls/call-approve"):
            page = signed.get(path).text
            controls = re.findall(r"<(input|select|textarea)\b([^>]*)>", page)
            visible = [attrs for _tag, attrs in controls if 'type="hidden"' not in attrs]
            assert visible, path
            for attrs in visible:
                found = re.search(r'id="([^"]+)"', attrs)
                assert found, (path, attrs)
                assert f'<label for="{found.group(1)}">' in page, (path, attrs)
            for button in re.findall(r"<button\b[^>]*>(.*?)</button>", page, re.S):
                assert button.strip(), path  # every button says what it does


def test_the_overview_counts_calls_doubt_approvals_and_shows_the_head(seeded: str) -> None:
    with console_for(seeded) as signed, reopened(seeded) as j:
        stats = j.stats()
        seq, head_hash = j.head()
        page = signed.get("/")
        assert page.status_code == 200
        text = text_of(page.text)
        for status in ("pending", "unknown", "committed", "released"):
            assert f"{status} {stats.by_status.get(status, 0)}" in text
        assert f"All calls {stats.calls}" in text
        assert "In doubt 2 unknown, or pending with the owner gone" in text  # call-timeout, call-orphan
        assert f"Approvals open {stats.approvals_open}" in text and stats.approvals_open == 3
        assert f"Head seq {seq}" in text and head_hash in page.text
        assert "Not run by this server yet" in text
        assert signed.get("/verify/run").status_code == 303
        assert f"OK {stats.events} events" in text_of(signed.get("/").text)


def test_the_calls_page_lists_every_call_newest_first(seeded: str) -> None:
    with console_for(seeded) as signed, reopened(seeded) as j:
        page = signed.get("/calls")
        expected = [r.call_id for r in j.calls(limit=None)]
        assert call_ids_listed(page.text) == expected
        assert "pending (owner gone)" in page.text  # call-orphan
        assert f"Calls 1{DASH}" in page.text and "Next page" not in page.text


@pytest.mark.parametrize(("query", "expected"), [
    ("status=unknown", ["call-timeout"]),
    ("status=released", ["call-failed"]),
    ("tool=read_balance", ["call-read"]),
    ("agent=agent-2", ["call-read"]),
    ("owner=gone", ["call-orphan"]),
    ("status=pending&owner=gone", ["call-orphan"]),
    ("owner=alive", []),
    ("status=committed&tool=read_balance", ["call-read"]),
    ("since=2099-01-01", []),
])
def test_the_calls_page_filters_by_the_url(seeded: str, query: str, expected: list[str]) -> None:
    with console_for(seeded) as signed:
        page = signed.get(f"/calls?{query}")
        assert page.status_code == 200
        assert call_ids_listed(page.text) == expected
        if not expected:
            assert "No calls match these filters." in page.text
        # The form shows the filters it was given, so the page can be changed from there.
        for name, value in (part.split("=") for part in query.split("&")):
            if name in ("status", "owner"):
                assert f'<option value="{value}" selected>' in page.text
            else:
                assert f'name="{name}" value="{value}"' in page.text


def test_a_submitted_filter_form_leads_to_the_pages_own_address(seeded: str) -> None:
    with console_for(seeded) as signed:
        # What a browser sends from the form: every field, the empty ones too.
        sent = signed.get("/calls?status=unknown&tool=&agent=&owner=&since=&limit=50")
        assert (sent.status_code, sent.headers["location"]) == (303, "/calls?status=unknown")
        sent = signed.get("/calls?status=&tool=charge&agent=&owner=gone&since=2h&limit=25")
        assert sent.headers["location"] == "/calls?tool=charge&owner=gone&since=2h&limit=25"
        assert signed.get("/calls?status=unknown").status_code == 200
        assert signed.get("/approvals?status=&tool=").headers["location"] == "/approvals"


def test_the_calls_page_filters_by_age(seeded: str) -> None:
    with console_for(seeded) as signed, reopened(seeded) as j:
        everything = [r.call_id for r in j.calls(limit=None)]
        assert call_ids_listed(signed.get("/calls?since=1d").text) == everything
        assert call_ids_listed(signed.get("/calls?since=2000-01-01T00:00:00Z").text) == everything


@pytest.mark.parametrize(("query", "problem"), [
    ("status=lost", "Status is one of pending, committed, unknown, released, not 'lost'."),
    ("since=yesterday", "Changed within: 'yesterday' is not a time"),
    ("owner=maybe", "Owner is one of alive, gone, not 'maybe'."),
    ("status=committed&owner=gone", "An owner is alive or gone only for a pending call, not a committed one."),
    ("offset=-1", "The offset '-1' is not a whole number."),
    ("limit=7", "Calls per page is one of 25, 50, 100, 200, not '7'."),
])
def test_a_filter_that_cannot_be_used_is_said_on_the_page(seeded: str, query: str, problem: str) -> None:
    with console_for(seeded) as signed:
        page = signed.get(f"/calls?{query}")
        assert page.status_code == 400
        assert problem in text_of(page.text)
        assert call_ids_listed(page.text) == []


def test_the_calls_page_is_paged_and_its_links_keep_the_filters(tmp_path: Path) -> None:
    target = str(tmp_path / "journal.db")
    with open_journal(target) as journal:
        tools = Tools(journal)
        for n in range(30):
            tools.call(f"call-{n:02d}", tools.read_balance, account=f"acct_{n}")
        tools.call("call-charge", tools.charge, account="acct_1", cents=5)
    with console_for(target) as signed, reopened(target) as j:
        newest = [r.call_id for r in j.calls(tool="read_balance", limit=None)]
        first = signed.get("/calls?tool=read_balance&limit=25")
        assert call_ids_listed(first.text) == newest[:25]
        assert f"Calls 1{DASH}25" in first.text and "Previous page" not in first.text
        next_href = re.search(r'<a href="([^"]+)" rel="next">Next page</a>', first.text)
        assert next_href is not None
        link = next_href.group(1).replace("&amp;", "&")
        assert link == "/calls?tool=read_balance&offset=25&limit=25"
        second = signed.get(link)
        assert call_ids_listed(second.text) == newest[25:]
        assert f"Calls 26{DASH}30" in second.text and "Next page" not in second.text
        previous = re.search(r'<a href="([^"]+)" rel="prev">Previous page</a>', second.text)
        assert previous is not None and previous.group(1).replace("&amp;", "&") == "/calls?tool=read_balance&limit=25"
        past = signed.get("/calls?tool=read_balance&offset=100")
        assert "No calls match past the first 100." in past.text


def test_a_calls_page_shows_its_events_as_a_linked_timeline(seeded: str) -> None:
    with console_for(seeded) as signed, reopened(seeded) as j:
        events = j.call_events("call-timeout")
        page = signed.get("/calls/call-timeout")
        assert page.status_code == 200
        body = page.text
        assert [e.kind for e in events] == ["pending", "unknown", "refused"]
        for event in events:
            item = body[body.index(f'id="seq-{event.seq}"'):]
            item = item[item.index(">") + 1:item.index("</li>")]
            text = text_of(item)
            assert text.startswith(f"seq {event.seq} {event.kind} by {event.actor} attempt {event.attempt}")
            assert event.hash in item and event.prev_hash in item
            assert event.at.strftime("%Y-%m-%dT%H:%M:%S.%fZ") in item
            # The link to the event before it in the chain: on this page, or the event's own page.
            if events[0] is not event and events[events.index(event) - 1].seq == event.seq - 1:
                assert f'href="#seq-{event.seq - 1}"' in item
            else:
                assert f'href="/events/{event.seq - 1}"' in item
        text = text_of(body)
        assert "TimeoutError: backend did not answer" in text
        assert "effect_status_unknown:" in text
        assert '"account": "acct_2"' in text
        assert "Ask the backend whether idempotency key" in text


def test_a_committed_calls_page_shows_its_value(seeded: str) -> None:
    with console_for(seeded) as signed:
        text = text_of(signed.get("/calls/call-ok").text)
        assert '"charge_id": "ch_1"' in text
        assert "replayed" in text
        assert "Settle this call" not in text  # a committed call is not resolved


def test_a_call_with_only_refusals_and_an_unknown_call(seeded: str) -> None:
    with console_for(seeded) as signed:
        refused = signed.get("/calls/call-refused")
        assert refused.status_code == 200
        assert "none: no attempt recorded, only refusals" in refused.text
        assert "policy_violation" in refused.text
        missing = signed.get("/calls/no-such-call")
        assert missing.status_code == 404
        assert "The journal has no call &#39;no-such-call&#39;." in missing.text


def test_an_event_link_leads_to_its_call_and_an_unknown_seq_is_404(seeded: str) -> None:
    with console_for(seeded) as signed, reopened(seeded) as j:
        event = j.call_events("call-failed")[0]
        answer = signed.get(f"/events/{event.seq}")
        assert answer.status_code == 303
        assert answer.headers["location"] == f"/calls/call-failed#seq-{event.seq}"
        assert signed.get(f"/events/{j.head()[0] + 1}").status_code == 404
        assert signed.get("/events/0").status_code == 404


def test_an_event_of_no_call_has_a_page_of_its_own(tmp_path: Path) -> None:
    target = str(tmp_path / "journal.db")
    with open_journal(target) as journal:
        tools = Tools(journal)
        tools.call(None, tools.refund, account="acct_1", cents=5)  # refused, and no tool_call_id to file it under
        tools.call("call-after", tools.read_balance, account="acct_1")
    with console_for(target) as signed, reopened(target) as j:
        orphan = next(e for e in j.events() if e.call_id is None)
        page = signed.get(f"/events/{orphan.seq}")
        assert page.status_code == 200
        text = text_of(page.text)
        assert "This event belongs to no call" in text
        assert f"seq {orphan.seq} refused by guard" in text and orphan.hash in text
        # The next event's page links back to it through its prev_hash.
        assert f'href="/events/{orphan.seq}"' in signed.get("/calls/call-after").text


def test_an_id_with_a_slash_a_space_and_markup_is_shown_and_linked_exactly(tmp_path: Path) -> None:
    target = str(tmp_path / "journal.db")
    odd = "tenant/7 <b>call</b>?x=1#y"
    with open_journal(target) as journal:
        tools = Tools(journal)
        tools.call(odd, tools.read_balance, account="acct_1")
    with console_for(target) as signed:
        listing = signed.get("/calls").text
        assert "<b>call</b>" not in listing and "&lt;b&gt;call&lt;/b&gt;" in listing
        href = re.search(r'<a href="(/calls/tenant[^"]+)">', listing)
        assert href is not None and href.group(1) == "/calls/tenant%2F7%20%3Cb%3Ecall%3C%2Fb%3E%3Fx%3D1%23y"
        page = signed.get(href.group(1))
        assert page.status_code == 200
        assert "Call <code>tenant/7 &lt;b&gt;call&lt;/b&gt;?x=1#y</code>" in page.text


def test_the_in_doubt_queue_holds_unknown_calls_and_pending_ones_whose_owner_is_gone(fresh: str) -> None:
    with open_journal(fresh) as writer, pending_in_this_process(writer, "call-live"), console_for(fresh) as signed:
        page = signed.get("/in-doubt")
        assert page.status_code == 200
        assert sorted(call_ids_listed(page.text)) == ["call-orphan", "call-timeout"]
        text = text_of(page.text)
        assert "In doubt 2" in text
        assert "Pending with a live owner 1" in text  # call-live: running, not in doubt
        assert "pending (owner gone)" in text and "unknown" in text
        alive = signed.get("/calls?owner=alive")
        assert call_ids_listed(alive.text) == ["call-live"]
        assert "pending (owner alive)" in alive.text


def test_the_approvals_inbox_puts_open_requests_first(seeded: str) -> None:
    with console_for(seeded, allow_write=True) as signed:
        page = signed.get("/approvals").text
        listed = call_ids_listed(page)
        opened = {"call-approve", "call-deny", "call-asks-secret"}
        # Each open request is a card (its call linked in the heading and in the form's context),
        # the others a table after them.
        assert set(listed[:3]) == opened
        assert listed[3:] == ["call-denied", "call-approved"]
        assert page.count(">Approve</button>") == 3 and page.count(">Deny</button>") == 3
        text = text_of(page)
        assert "Waiting for a decision" in text
        assert "operator:carol: over the limit" in text and "operator:bob: customer agreed" in text
        denied = signed.get("/approvals?status=denied").text
        assert call_ids_listed(denied) == ["call-denied"]
        assert ">Approve</button>" not in denied
        charge_only = signed.get("/approvals?tool=read_balance").text
        assert call_ids_listed(charge_only) == []
        assert signed.get("/approvals?status=later").status_code == 400


def test_the_verify_page_runs_verify_and_shows_the_result(seeded: str) -> None:
    with console_for(seeded) as signed, reopened(seeded) as j:
        assert "Not run by this server yet." in signed.get("/verify").text
        answer = signed.get("/verify/run")
        assert (answer.status_code, answer.headers["location"]) == (303, "/verify")
        text = text_of(signed.get("/verify").text)
        assert "The journal verifies" in text
        assert f"{j.head()[0]} events checked, head {j.head()[1]}" in text


def _break_chain_at(database: Database, seq: int) -> None:
    """Change the stored value of the event at ``seq`` as someone with the database's files could."""
    database.execute(database.lift_append_only)
    database.execute("UPDATE events SET value = '{\"charge_id\":\"ch_999\"}' WHERE seq = ?", (seq,))


def test_the_verify_page_says_where_the_chain_breaks(journal_kind: JournalFactory, fresh: str) -> None:
    with reopened(fresh) as j:
        committed = next(e for e in j.call_events("call-ok") if e.kind == "committed")
    _break_chain_at(journal_kind.database(fresh), committed.seq)
    with console_for(fresh) as signed:
        signed.get("/verify/run")
        page = signed.get("/verify").text
        assert f"The chain breaks at seq {committed.seq}" in page
        assert f'<a href="/events/{committed.seq}">See the event at seq {committed.seq}</a>' in page
        assert f"Failed at seq {committed.seq}" in text_of(signed.get("/").text)


def _download(signed: Signed, query: str) -> tuple[Any, list[bytes]]:
    with signed.client.stream("GET", f"/export/download?{query}") as answer:
        chunks = list(answer.iter_bytes())
    return answer, chunks


def test_the_export_streams_the_journals_jsonl_which_verifies(seeded: str) -> None:
    with console_for(seeded) as signed, reopened(seeded) as j:
        answer, chunks = _download(signed, "format=jsonl")
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("application/x-ndjson")
        assert answer.headers["content-disposition"].startswith('attachment; filename="airlock-export-')
        assert "content-length" not in answer.headers  # streamed, not built first
        body = b"".join(chunks)
        assert body == b"".join(lines for lines, _ in j.export_lines())
        lines = body.splitlines()
        assert len(lines) == j.head()[0]
        assert verify_lines(orjson.loads(line) for line in lines).ok


def test_the_export_is_filtered_as_the_cli_filters_it_in_csv_too(seeded: str) -> None:
    with console_for(seeded) as signed, reopened(seeded) as j:
        _, chunks = _download(signed, "format=csv&tool=read_balance")
        assert b"".join(chunks) == b"".join(lines for lines, _ in j.export_csv(tool="read_balance"))
        _, chunks = _download(signed, "call=call-timeout")
        seqs = [orjson.loads(line)["seq"] for line in b"".join(chunks).splitlines()]
        assert seqs == [e.seq for e in j.call_events("call-timeout")]
        answer = signed.get("/export/download?since=soon")
        assert answer.status_code == 400 and "Since: &#39;soon&#39; is not a time" in answer.text
        # The calls page links its filters into the export.
        calls = signed.get("/calls?status=unknown&tool=charge&agent=agent-1").text
        assert '<a href="/export?tool=charge&amp;agent=agent-1">' in calls


def test_a_redacted_field_is_never_shown_in_clear(seeded: str) -> None:
    with console_for(seeded) as signed:  # the markers are there to be found without redaction
        assert SECRET_ARGUMENT in signed.get("/calls/call-secret").text
        assert SECRET_VALUE in signed.get("/calls/call-secret-value").text
        assert SECRET_ARGUMENT in signed.get("/approvals").text
    with console_for(seeded, allow_write=True, redact=frozenset({"arguments", "value"})) as signed, \
            reopened(seeded) as j:
        pages = [*READ_PAGES, *(f"/calls/{r.call_id}" for r in j.calls(limit=None)), "/calls/call-asks-secret",
                 "/calls/call-refused", "/approvals?status=open", *(f"/events/{n}" for n in range(1, 4))]
        for path in pages:
            answer = signed.get(path)
            assert answer.status_code in (200, 303), path
            for secret in (SECRET_ARGUMENT, SECRET_VALUE):
                assert secret not in answer.text and secret[:10] not in answer.text, (path, secret)
        secret_page = signed.get("/calls/call-secret").text
        assert 'class="redacted">redacted</span>' in secret_page
        event = j.call_events("call-secret")[0]
        assert event.export()["arguments_sha256"] in secret_page  # what was there can still be checked
        # The export: redacted whatever the URL asks, and it still verifies.
        for query in ("format=jsonl", "format=csv", "format=jsonl&call=call-secret-value"):
            _, chunks = _download(signed, query)
            body = b"".join(chunks)
            assert SECRET_ARGUMENT.encode() not in body and SECRET_VALUE.encode() not in body, query
        _, chunks = _download(signed, "format=jsonl")
        lines = [orjson.loads(line) for line in b"".join(chunks).splitlines()]
        assert all(line["redacted"] == ["arguments", "value"] for line in lines)
        assert verify_lines(lines).ok


def test_the_export_form_redacts_on_request(seeded: str) -> None:
    with console_for(seeded, redact=frozenset({"value"})) as signed:
        form = signed.get("/export").text
        assert "value (always, on this console)" in form
        _, chunks = _download(signed, "redact=arguments")
        lines = [orjson.loads(line) for line in b"".join(chunks).splitlines()]
        assert all(line["redacted"] == ["arguments", "value"] for line in lines)
        assert signed.get("/export/download?redact=owner").status_code == 400


# -- resolve ---------------------------------------------------------------------------------------


def _resolve(signed: Signed, call_id: str, outcome: str, reason: str, step: str = "review",
             **more: str) -> Any:
    return signed.post("/resolve", {"call_id": call_id, "outcome": outcome, "reason": reason, "step": step, **more})


def test_resolve_as_applied_asks_for_confirmation_then_appends_by_the_operator(fresh: str) -> None:
    with console_for(fresh, allow_write=True, operator="alice") as signed:
        before = signed.console.journal.head()
        review = _resolve(signed, "call-timeout", "applied", "ledger shows ch_2", value='{"charge_id": "ch_2"}')
        assert review.status_code == 200
        assert "Confirm: resolve as applied" in review.text
        text = text_of(review.text)
        assert "This appends one event to the journal" in text
        assert "committed for call call-timeout, attempt 1 Actor operator:alice Reason ledger shows ch_2" in text
        assert signed.console.journal.head() == before  # the review appends nothing
        done = _resolve(signed, "call-timeout", "applied", "ledger shows ch_2", step="confirm",
                        value='{"charge_id": "ch_2"}')
        assert done.status_code == 303
        with reopened(fresh) as j:
            record = j.call("call-timeout")
            assert record is not None and record.status == "committed" and record.actor == "operator:alice"
            assert record.value == '{"charge_id":"ch_2"}'
            last = j.call_events("call-timeout")[-1]
            assert (last.kind, last.actor, last.reason) == ("committed", "operator:alice",
                                                            {"code": "applied", "message": "ledger shows ch_2"})
        assert done.headers["location"] == f"/calls/call-timeout?appended={last.seq}#seq-{last.seq}"
        shown = text_of(signed.get(done.headers["location"]).text)
        assert f"Appended seq {last.seq}: committed by operator:alice" in shown
        assert "replays return the value given" in shown


def test_resolve_as_not_applied_releases_an_orphaned_pending_call(fresh: str) -> None:
    with console_for(fresh, allow_write=True, operator="bob") as signed:
        assert _resolve(signed, "call-orphan", "not_applied", "no charge with this key").status_code == 200
        done = _resolve(signed, "call-orphan", "not_applied", "no charge with this key", step="confirm")
        assert done.status_code == 303
        assert "the next call with this id runs the tool again" in signed.get(done.headers["location"]).text
    with reopened(fresh) as j:
        record = j.call("call-orphan")
        assert record is not None and (record.status, record.actor) == ("released", "operator:bob")


def test_resolving_a_committed_call_is_refused_as_the_cli_refuses_it(fresh: str) -> None:
    cli = invoke("journal", "resolve", "call-ok", "--applied", "--reason", "x", "--db", fresh)
    assert cli.exit_code == 1
    with console_for(fresh, allow_write=True) as signed:
        before = signed.console.journal.head()
        for step in ("review", "confirm"):
            answer = _resolve(signed, "call-ok", "applied", "x", step=step)
            assert answer.status_code == 409
            refusal = text_of(answer.text)
            assert cli.stderr.strip().removeprefix("Error: ") in refusal
            assert "Nothing was appended." in refusal
        assert signed.console.journal.head() == before


def test_a_call_settled_between_review_and_confirmation_is_refused(fresh: str) -> None:
    with console_for(fresh, allow_write=True) as signed:
        assert _resolve(signed, "call-timeout", "applied", "ledger has it").status_code == 200
        # Someone else settles it from a shell meanwhile: the confirmation's compare-and-set refuses.
        assert invoke("journal", "resolve", "call-timeout", "--not-applied", "--reason", "no charge",
                      "--db", fresh).exit_code == 0
        with reopened(fresh) as j:
            head = j.head()
        answer = _resolve(signed, "call-timeout", "applied", "ledger has it", step="confirm")
        assert answer.status_code == 409
        assert "'call-timeout'" in text_of(answer.text) and "is released; only a pending or unknown call can be " \
            "resolved. Nothing was appended." in text_of(answer.text)
        with reopened(fresh) as j:
            assert j.head() == head
            assert j.call("call-timeout").status == "released"  # type: ignore[union-attr]


@pytest.mark.parametrize(("fields", "problem"), [
    ({"outcome": "applied", "reason": "  "}, "Say why: the reason is part of the audit trail."),
    ({"outcome": "maybe", "reason": "x"}, "Choose whether the effect happened"),
    ({"outcome": "not_applied", "reason": "x", "value": "1"}, "A value goes with 'applied' only"),
    ({"outcome": "applied", "reason": "x", "value": "ok"}, "The value is not JSON"),
    ({"outcome": "applied", "reason": "x", "value": '{"a": 1, "a": 2}'}, "write each key once"),
])
def test_a_resolve_the_cli_would_call_a_usage_error_is_refused_400(fresh: str, fields: dict[str, str],
                                                                   problem: str) -> None:
    with console_for(fresh, allow_write=True) as signed:
        before = signed.console.journal.head()
        for step in ("review", "confirm"):
            answer = signed.post("/resolve", {"call_id": "call-timeout", "step": step, **fields})
            assert answer.status_code == 400
            assert problem in text_of(answer.text)
            assert "Resolve as applied" in answer.text  # the form again, to put it right
        assert signed.console.journal.head() == before


def test_resolving_a_call_whose_owner_is_alive_needs_force(fresh: str) -> None:
    with open_journal(fresh) as writer, pending_in_this_process(writer, "call-live"), \
            console_for(fresh, allow_write=True) as signed:
        page = signed.get("/calls/call-live").text
        assert '<label for="resolve-force">Force: settle it although its owner is alive' in page
        refused = _resolve(signed, "call-live", "not_applied", "stuck", step="confirm")
        assert refused.status_code == 409
        assert "is pending and its owner" in text_of(refused.text)
        assert "tick Force to settle it anyway. Nothing was appended." in text_of(refused.text)
        with reopened(fresh) as j:
            assert j.call("call-live").status == "pending"  # type: ignore[union-attr]
        review = _resolve(signed, "call-live", "not_applied", "stuck", force="yes")
        assert "yes: settled although its owner is alive" in text_of(review.text)
        done = _resolve(signed, "call-live", "not_applied", "stuck", step="confirm", force="yes")
        assert done.status_code == 303
        with reopened(fresh) as j:
            record = j.call("call-live")
            assert record is not None and record.status == "released" and record.actor == "operator:alice"


def test_resolving_an_unknown_call_is_404(fresh: str) -> None:
    with console_for(fresh, allow_write=True) as signed:
        assert _resolve(signed, "no-such-call", "applied", "x").status_code == 404


# -- approve, deny ---------------------------------------------------------------------------------


def _decide(signed: Signed, call_id: str, decision: str, reason: str = "", step: str = "review",
            **more: str) -> Any:
    return signed.post("/decide", {"call_id": call_id, "decision": decision, "reason": reason, "step": step, **more})


def test_approve_asks_for_confirmation_then_appends_by_the_operator(fresh: str) -> None:
    with console_for(fresh, allow_write=True, operator="alice") as signed:
        before = signed.console.journal.head()
        review = _decide(signed, "call-approve", "approve", "agreed with the customer")
        assert review.status_code == 200 and "Confirm: approve" in review.text
        assert signed.console.journal.head() == before
        request_id = re.search(r'name="request_id" value="([0-9a-f]+)"', review.text)
        assert request_id is not None
        done = _decide(signed, "call-approve", "approve", "agreed with the customer", step="confirm",
                       request_id=request_id.group(1))
        assert done.status_code == 303
        with reopened(fresh) as j:
            request = j.approval_requests(call_id="call-approve")[0]
            assert request.status == "approved" and request.approvers == ("operator:alice",)
            last = j.call_events("call-approve")[-1]
        assert (last.kind, last.actor) == ("approved", "operator:alice")
        assert done.headers["location"] == f"/calls/call-approve?appended={last.seq}#seq-{last.seq}"
        shown = text_of(signed.get(done.headers["location"]).text)
        assert f"Appended seq {last.seq}: approved by operator:alice" in shown


def test_deny_needs_a_reason_and_then_appends_denied(fresh: str) -> None:
    with console_for(fresh, allow_write=True, operator="carol") as signed:
        before = signed.console.journal.head()
        for step in ("review", "confirm"):
            answer = _decide(signed, "call-deny", "deny", "  ", step=step)
            assert answer.status_code == 400
            assert "Say why you deny it" in answer.text
        assert signed.console.journal.head() == before
        done = _decide(signed, "call-deny", "deny", "amount above the limit", step="confirm")
        assert done.status_code == 303
    with reopened(fresh) as j:
        request = j.approval_requests(call_id="call-deny")[0]
        assert (request.status, request.decided_by, request.decision_reason) == (
            "denied", "operator:carol", "amount above the limit")


def test_deciding_a_decided_request_is_refused_as_the_cli_refuses_it(fresh: str) -> None:
    cli = invoke("journal", "approve", "call-approved", "--operator", "dave", "--db", fresh)
    assert cli.exit_code == 1
    with console_for(fresh, allow_write=True, operator="dave") as signed:
        before = signed.console.journal.head()
        for call_id, decision in (("call-approved", "approve"), ("call-denied", "deny"), ("call-approved", "deny")):
            for step in ("review", "confirm"):
                answer = _decide(signed, call_id, decision, "late", step=step)
                assert answer.status_code == 409, (call_id, decision, step)
                assert "is already" in answer.text and "Nothing was appended." in answer.text
        assert "already approved" in cli.stderr
        assert signed.console.journal.head() == before
        assert _decide(signed, "call-ok", "approve").status_code == 404  # no request at all


def test_a_request_decided_between_review_and_confirmation_is_refused(fresh: str) -> None:
    with console_for(fresh, allow_write=True, operator="alice") as signed:
        review = _decide(signed, "call-approve", "approve")
        request_id = re.search(r'name="request_id" value="([0-9a-f]+)"', review.text)
        assert request_id is not None
        assert invoke("journal", "deny", "call-approve", "--reason", "no", "--operator", "bob",
                      "--db", fresh).exit_code == 0
        with reopened(fresh) as j:
            head = j.head()
        answer = _decide(signed, "call-approve", "approve", step="confirm", request_id=request_id.group(1))
        assert answer.status_code == 409
        assert "is already denied" in answer.text
        with reopened(fresh) as j:
            assert j.head() == head


# -- airlock journal serve -------------------------------------------------------------------------


def test_serve_runs_on_the_journal_of_airlock_journal_and_listens_on_127_0_0_1(tmp_path: Path) -> None:
    import httpx

    from tests.test_console_support import serving

    target = str(tmp_path / "journal.db")
    with open_journal(target) as journal:
        seed_console(journal)
    with serving(env={"AIRLOCK_JOURNAL": target}) as served:
        assert served.output[0] == f"Airlock console for the journal {target} (read-only).\n"
        assert served.url.startswith("http://127.0.0.1:")
        with httpx.Client(base_url=served.base, follow_redirects=False, timeout=60) as client:
            assert client.get("/calls").status_code == 401
            signed_in = client.get(served.url.removeprefix(served.base))
            assert (signed_in.status_code, signed_in.headers["location"]) == (303, "/")
            cookie = signed_in.headers["set-cookie"].lower()
            assert "httponly" in cookie and "samesite=strict" in cookie
            calls = client.get("/calls")
            assert calls.status_code == 200 and "call-timeout" in calls.text
            assert client.post("/resolve", data={"call_id": "call-timeout"}).status_code == 403
        served.process.terminate()
        assert served.process.wait(60) == 0


def test_serve_never_creates_a_journal_that_is_not_there(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    result = invoke("journal", "serve", "--db", str(missing), "--port", "0")
    assert result.exit_code == 1
    assert result.stderr == (f"Error: There is no journal at {missing}. It is named by --db: check the path or URL "
                             "given.\n")
    assert not missing.exists() and list(tmp_path.iterdir()) == []
    by_env = invoke("journal", "serve", "--port", "0", env={"AIRLOCK_JOURNAL": str(missing)})
    assert by_env.exit_code == 1 and "It is named by AIRLOCK_JOURNAL" in by_env.stderr
    assert not missing.exists()


@pytest.mark.postgres
def test_serve_on_a_postgresql_database_without_a_journal_is_an_error(pg_server: Any) -> None:
    from tests.pgserver import fresh_schema

    empty = fresh_schema()
    result = invoke("journal", "serve", "--dsn", empty, "--port", "0")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "It is named by --dsn" in result.stderr


def test_serve_usage_errors_exit_2(tmp_path: Path) -> None:
    db = str(tmp_path / "j.db")
    both = invoke("journal", "serve", "--db", db, "--dsn", "postgresql://u@localhost/x")
    assert (both.exit_code, both.stderr) == (2, "Error: give the journal once: --db PATH_OR_URL or --dsn URL\n")
    sqlite = invoke("journal", "serve", "--dsn", db)
    assert sqlite.exit_code == 2 and "is not a postgresql:// URL" in sqlite.stderr
    assert invoke("journal", "serve", "--db", db, "--port", "70000").exit_code == 2
    assert invoke("journal", "serve", "--db", db, "--operator", " ").exit_code == 2
    assert invoke("journal", "serve", "--db", db, "--redact", "owner").exit_code == 2
    assert not Path(db).exists()


def test_serve_says_when_its_port_is_taken(tmp_path: Path) -> None:
    import socket

    target = str(tmp_path / "journal.db")
    with open_journal(target) as journal:
        seed_console(journal)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = invoke("journal", "serve", "--db", target, "--port", str(port))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: cannot listen on 127.0.0.1:{port}: ")
