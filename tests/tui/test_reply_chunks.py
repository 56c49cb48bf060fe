"""A long reply is drawn in chunks of whole lines (widgets/reply.py): as rounds arrive only the last chunk renders
again, and together the chunks draw the lines one widget would."""

from __future__ import annotations

import pytest

from specchat.tui.widgets import ReplyView
from specchat.tui.widgets.reply import CHUNK_SPANS
from support.fakes import REPLY, VOCAB, FakeSession
from test_tui import RecordingApp, rounds_shown, send, wait_for


@pytest.mark.asyncio
async def test_only_the_last_chunk_renders_as_rounds_arrive_and_the_chunks_draw_the_whole_reply(monkeypatch):
    session = FakeSession(reply=REPLY * 20, gated=True)
    session.max_new_tokens = len(REPLY) * 20
    app = RecordingApp(session)
    drawn: list[tuple[int, int | None]] = []  # (start, end) of every chunk's render
    content = ReplyView.content

    def counted(self, start=0, end=None):
        drawn.append((start, end))
        return content(self, start, end)

    monkeypatch.setattr(ReplyView, "content", counted)
    async with app.run_test(size=(56, 60)) as pilot:  # narrow: the chat alone, about 50 columns of text
        await send(pilot, "go")
        released = 0
        for _ in range(12):  # rounds in small steps, each drawn as the app's timer would
            session.release(8)
            released += 8
            await wait_for(pilot, lambda: rounds_shown(app) == released)
            app.redraw_reply()
            await pilot.pause()
        reply = app.query_one(ReplyView)
        closed = [c for c in reply.chunks if c.end is not None]
        assert len(closed) >= 2 and len(reply.spans) - reply.chunks[-1].start < 2 * CHUNK_SPANS
        assert all(reply.spans[c.end - 1].text.endswith("\n") for c in closed)  # each closes at a line end

        drawn.clear()
        session.release(16)
        await wait_for(pilot, lambda: rounds_shown(app) == released + 16)
        app.redraw_reply()
        await pilot.pause()
        assert drawn and not any(start in {c.start for c in closed} for start, _ in drawn)

        session.release(1000)
        await wait_for(pilot, lambda: not app.generating)
        await pilot.pause()
        width = reply.chunks[0].content_region.width
        drawn_lines = [strip.text.rstrip() for c in reply.chunks for strip in c.render_lines(c.size.region)]
        whole = [line.plain.rstrip() for line in reply.content().wrap(width)]
        assert drawn_lines == whole and len(whole) > 2 * len(reply.chunks)
        # the tokens under the lines, in order, and the row of the last one counted from the reply's top
        shown = [token for line in reply.token_lines() for _, token in line]
        assert shown == [i for i, t in enumerate(reply.tokens) if t.text.strip()]
        assert reply.token_row(len(reply.tokens) - 1) == len(whole) - 1
        assert reply.text == session.turns[0].reply == "".join(VOCAB[i] for i in REPLY * 20)


@pytest.mark.asyncio
@pytest.mark.parametrize("spare", [True, False])
async def test_where_the_forward_takes_every_core_the_reply_and_the_panel_redraw_less_often(monkeypatch, spare):
    """The UI thread's time is the decoder's where no core is spare (benchmarks/ui_cost.py): slower timers there."""
    from specchat import threads
    from specchat.tui import app as chat

    monkeypatch.setattr(threads, "spare_core", lambda: spare)
    session = FakeSession(reply=REPLY * 4, gated=True)
    app = RecordingApp(session)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, "go")
        await wait_for(pilot, lambda: app.generating)
        expected = (chat.REPLY_INTERVAL_S, chat.PANEL_INTERVAL_S) if spare else (chat.SHARED_REPLY_INTERVAL_S, chat.SHARED_PANEL_INTERVAL_S)
        assert (app.reply_interval, app.panel_interval) == expected
        assert chat.SHARED_REPLY_INTERVAL_S > chat.REPLY_INTERVAL_S and chat.SHARED_PANEL_INTERVAL_S > chat.PANEL_INTERVAL_S
        session.release(1000)
        await wait_for(pilot, lambda: not app.generating)
