"""`python -m specchat` is the `specchat` command."""

from specchat.cli.main import main

main()
