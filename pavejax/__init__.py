"""pavejax: the private learnware lifecycle in JAX.

Subpackages: :mod:`pavejax.privacy` (DP engine), :mod:`pavejax.accounting` (ledgers),
:mod:`pavejax.lora` (low-rank factors), :mod:`pavejax.models`, :mod:`pavejax.data`.
"""

__version__ = "0.1.0"
