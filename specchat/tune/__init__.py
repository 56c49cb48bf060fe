"""`specchat tune`: the search for a self-speculative mode's best setting (search.py); the command is cli/tune.py."""
