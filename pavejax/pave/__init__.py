"""PAVE specifications, the learnware dock, and the RKME baseline.

:mod:`~pavejax.pave.spec` (model-side / user-side specs, DP-S-PAVE), :mod:`~pavejax.pave.text`
(a BERT encoder as the shared backbone), :mod:`~pavejax.pave.types` (the spec record),
:mod:`~pavejax.pave.dock` (SQLite + Orbax store, on-device search), :mod:`~pavejax.pave.search`
(cosine top-k kernels), :mod:`~pavejax.pave.reuse` (top-1, fine-tune, ensemble, merge) and
:mod:`~pavejax.pave.rkme` (the RKME baseline).
"""

from pavejax.pave.spec import (
    PRESETS as PRESETS,
    Backbone as Backbone,
    PrivacyConfig as PrivacyConfig,
    SpecConfig as SpecConfig,
    SpecResult as SpecResult,
    backbone_hash as backbone_hash,
    generate_spec as generate_spec,
    hard_targets as hard_targets,
    label_space_head as label_space_head,
    model_spec as model_spec,
    soft_targets as soft_targets,
    spec_signature as spec_signature,
    user_spec as user_spec,
)
from pavejax.pave.types import (
    PaveSpec as PaveSpec,
    SpecMismatchError as SpecMismatchError,
    SpecSignature as SpecSignature,
    cosine as cosine,
)
