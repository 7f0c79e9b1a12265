"""The model-agnostic DP engine: per-example clipping, Gaussian noise, sampling, sharding."""

from pavejax.privacy.clipping import (
    ClipConfig as ClipConfig,
)
from pavejax.privacy.clipping import (
    ClipResult as ClipResult,
)
from pavejax.privacy.clipping import (
    clip_per_example as clip_per_example,
)
from pavejax.privacy.clipping import (
    clipped_sum as clipped_sum,
)
from pavejax.privacy.clipping import (
    leaf_paths as leaf_paths,
)
from pavejax.privacy.clipping import (
    per_example_norms as per_example_norms,
)
from pavejax.privacy.gradient import (
    DPConfig as DPConfig,
)
from pavejax.privacy.gradient import (
    DPGradient as DPGradient,
)
from pavejax.privacy.gradient import (
    StepInfo as StepInfo,
)
from pavejax.privacy.gradient import (
    noisy_gradient as noisy_gradient,
)
from pavejax.privacy.noise import (
    gaussian_noise_like as gaussian_noise_like,
)
from pavejax.privacy.noise import (
    privatize_sum as privatize_sum,
)
from pavejax.privacy.sampling import (
    BatchOverflowError as BatchOverflowError,
)
from pavejax.privacy.sampling import (
    SamplingConfig as SamplingConfig,
)
from pavejax.privacy.sampling import (
    max_batch_for as max_batch_for,
)
from pavejax.privacy.sampling import (
    poisson_indices as poisson_indices,
)
from pavejax.privacy.sampling import (
    take_batch as take_batch,
)
from pavejax.privacy.sharding import (
    data_mesh as data_mesh,
)
from pavejax.privacy.sharding import (
    data_parallel_clipped_sum as data_parallel_clipped_sum,
)
from pavejax.privacy.sharding import (
    replicate as replicate,
)
from pavejax.privacy.sharding import (
    shard_batch as shard_batch,
)
