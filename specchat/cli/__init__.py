"""The command line: `main.py` is the `specchat` group (and the chat), one module per command, shared
options in `options.py` (commands import options, never the reverse)."""
