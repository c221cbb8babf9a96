"""The ``lmcache-p2p`` command: launch, proxy, tiny-model.

The only package that configures logging. Subcommands live in their own modules and register
themselves with ``add_parser(subparsers)``; heavy imports happen inside the subcommand.
"""
