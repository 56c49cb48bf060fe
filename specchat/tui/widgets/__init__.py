"""The chat's widgets, one module each; the app imports them from here."""

from specchat.tui.widgets.conversation import Conversation
from specchat.tui.widgets.inspector import Inspector
from specchat.tui.widgets.legend import Legend
from specchat.tui.widgets.panel import MODE_KEYS, StatsPanel
from specchat.tui.widgets.reply import MarkdownReply, ReplyView, SavedReply, UserView
from specchat.tui.widgets.startup import StartupView

__all__ = ["MODE_KEYS", "Conversation", "Inspector", "Legend", "MarkdownReply", "ReplyView", "SavedReply", "StartupView", "StatsPanel", "UserView"]
