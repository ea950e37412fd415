"""The operator console in a real browser: Debian's Chromium, driven by Playwright, against
``airlock journal serve`` running in a process of its own, on SQLite and PostgreSQL.

The read pages are walked with JavaScript off; the actions (resolve, approve, deny, and a refusal
when someone else acted between review and confirmation) with the browser as it comes. Everything
is found by its role, label and visible text, as a person or a screen reader finds it. Waits are
bounded by generous deadlines; no time is asserted.

Set ``AIRLOCK_CONSOLE_SHOTS=DIR`` to keep a screenshot of each page visited.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from journal import open_journal
from journal.chain import verify_lines
from tests.cli_support import invoke
from tests.journals import JournalFactory
from tests.test_console_support import leave_pending, seed_console, serving

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run"]
DEADLINE_MS = 60_000

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


def _chromium_or_skip() -> None:
    if os.path.exists(CHROMIUM):
        return
    if os.geteuid() == 0 or os.environ.get("CI"):
        pytest.fail(f"{CHROMIUM} is missing: scripts/test.sh installs Debian's chromium (apt-get install chromium)")
    pytest.skip(f"Debian's chromium is not installed at {CHROMIUM}, and installing it needs root "
                "(apt-get install chromium, or run scripts/test.sh as root)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    _chromium_or_skip()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    sync_api.expect.set_options(timeout=DEADLINE_MS)
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=DEADLINE_MS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def target(journal_kind: JournalFactory, tmp_path: Path) -> str:
    """A journal of every store (tests/conftest.py) seeded by ``seed_console``, with ``call-orphan``
    pending and its owner gone."""
    target = journal_kind.target(tmp_path)
    with journal_kind.open(target) as journal:
        seed_console(journal)
    leave_pending(target, "call-orphan")
    return target


def _shot(page: Any, name: str) -> None:
    folder = os.environ.get("AIRLOCK_CONSOLE_SHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)


def _page(browser: Any, *, javascript: bool) -> tuple[Any, Any, list[str]]:
    """A fresh browser context and page; the list fills with every URL the page asks for."""
    context = browser.new_context(java_script_enabled=javascript, viewport={"width": 1280, "height": 900},
                                  accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(DEADLINE_MS)
    asked: list[str] = []
    page.on("request", lambda request: asked.append(request.url))
    return context, page, asked


def _nav(page: Any, name: str) -> None:
    page.get_by_role("navigation", name="Console").get_by_role("link", name=name, exact=True).click()


def test_every_read_page_works_with_javascript_off(browser: Any, target: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    with serving("--db", target) as served:
        context, page, asked = _page(browser, javascript=False)
        try:
            page.goto(served.url)
            # Signed in, and the token is gone from the address.
            expect(page).to_have_url(served.base + "/")
            expect(page.get_by_role("heading", level=1, name="Overview")).to_be_visible()
            expect(page.get_by_text("Read-only", exact=True)).to_be_visible()
            nav = page.get_by_role("navigation", name="Console")
            for name in ("Overview", "Calls", "In doubt", "Approvals", "Verify", "Export"):
                expect(nav.get_by_role("link", name=name, exact=True)).to_be_visible()
            doubt = page.get_by_role("region", name="In doubt")
            expect(doubt).to_contain_text("2")
            expect(page.get_by_role("region", name="Approvals open")).to_contain_text("3")
            _shot(page, "overview")

            _nav(page, "Calls")
            expect(page.get_by_role("heading", level=1, name="Calls")).to_be_visible()
            for call_id in ("call-ok", "call-timeout", "call-failed", "call-read", "call-orphan"):
                expect(page.get_by_role("link", name=call_id, exact=True)).to_be_visible()
            page.get_by_label("Status").select_option("unknown")
            page.get_by_role("button", name="Show calls").click()
            expect(page).to_have_url(re.compile(r"/calls\?status=unknown$"))
            expect(page.get_by_role("table").get_by_role("row")).to_have_count(2)  # the header and call-timeout
            page.get_by_role("link", name="Clear the filters").click()
            page.get_by_label("Owner state").select_option("gone")
            page.get_by_role("button", name="Show calls").click()
            rows = page.get_by_role("table").get_by_role("row")
            expect(rows).to_have_count(2)
            expect(rows.nth(1)).to_contain_text("pending (owner gone)")
            _shot(page, "calls")

            page.get_by_label("Owner state").select_option("")
            page.get_by_label("Tool").fill("charge")
            page.get_by_role("button", name="Show calls").click()
            page.get_by_role("link", name="call-timeout", exact=True).click()
            expect(page.get_by_role("heading", level=1)).to_have_text("Call call-timeout")
            with open_journal(target, readonly=True, create=False) as j:
                events = j.call_events("call-timeout")
            timeline = page.get_by_role("region", name="Timeline").get_by_role("listitem")
            expect(timeline).to_have_count(len(events))
            for item, event in zip(timeline.all(), events, strict=True):
                expect(item).to_contain_text(f"seq {event.seq}")
                expect(item).to_contain_text(event.kind)
                expect(item).to_contain_text(event.hash)
                expect(item).to_contain_text(event.prev_hash)
            expect(page.get_by_text("TimeoutError: backend did not answer").first).to_be_visible()
            expect(page.get_by_role("button")).to_have_count(0)  # read-only: nothing to press
            _shot(page, "call")
            # The first event links to the one before it in the chain, another call's.
            page.get_by_role("link", name=f"the event at seq {events[0].seq - 1}").click()
            expect(page).to_have_url(re.compile(rf"/calls/[^#]+#seq-{events[0].seq - 1}$"))

            _nav(page, "In doubt")
            queue = page.get_by_role("table")
            expect(queue.get_by_role("row")).to_have_count(3)
            expect(queue.get_by_role("link", name="call-timeout", exact=True)).to_be_visible()
            expect(queue.get_by_role("link", name="call-orphan", exact=True)).to_be_visible()
            _shot(page, "in-doubt")

            _nav(page, "Approvals")
            expect(page.get_by_role("article")).to_have_count(3)
            expect(page.get_by_role("article", name="Request of call call-approve")).to_contain_text("moves money")
            expect(page.get_by_role("button", name="Approve")).to_have_count(0)
            expect(page.get_by_role("cell", name="operator:carol: over the limit")).to_be_visible()
            _shot(page, "approvals")

            _nav(page, "Verify")
            expect(page.get_by_text("Not run by this server yet.")).to_be_visible()
            page.get_by_role("button", name="Run verify").click()
            expect(page.get_by_role("heading", name="The journal verifies")).to_be_visible()
            _nav(page, "Overview")
            expect(page.get_by_role("region", name="Last verify")).to_contain_text("OK")

            _nav(page, "Export")
            page.get_by_label("Tool").fill("charge")
            page.get_by_label("arguments").check()
            with page.expect_download() as downloading:
                page.get_by_role("button", name="Download the export").click()
            saved = tmp_path / "export.jsonl"
            downloading.value.save_as(saved)
            lines = [orjson.loads(line) for line in saved.read_bytes().splitlines()]
            assert lines and all(line["tool"] == "charge" for line in lines)
            assert all(line["arguments"] is None and line["redacted"] == ["arguments"] for line in lines)
            assert verify_lines(lines, allow_gaps=True).ok
        finally:
            context.close()
    # No asset came from anywhere but the console.
    assert asked and all(url.startswith(served.base) for url in asked), [u for u in asked if not
                                                                        u.startswith(served.base)]


def test_a_page_without_the_session_is_refused_in_the_browser(browser: Any, target: str) -> None:
    from playwright.sync_api import expect

    with serving("--db", target) as served:
        context, page, _ = _page(browser, javascript=False)
        try:
            answer = page.goto(served.base + "/calls")
            assert answer is not None and answer.status == 401
            expect(page.get_by_role("heading", name="Not signed in")).to_be_visible()
            page.goto(served.url)
            expect(page.get_by_role("heading", level=1, name="Overview")).to_be_visible()
        finally:
            context.close()
        other, second, _ = _page(browser, javascript=False)
        try:
            answer = second.goto(served.url)  # the URL worked once
            assert answer is not None and answer.status == 401
            expect(second.get_by_text("each link works once")).to_be_visible()
        finally:
            other.close()


def test_resolve_approve_and_deny_with_confirmation(browser: Any, target: str) -> None:
    from playwright.sync_api import expect

    with serving("--db", target, "--allow-write", "--operator", "alice") as served:
        context, page, _ = _page(browser, javascript=True)
        try:
            page.goto(served.url)
            expect(page.get_by_text("Writes as operator:alice")).to_be_visible()

            # Resolve the unknown charge as applied, with the value the backend gave.
            _nav(page, "In doubt")
            page.get_by_role("link", name="call-timeout", exact=True).click()
            page.get_by_label("Reason (required): what the backend said").fill("ledger shows ch_2")
            page.get_by_label("Value as JSON").fill('{"charge_id": "ch_2"}')
            page.get_by_role("button", name="Resolve as applied", exact=True).click()
            expect(page.get_by_role("heading", level=1)).to_have_text("Confirm: resolve as applied")
            confirm = page.get_by_role("region", name="This appends one event to the journal")
            expect(confirm).to_contain_text("committed for call call-timeout, attempt 1")
            expect(confirm).to_contain_text("operator:alice")
            _shot(page, "resolve-confirm")
            with open_journal(target, readonly=True, create=False) as j:
                assert j.call("call-timeout").status == "unknown"  # type: ignore[union-attr]
            page.get_by_role("button", name="Confirm: resolve as applied").click()
            with open_journal(target, readonly=True, create=False) as j:
                appended = j.call_events("call-timeout")[-1]
                assert (appended.kind, appended.actor) == ("committed", "operator:alice")
                assert j.call("call-timeout").value == '{"charge_id":"ch_2"}'  # type: ignore[union-attr]
            expect(page.get_by_role("status")).to_contain_text(
                f"Appended seq {appended.seq}: committed by operator:alice")
            expect(page.get_by_role("region", name="Current state")).to_contain_text("committed (by operator:alice)")
            _shot(page, "resolved")

            # Approve one request, from the inbox.
            _nav(page, "Approvals")
            card = page.get_by_role("article", name="Request of call call-approve")
            card.get_by_label("Reason (required to deny)").fill("agreed with the customer")
            card.get_by_role("button", name="Approve", exact=True).click()
            expect(page.get_by_role("heading", level=1)).to_have_text("Confirm: approve")
            page.get_by_role("button", name="Confirm: approve").click()
            expect(page.get_by_role("status")).to_contain_text("approved by operator:alice")
            with open_journal(target, readonly=True, create=False) as j:
                request = j.approval_requests(call_id="call-approve")[0]
                assert (request.status, request.approvers) == ("approved", ("operator:alice",))

            # Deny another: without a reason it is refused on the page, then given one.
            _nav(page, "Approvals")
            card = page.get_by_role("article", name="Request of call call-deny")
            card.get_by_role("button", name="Deny", exact=True).click()
            expect(page.get_by_role("alert")).to_contain_text("Say why you deny it")
            _shot(page, "deny-without-reason")
            page.get_by_label("Reason (required to deny)").fill("amount above the customer's limit")
            page.get_by_role("button", name="Deny", exact=True).click()
            expect(page.get_by_role("heading", level=1)).to_have_text("Confirm: deny")
            page.get_by_role("button", name="Confirm: deny").click()
            expect(page.get_by_role("status")).to_contain_text("denied by operator:alice")
            with open_journal(target, readonly=True, create=False) as j:
                request = j.approval_requests(call_id="call-deny")[0]
                assert (request.status, request.decision_reason) == ("denied", "amount above the customer's limit")
            expect(page.get_by_role("button", name="Approve")).to_have_count(0)  # decided: nothing left to press

            # Someone settles the orphan from a shell between review and confirmation: refused, shown.
            page.goto(served.base + "/calls/call-orphan")
            page.get_by_label("Reason (required): what the backend said").fill("no charge with this key")
            page.get_by_role("button", name="Resolve as not applied", exact=True).click()
            expect(page.get_by_role("heading", level=1)).to_have_text("Confirm: resolve as not applied")
            done = invoke("journal", "resolve", "call-orphan", "--applied", "--reason", "it went through",
                          "--operator", "bob", "--db", target)
            assert done.exit_code == 0, done.stderr
            page.get_by_role("button", name="Confirm: resolve as not applied").click()
            refusal = page.get_by_role("alert")
            expect(refusal).to_contain_text("is committed; only a pending or unknown call can be resolved.")
            expect(refusal).to_contain_text("Nothing was appended.")
            _shot(page, "refused")
            with open_journal(target, readonly=True, create=False) as j:
                record = j.call("call-orphan")
                assert record is not None and (record.status, record.actor) == ("committed", "operator:bob")
        finally:
            context.close()
