"""The Textual chat app. It imports the session and the engine; nothing there imports it."""
