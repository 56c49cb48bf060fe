"""`python -m specchat` is the `specchat` command."""

from specchat.cli import main

main()
