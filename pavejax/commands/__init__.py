"""The ``pavejax`` subcommands, one module each, on the public API.

Every module has ``add_arguments(parser)`` (cheap: no heavy imports, so ``pavejax --help`` stays
fast) and ``run(namespace) -> exit status``; :mod:`pavejax.cli` registers them. Model releases
exchanged between the commands hold a classification head ``{"kernel": (384, k), "bias": (k,)}``
on frozen pooled features (all-MiniLM-L6-v2 by default) (see :mod:`pavejax.commands._shared`).
"""
