"""`specchat bench`: every mode against plain decoding (and, with --peers, against HF's own implementations)
on the same prompts, in one process, with quality checks.

`bench` is resolved lazily: the command module imports specchat.cli, whose register_commands() imports this
package, so importing the CLI first (in either import order) keeps the cycle harmless.
"""


def __getattr__(name: str):
    if name == "bench":
        import specchat.cli  # noqa: F401  (registers the command; see the docstring)
        from specchat.bench.command import bench

        return bench
    raise AttributeError(f"module 'specchat.bench' has no attribute {name!r}")


__all__ = ["bench"]
