"""Subcommands of the ``labkit`` CLI, one module each (see labkit/cli.py for the contract)."""
