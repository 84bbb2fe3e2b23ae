"""The `pagedweight` command line: one module per sub-command, wired in main.py."""
