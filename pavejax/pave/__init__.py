"""PAVE specifications, the learnware dock, and the RKME baseline.

:mod:`~pavejax.pave.spec` (model-side / user-side specs, DP-S-PAVE), :mod:`~pavejax.pave.text`
(a BERT encoder as the shared backbone), :mod:`~pavejax.pave.dock` (SQLite + Orbax store,
on-device search), :mod:`~pavejax.pave.search` (cosine top-k kernels),
:mod:`~pavejax.pave.noise_aware` (scores that read each private spec's noise level),
:mod:`~pavejax.pave.subspace` (public coordinate subspaces for the paper's coordinate specs),
:mod:`~pavejax.pave.reuse` (top-1, fine-tune, ensemble, merge) and :mod:`~pavejax.pave.rkme`
(the RKME baseline). The spec
record (``PaveSpec``, ``SpecSignature``) lives in :mod:`pavejax.spec_types`, below PAVE, so that
releases read and write it without importing the method.
"""

# Exports load on first use, so that the command line (``pavejax dock --help``) does not import
# JAX and the accountants before it needs them.
import importlib as _importlib

_EXPORTS = {
    **dict.fromkeys(("PRESETS", "Backbone", "PrivacyConfig", "SpecConfig", "SpecResult",
                     "backbone_hash", "generate_spec", "hard_targets", "model_spec",
                     "soft_targets", "spec_signature", "user_spec"),
                    "pavejax.pave.spec"),
    **dict.fromkeys(("SCORE_METHODS", "noise_aware_scores", "spec_noise_std",
                     "vmf_mean_resultant_length"), "pavejax.pave.noise_aware"),
    **dict.fromkeys(("Subspace", "calibrated", "layer_selection", "random_projection"),
                    "pavejax.pave.subspace"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pavejax.pave' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
