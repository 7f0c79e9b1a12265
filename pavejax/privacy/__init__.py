"""The model-agnostic DP engine: per-example clipping, Gaussian noise, sampling, sharding.

Every piece is pure and jittable (``jit``, ``vmap``, ``lax.scan``, ``shard_map``); the host
checks (:func:`check_step`) and :class:`DPGradient` are thin wrappers around them.
"""

from pavejax.privacy.autotune import (
    MicrobatchDoesNotFitError as MicrobatchDoesNotFitError,
    clear_autotune_cache as clear_autotune_cache,
    compiled_temp_bytes as compiled_temp_bytes,
    default_memory_budget as default_memory_budget,
)
from pavejax.privacy.checks import NonFiniteError as NonFiniteError, check_step as check_step
from pavejax.privacy.clipping import (
    ClipConfig as ClipConfig,
    ClipResult as ClipResult,
    check_microbatch_size as check_microbatch_size,
    clip_coefficients as clip_coefficients,
    clip_per_example as clip_per_example,
    clipped_sum as clipped_sum,
    leaf_paths as leaf_paths,
    per_example_norms as per_example_norms,
)
from pavejax.privacy.fsdp import (
    fsdp_specs as fsdp_specs,
    model_mesh as model_mesh,
    shard_params as shard_params,
    sharded_noisy_gradient as sharded_noisy_gradient,
    sharded_private_gradient as sharded_private_gradient,
)
from pavejax.privacy.gradient import (
    DPConfig as DPConfig,
    DPGradient as DPGradient,
    StepInfo as StepInfo,
    auto_microbatch_size as auto_microbatch_size,
    noisy_gradient as noisy_gradient,
    private_gradient as private_gradient,
)
from pavejax.privacy.noise import (
    PrivatizerState as PrivatizerState,
    fresh_key as fresh_key,
    gaussian_noise_like as gaussian_noise_like,
    gaussian_privatizer as gaussian_privatizer,
    privatize_sum as privatize_sum,
)
from pavejax.privacy.sampling import (
    BatchOverflowError as BatchOverflowError,
    Draw as Draw,
    SamplingConfig as SamplingConfig,
    max_batch_for as max_batch_for,
    pad_batch as pad_batch,
    poisson_indices as poisson_indices,
    take_batch as take_batch,
)
from pavejax.privacy.sharding import (
    data_mesh as data_mesh,
    data_parallel_clipped_sum as data_parallel_clipped_sum,
    replicate as replicate,
    shard_batch as shard_batch,
)
