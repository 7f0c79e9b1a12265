"""The model-agnostic DP engine: per-example clipping, Gaussian noise, sampling, sharding."""

from pavejax.privacy.clipping import (
    ClipConfig as ClipConfig,
    ClipResult as ClipResult,
    clip_per_example as clip_per_example,
    clipped_sum as clipped_sum,
    leaf_paths as leaf_paths,
    per_example_norms as per_example_norms,
)
from pavejax.privacy.gradient import (
    DPConfig as DPConfig,
    DPGradient as DPGradient,
    StepInfo as StepInfo,
    noisy_gradient as noisy_gradient,
)
from pavejax.privacy.noise import (
    fresh_key as fresh_key,
    gaussian_noise_like as gaussian_noise_like,
    privatize_sum as privatize_sum,
)
from pavejax.privacy.sampling import (
    BatchOverflowError as BatchOverflowError,
    SamplingConfig as SamplingConfig,
    max_batch_for as max_batch_for,
    poisson_indices as poisson_indices,
    take_batch as take_batch,
)
from pavejax.privacy.sharding import (
    data_mesh as data_mesh,
    data_parallel_clipped_sum as data_parallel_clipped_sum,
    replicate as replicate,
    shard_batch as shard_batch,
)
