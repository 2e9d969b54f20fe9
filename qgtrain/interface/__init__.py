"""The way in: the `qgtrain` command line (cli.py parses, commands.py acts) and `qgtrain.train` for
Python callers (api.py). It imports downward only, and torch only inside the commands that train."""
