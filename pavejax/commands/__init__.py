"""The ``pavejax`` subcommands, one module each, on the public API.

Every module has ``add_arguments(parser)`` (cheap: no heavy imports, so ``pavejax --help`` stays
fast) and ``run(namespace) -> exit status``; :mod:`pavejax.cli` registers them. Model releases
exchanged between the commands hold a classification head ``{"kernel": (384, k), "bias": (k,)}``
on the frozen all-MiniLM-L6-v2 mean-pooled features (see :mod:`pavejax.commands._shared`).
"""
