"""`specchat bench`: every mode against plain decoding (and, with --peers, against HF's own implementations) on
the same prompts, in one process, with quality checks. The command is specchat/cli/bench.py."""
