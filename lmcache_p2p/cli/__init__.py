"""The ``lmcache-p2p`` command: launch, proxy, drain, tiny-model.

The only package that configures logging. Subcommands live in their own modules and register
themselves with ``add_parser(subparsers)``; heavy imports happen inside the subcommand. ``cluster.py`` starts the launcher's deployment from
Python (end-to-end tests, ``bench/e2e.py``).
"""
