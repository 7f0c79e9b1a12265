"""A simulated learnware market: N developer models, M few-shot user tasks, a computed oracle.

Used to score model identification (PAVE, RKME): :func:`build_market` trains the developers and
cuts the user tasks, :func:`evaluate_market` applies **every** developer model to **every** user's
test set (the oracle is measured, never assumed), and :func:`pavejax.data.ranking_metrics`
scores a method's (n_users, n_developers) relevance scores against that accuracy matrix.

Design:

* **One frozen feature map per market, one linear head per developer.** Vision: an MLP backbone
  pretrained by :func:`pavejax.models.pretrain_backbone` on digits 0-4 of every market domain
  (cached in the user's cache directory by that function); a shared backbone keeps every
  developer in one parameter space, which parameter-vector specifications need. Text: frozen
  all-MiniLM-L6-v2, mean-pooled (not normalised, i.e. ``TextClassifier(pooling="mean")``
  features), embeddings cached per process by :func:`pavejax.models.embed_texts`.
* **Domains.** Vision: ``digits`` and ``mnist5k``, the latter brought to the digits input space
  (28x28 padded to 32x32, then 4x4 block means -> 8x8, as the digits set was made), so every model
  applies to every domain with a real domain shift. Classes are the downstream digits 5-9. Text:
  ``movie``, ``amazon``, ``nyt``, ``tweets`` (binary sentiment, one label space) and ``bbc``
  (5 topics, a disjoint label space).
* **Developers** are (domain x class subset x quality). Subsets have sizes ``subset_sizes`` (a
  domain with fewer classes contributes its full class set). Good developers take distinct
  specialities, round-robin over domains; undertrained (``undertrained_steps`` Adam steps) and
  corrupted developers (a ``corrupt_label_fraction`` of training labels moved to the next class,
  i.e. flipped when binary) copy good developers' specialities, so identification must tell
  quality apart, not only classes. The developer order is shuffled. Text markets can train every
  developer with the package's tuned head recipe instead (``MarketConfig.developer_recipe``:
  :func:`pavejax.recipes.tuned` of its domain, AdamW with warm-up and decay), the non-private
  reference identification results are read against.
* **Users** take the good developers' specialities in turn, so (with ``good_fraction > 0``)
  every user has a good developer of its own domain and classes. Splits of each domain
  (:func:`pavejax.data.load_task` with the market seed): train -> backbone pretraining and
  developers, dev -> user few-shot sets, test -> user test sets. Dev and test examples whose
  content hash occurs in any training data (and test examples also in dev) are dropped, so
  duplicates in the raw corpora cannot leak.
* **Class identity.** Labels are named (``"5"``, ``"positive"``, ``"sports"``); see
  :func:`pavejax.data.class_identity_accuracy` for how a model is scored on a user task.

Determinism: everything is a function of the config (numpy ``SeedSequence`` streams per purpose);
the same config gives the same market in every run on the same platform.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import zlib
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from pavejax import recipes as _recipes
from pavejax.data.metrics import class_identity_accuracy
from pavejax.data.registry import load_task
from pavejax.data.tasks import Inputs, Split, Task, class_subset_task
from pavejax.models import embed_texts
from pavejax.optim import promotion_safe

__all__ = [
    "QUALITIES",
    "DeveloperModel",
    "Market",
    "MarketConfig",
    "UserTask",
    "build_market",
    "developer_classifier",
    "evaluate_market",
    "example_hashes",
]

QUALITIES: tuple[str, ...] = ("good", "undertrained", "corrupted")
_DOMAINS = {"vision": ("digits", "mnist5k"), "text": ("movie", "amazon", "nyt", "tweets", "bbc")}
_DOWNSTREAM_DIGITS = tuple(range(5, 10))
_CHUNK_DEVELOPERS = 8  # developers trained per compiled call (fixed, so one compilation)


def _int_at_least(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _developer_recipes(config: MarketConfig) -> dict[str, _recipes.Recipe]:
    """``{domain: tuned head recipe}`` of a ``developer_recipe="tuned"`` market; raises unless
    they share one batch size (one compiled trainer takes one minibatch shape)."""
    out = {d: _recipes.tuned(d, "head") for d in config.domains}
    sizes = {d: r.batch_size for d, r in out.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError("the tuned head recipes of a market's domains must share one batch "
                         f"size, got {sizes}")
    return out


@dataclasses.dataclass(frozen=True)
class MarketConfig:
    """What market :func:`build_market` builds (validated on construction).

    ``good_fraction + undertrained_fraction + corrupted_fraction`` must be 1; developer counts
    are rounded by largest remainder. Heads train with Adam (``learning_rate``, minibatches of
    ``batch_size``) for ``train_steps`` steps, ``undertrained_steps`` for undertrained developers;
    corrupted developers train on labels of which ``corrupt_label_fraction`` moved to the next
    class. ``subset_sizes``: sizes of developer class subsets. ``train_per_class`` examples of
    every class of a domain form its developers' training pool; ``test_per_class`` (None: all)
    caps each user test class; ``shots_per_class`` is each user's few-shot size per class.
    ``domains=None`` takes every domain of the track. ``max_length`` (text tokens) and
    ``backbone_steps`` / ``hidden`` (vision backbone) size the shared feature map.

    ``developer_recipe``: ``None`` (default) trains as above. ``"tuned"`` (text track only: the
    tuned recipes exist for the text tasks) trains each developer with
    ``pavejax.recipes.tuned(domain, "head")`` of its domain instead: AdamW (decoupled weight
    decay) peaking at the recipe's ``head_learning_rate``, minibatches of its ``batch_size`` (one
    shuffled pass per epoch, remainder dropped), ``epochs * (n // batch_size)`` steps (at least
    1) for a good or corrupted developer holding ``n`` examples, under the recipe's linear
    warm-up and decay over that developer's own steps. Undertrained developers take the first
    ``undertrained_steps`` steps of that same schedule (it must stop early: fewer steps than a
    good developer of that size takes). ``learning_rate``, ``batch_size`` and ``train_steps``
    are then not used; each developer's metadata records its recipe, steps and peak rate. The
    recipes of a market's domains must share one batch size.
    """

    track: str = "vision"
    n_developers: int = 12
    n_users: int = 6
    shots_per_class: int = 5
    seed: int = 0
    good_fraction: float = 0.5
    undertrained_fraction: float = 0.25
    corrupted_fraction: float = 0.25
    corrupt_label_fraction: float = 0.6
    train_steps: int = 200
    undertrained_steps: int = 2
    learning_rate: float = 1e-2
    batch_size: int = 32
    subset_sizes: tuple[int, ...] = (2, 3)
    domains: tuple[str, ...] | None = None
    train_per_class: int = 64
    test_per_class: int | None = 32
    backbone_steps: int = 300
    hidden: int = 64
    max_length: int = 48
    developer_recipe: str | None = None

    def __post_init__(self) -> None:
        if self.track not in _DOMAINS:
            raise ValueError(f"track must be 'vision' or 'text', got {self.track!r}")
        object.__setattr__(self, "subset_sizes", tuple(self.subset_sizes))
        domains = _DOMAINS[self.track] if self.domains is None else tuple(self.domains)
        object.__setattr__(self, "domains", domains)
        bad = [d for d in domains if d not in _DOMAINS[self.track]]
        if not domains or bad or len(set(domains)) != len(domains):
            raise ValueError(f"domains of the {self.track} track must be distinct names among "
                             f"{_DOMAINS[self.track]}, got {domains!r}")
        for name, low in (("n_developers", 1), ("n_users", 1), ("shots_per_class", 1),
                          ("seed", 0), ("train_steps", 1), ("undertrained_steps", 1),
                          ("batch_size", 1), ("train_per_class", 1), ("backbone_steps", 1),
                          ("hidden", 1), ("max_length", 8)):
            _int_at_least(name, getattr(self, name), low)
        if self.test_per_class is not None:
            _int_at_least("test_per_class", self.test_per_class, 1)
        if self.undertrained_steps >= self.train_steps:
            raise ValueError(f"undertrained_steps ({self.undertrained_steps}) must be below "
                             f"train_steps ({self.train_steps})")
        fractions = self.quality_fractions
        if any(not 0.0 <= f <= 1.0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-9:
            raise ValueError("good_fraction, undertrained_fraction and corrupted_fraction must "
                             f"lie in [0, 1] and sum to 1, got {' + '.join(map(str, fractions))}"
                             f" = {sum(fractions):g}")
        if not 0.0 < self.corrupt_label_fraction <= 1.0:
            raise ValueError("corrupt_label_fraction must be in (0, 1], got "
                             f"{self.corrupt_label_fraction!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if not self.subset_sizes or any(not isinstance(s, int) or s < 2
                                        for s in self.subset_sizes):
            raise ValueError("subset_sizes must be ints >= 2 (a task needs two classes), got "
                             f"{self.subset_sizes!r}")
        if self.developer_recipe is not None:
            if self.developer_recipe != "tuned":
                raise ValueError("developer_recipe must be None or 'tuned', got "
                                 f"{self.developer_recipe!r}")
            if self.track != "text":
                raise ValueError("developer_recipe='tuned' needs the text track: the tuned "
                                 "recipes (pavejax.recipes.tuned) exist for the text tasks, not "
                                 f"for the {self.track} domains {self.domains!r}")
            _developer_recipes(self)  # one shared batch size

    @property
    def quality_fractions(self) -> tuple[float, float, float]:
        """Fractions of developers per quality, in the order of :data:`QUALITIES`."""
        return (self.good_fraction, self.undertrained_fraction, self.corrupted_fraction)


@dataclasses.dataclass(frozen=True, eq=False)
class DeveloperModel:
    """One developer's model. Output ``i`` of ``head`` scores class ``classes[i]``.

    ``featurize`` is the market's shared frozen feature map (raw inputs -> (n, d) float32);
    ``head`` is an ``nnx.Linear(d, len(classes))``. ``train`` is the developer's private
    training data with the labels it trained on (corrupted ones for a corrupted developer);
    ``metadata`` records its steps, training size and corrupted-label fraction.
    """

    name: str
    domain: str
    classes: tuple[str, ...]
    quality: str
    head: nnx.Linear
    featurize: Callable[[Inputs], np.ndarray]
    train: Split
    metadata: Mapping[str, Any]

    def head_logits(self, features: np.ndarray) -> np.ndarray:
        """Logits (n, len(classes)) float32 of features (n, d) from ``featurize``."""
        feats = np.asarray(features, np.float32)
        return np.asarray(_affine(self.head.kernel[...], self.head.bias[...], feats))

    def logits(self, inputs: Inputs) -> np.ndarray:
        """Logits (n, len(classes)) float32 of raw inputs (images or a list of texts)."""
        return self.head_logits(self.featurize(inputs))


@dataclasses.dataclass(frozen=True)
class UserTask:
    """A user's task: label ``i`` of ``few_shot`` and ``test`` means class ``classes[i]``."""

    name: str
    domain: str
    classes: tuple[str, ...]
    few_shot: Split
    test: Split
    metadata: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, eq=False)
class Market:
    """Developers, users, the shared feature map and (vision) the pretrained backbone model."""

    config: MarketConfig
    developers: tuple[DeveloperModel, ...]
    users: tuple[UserTask, ...]
    featurize: Callable[[Inputs], np.ndarray]
    backbone: nnx.Module | None
    metadata: Mapping[str, Any]


# --- scoring ----------------------------------------------------------------------------------



def evaluate_market(market: Market) -> np.ndarray:
    """Accuracy matrix (n_users, n_developers) float64: every developer on every user's test set,
    by :func:`class_identity_accuracy`."""
    acc = np.zeros((len(market.users), len(market.developers)))
    for u, user in enumerate(market.users):
        feats = market.featurize(user.test.inputs)
        for d, dev in enumerate(market.developers):
            acc[u, d] = class_identity_accuracy(dev.head_logits(feats), dev.classes,
                                                user.test.labels, user.classes)
    return acc


def example_hashes(inputs: Inputs) -> tuple[str, ...]:
    """sha256 hex of each example's content (float32 row bytes, or UTF-8 text)."""
    if isinstance(inputs, list):
        return tuple(hashlib.sha256(t.encode("utf-8")).hexdigest() for t in inputs)
    rows = np.ascontiguousarray(inputs, np.float32).reshape(len(inputs), -1)
    return tuple(hashlib.sha256(r.tobytes()).hexdigest() for r in rows)


# --- feature maps -----------------------------------------------------------------------------


@jax.jit
def _affine(kernel: jax.Array, bias: jax.Array, x: jax.Array) -> jax.Array:
    return x @ kernel + bias[None, :]


@functools.partial(jax.jit, static_argnums=0)
def _backbone_features(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state).features(x)


def _padded_rows(x: np.ndarray, multiple: int) -> np.ndarray:
    pad = -x.shape[0] % multiple
    return np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]) if pad else x


class _BackboneFeatures:
    """Callable: images (n, D) -> backbone features (n, hidden), in fixed 512-row chunks."""

    def __init__(self, model: nnx.Module):
        self.graphdef, self.state = nnx.split(model)
        self.dim = model.feature_dim

    def __call__(self, inputs: Inputs) -> np.ndarray:
        x = np.asarray(inputs, np.float32)
        padded = _padded_rows(x, 512)
        out = [np.asarray(_backbone_features(self.graphdef, self.state, padded[i:i + 512]))
               for i in range(0, padded.shape[0], 512)]
        return np.concatenate(out)[: x.shape[0]] if out else np.zeros((0, self.dim), np.float32)


# --- data pools -------------------------------------------------------------------------------


def _seed(seed: int, purpose: str, *index: int) -> int:
    ss = np.random.SeedSequence([seed, zlib.crc32(purpose.encode()), *index])
    return int(ss.generate_state(1)[0])


def _per_class(split: Split, n: int | None, seed: int, *, shuffle: bool = False) -> Split:
    """At most ``n`` (None: all) seeded examples of each class; order kept unless ``shuffle``."""
    rng = np.random.default_rng(seed)
    keep = [idx[rng.permutation(idx.shape[0])[:n]]
            for c in np.unique(split.labels) for idx in [np.flatnonzero(split.labels == c)]]
    idx = np.concatenate(keep) if keep else np.zeros(0, np.int64)
    return split.take(idx[rng.permutation(idx.shape[0])] if shuffle else np.sort(idx))


def _drop(split: Split, hashes: set[str]) -> Split:
    """``split`` without examples whose content is in ``hashes`` or repeats an earlier one."""
    seen, keep = set(hashes), []
    for i, h in enumerate(example_hashes(split.inputs)):
        if h not in seen:
            seen.add(h)
            keep.append(i)
    return split.take(keep)


def _select(split: Split, classes: Sequence[int]) -> Split:
    """Examples of ``classes`` (pool label ids), relabelled to their position in ``classes``."""
    top = [int(c) for c in classes] + ([int(split.labels.max())] if len(split) else [])
    lut = np.full(max(top) + 1, -1, np.int32)
    lut[list(classes)] = np.arange(len(classes), dtype=np.int32)
    kept = split.take(np.flatnonzero(lut[split.labels] >= 0))
    return Split(kept.inputs, lut[kept.labels])


def _on_digit_grid(x: np.ndarray) -> np.ndarray:
    """MNIST (n, 784) -> (n, 64): pad 28x28 to 32x32, then 4x4 block means (the digits recipe)."""
    img = np.pad(x.reshape(-1, 28, 28), ((0, 0), (2, 2), (2, 2)))
    return img.reshape(-1, 8, 4, 8, 4).mean(axis=(2, 4)).reshape(-1, 64).astype(np.float32)


def _raw_domains(config: MarketConfig) -> tuple[list[Task], Split | None]:
    """Downstream task per domain and (vision) the backbone's pretraining split (digits 0-4)."""
    tasks, pretrain = [], []
    for domain in config.domains:
        task = load_task(domain, seed=config.seed)
        if config.track == "text":
            tasks.append(task)
            continue
        if domain == "mnist5k":
            task = task.replace(**{s: Split(_on_digit_grid(getattr(task, s).inputs),
                                            getattr(task, s).labels)
                                   for s in ("train", "dev", "test")})
        pretrain.append(_select(task.train, range(5)))
        tasks.append(class_subset_task(task, _DOWNSTREAM_DIGITS, name=f"{domain}_5to9"))
    if not pretrain:
        return tasks, None
    return tasks, Split(np.concatenate([p.inputs for p in pretrain]),
                        np.concatenate([p.labels for p in pretrain]))


def _pools(config: MarketConfig, tasks: list[Task], pretrain: Split | None) -> list[Task]:
    """Developer pools (train, capped per class), user few-shot (dev) and test pools; dev and
    test lose repeats and anything whose content appears in training data (test: or in dev)."""
    out, trained = [], set() if pretrain is None else set(example_hashes(pretrain.inputs))
    for i, task in enumerate(tasks):
        counts = task.train.counts(task.num_classes)
        if min(counts) < config.train_per_class:
            raise ValueError(f"train_per_class={config.train_per_class} but domain "
                             f"{config.domains[i]!r} has only {min(counts)} training examples "
                             "of some class; lower train_per_class")
        out.append(task.replace(train=_per_class(task.train, config.train_per_class,
                                                 _seed(config.seed, "train-pool", i))))
        trained |= set(example_hashes(out[-1].train.inputs))
    for i, task in enumerate(out):
        dev = _drop(task.dev, trained)
        test = _drop(_drop(task.test, trained), set(example_hashes(dev.inputs)))
        short = min(dev.counts(task.num_classes))
        if short < config.shots_per_class:
            raise ValueError(f"shots_per_class={config.shots_per_class} is too many for the data: "
                             f"domain {config.domains[i]!r} has only {short} user examples of "
                             "some class; lower shots_per_class")
        if min(test.counts(task.num_classes)) == 0:
            raise ValueError(f"domain {config.domains[i]!r} has a class with no test example")
        out[i] = task.replace(dev=dev, test=test)
    return out


# --- planning and training --------------------------------------------------------------------


def _quality_counts(n: int, fractions: Sequence[float]) -> list[int]:
    exact = np.asarray(fractions) * n
    counts = np.floor(exact + 1e-9).astype(int)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: n - counts.sum()]] += 1
    return counts.tolist()


def _specialities(pools: list[Task], config: MarketConfig) -> list[tuple[int, tuple[int, ...]]]:
    """(domain index, class subset) pairs: seeded order per domain, round-robin over domains."""
    per_domain = []
    for i, pool in enumerate(pools):
        k = pool.num_classes
        subsets = [c for s in config.subset_sizes if s <= k
                   for c in itertools.combinations(range(k), s)] or [tuple(range(k))]
        order = np.random.default_rng(_seed(config.seed, "subsets", i)).permutation(len(subsets))
        per_domain.append([(i, subsets[j]) for j in order])
    rounds = itertools.zip_longest(*per_domain)
    return [s for r in rounds for s in r if s is not None]


def _plan(pools: list[Task], config: MarketConfig) -> tuple[list[tuple], list[tuple]]:
    """Developers as (domain, subset, quality) in shuffled order; users as (domain, subset)."""
    specs = _specialities(pools, config)
    n_good, n_under, n_bad = _quality_counts(config.n_developers, config.quality_fractions)
    good = [specs[i % len(specs)] for i in range(n_good)]
    mirror = good or specs
    devs = ([(*s, "good") for s in good]
            + [(*mirror[j % len(mirror)], "undertrained") for j in range(n_under)]
            + [(*mirror[j % len(mirror)], "corrupted") for j in range(n_bad)])
    order = np.random.default_rng(_seed(config.seed, "developer-order")).permutation(len(devs))
    users = [mirror[u % len(mirror)] for u in range(config.n_users)]
    return [devs[j] for j in order], users


def _head_loss(p, rows, *, feats, labels, mask):
    """Mean cross-entropy of head ``p = (kernel, bias)`` on ``rows``; classes outside ``mask``
    (padding) get logit -1e9."""
    logits = feats[rows] @ p[0] + p[1][None, :]
    logits = jnp.where(mask[None, :], logits, jnp.asarray(-1e9, jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels[rows]).mean()


@functools.partial(jax.jit, static_argnames=("learning_rate",))
def _train_heads(kernel, bias, feats, labels, class_mask, indices, n_steps, *, learning_rate):
    """Adam on softmax cross-entropy of linear heads, vmapped over developers.

    kernel (D, d, K), bias (D, K), feats (D, N, d), labels (D, N), class_mask (D, K) (padded
    classes get logit -1e9), indices (D, T, B), n_steps (D,): steps >= n_steps are skipped.
    """
    tx = promotion_safe(optax.adam(learning_rate))

    def one(kernel, bias, feats, labels, mask, idx, n):
        loss = functools.partial(_head_loss, feats=feats, labels=labels, mask=mask)

        def step(carry, inp):
            params, state = carry
            t, rows = inp
            updates, new_state = tx.update(jax.grad(loss)(params, rows), state, params)
            new = (optax.apply_updates(params, updates), new_state)
            return jax.tree.map(lambda a, b: jnp.where(t < n, a, b), new, carry), None

        params = (kernel, bias)
        steps = jnp.arange(idx.shape[0], dtype=jnp.int32)
        (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), (steps, idx))
        return params

    return jax.vmap(one)(kernel, bias, feats, labels, class_mask, indices, n_steps)


def _warmup_steps(recipe: _recipes.Recipe, total: int) -> int:
    """Warm-up steps of ``recipe`` over ``total`` steps, rounded as ``recipes.schedule`` does."""
    return int(round(recipe.warmup_fraction * total))


def _schedule_value(kind: jax.Array, peak: jax.Array, t: jax.Array, total: jax.Array,
                    warmup: jax.Array) -> jax.Array:
    """The rate at step ``t`` of ``recipes.schedule(SCHEDULES[kind], peak, total, f)`` with
    ``warmup = round(f * total)`` (computed on the host, as that function does); every argument
    may be traced, so developers of one compiled chunk can have their own schedules.

    Linear warm-up ``0 -> peak`` over ``warmup`` steps, then over ``D = max(total - warmup, 1)``
    steps: cosine ``0.5 * peak * (1 + cos(pi * s / D))``, linear ``peak * (1 - s / D)`` or the
    constant ``peak`` (``s = t - warmup``, clipped to ``[0, D]``).
    """
    f32 = jnp.float32
    t, total, warmup = (jnp.asarray(v, jnp.int32) for v in (t, total, warmup))
    peak = jnp.asarray(peak, f32)
    span = jnp.maximum(total - warmup, 1)
    frac = jnp.clip(t - warmup, 0, span).astype(f32) / span.astype(f32)
    cosine = peak * (0.5 * (1.0 + jnp.cos(jnp.pi * frac)))
    linear = peak * (1.0 - frac)
    decay = jnp.select([kind == _recipes.SCHEDULES.index("cosine"),
                        kind == _recipes.SCHEDULES.index("linear")], [cosine, linear], peak)
    warm = peak * (t.astype(f32) / jnp.maximum(warmup, 1).astype(f32))
    return jnp.where(t < warmup, warm, decay)


@jax.jit
def _train_heads_recipe(kernel, bias, feats, labels, class_mask, indices, n_steps, totals,
                        warmups, kinds, peaks, decays):
    """AdamW under per-developer schedules on softmax cross-entropy of linear heads, vmapped over
    developers (the ``developer_recipe`` trainer).

    As :func:`_train_heads`, plus per developer (D,) arrays: ``totals`` (the schedule's steps),
    ``warmups`` (its warm-up steps), ``kinds`` (index in ``recipes.SCHEDULES``), ``peaks`` (peak
    rate) and ``decays`` (decoupled weight decay). Step ``t`` moves ``p - lr_t * u`` with ``u``
    Adam's direction plus ``decay * p`` (AdamW; every parameter decays, as ``optax.adamw``).
    """

    def one(kernel, bias, feats, labels, mask, idx, n, total, warmup, kind, peak, wd):
        tx = promotion_safe(optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(wd)))

        loss = functools.partial(_head_loss, feats=feats, labels=labels, mask=mask)

        def step(carry, inp):
            params, state = carry
            t, rows = inp
            updates, new_state = tx.update(jax.grad(loss)(params, rows), state, params)
            lr = _schedule_value(kind, peak, t, total, warmup)
            new = (jax.tree.map(lambda p, u: p - lr * u, params, updates), new_state)
            return jax.tree.map(lambda a, b: jnp.where(t < n, a, b), new, carry), None

        params = (kernel, bias)
        steps = jnp.arange(idx.shape[0], dtype=jnp.int32)
        (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), (steps, idx))
        return params

    return jax.vmap(one)(kernel, bias, feats, labels, class_mask, indices, n_steps, totals,
                         warmups, kinds, peaks, decays)


def _recipe_steps(recipe: _recipes.Recipe, n: int, quality: str,
                  undertrained_steps: int) -> tuple[int, int]:
    """(steps taken, steps the schedule spans) of a developer with ``n`` examples trained by
    ``recipe``: ``epochs * (n // batch_size)`` (at least 1) for a good or corrupted one; an
    undertrained one stops after ``undertrained_steps`` of that schedule."""
    total = max(1, recipe.epochs * (n // recipe.batch_size))
    if quality != "undertrained":
        return total, total
    if undertrained_steps >= total:
        raise ValueError(f"undertrained_steps ({undertrained_steps}) must be below the {total} "
                         f"steps the tuned recipe gives a developer of {n} examples (epochs "
                         f"{recipe.epochs}, batch {recipe.batch_size}); lower "
                         "undertrained_steps")
    return undertrained_steps, total


def _epoch_batches(n: int, epochs: int, batch: int, rng: np.random.Generator) -> np.ndarray:
    """(steps, batch) int32: one shuffled pass per epoch, remainder dropped; fewer than ``batch``
    examples give one batch drawn as :func:`_batches` does (examples repeat)."""
    per = n // batch
    if per == 0:
        return _batches(n, 1, batch, rng)
    return np.concatenate([rng.permutation(n)[: per * batch].reshape(per, batch)
                           for _ in range(epochs)]).astype(np.int32)


def _batches(n: int, steps: int, batch: int, rng: np.random.Generator) -> np.ndarray:
    order = np.concatenate([rng.permutation(n) for _ in range(-(-steps * batch // n))])
    return order[: steps * batch].reshape(steps, batch).astype(np.int32)


def _corrupt(labels: np.ndarray, k: int, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Move a seeded ``fraction`` (rounded half up) of labels to the next class, mod k."""
    idx = rng.permutation(labels.shape[0])[: int(np.floor(fraction * labels.shape[0] + 0.5))]
    out = labels.copy()
    out[idx] = (out[idx] + 1) % k
    return out


def _linear(kernel: np.ndarray, bias: np.ndarray) -> nnx.Linear:
    head = nnx.Linear(kernel.shape[0], kernel.shape[1], dtype=jnp.float32, rngs=nnx.Rngs(0))
    head.kernel[...] = jnp.asarray(kernel)
    head.bias[...] = jnp.asarray(bias)
    return head


class _Job(NamedTuple):
    """One developer to train: ``rows`` of its pool's train split, the ``labels`` it trains on
    (0..len(subset)-1, corrupted if so) and its own random stream."""

    pool: int
    subset: tuple[int, ...]
    quality: str
    rows: np.ndarray
    labels: np.ndarray
    steps: int
    rng: np.random.Generator
    total: int = 0  # steps its schedule spans (developer_recipe only)
    recipe: _recipes.Recipe | None = None


def _job(j: int, entry: tuple, pools: list[Task], config: MarketConfig) -> _Job:
    p, subset, quality = entry
    rng = np.random.default_rng(_seed(config.seed, "developer", j))
    lut = np.full(pools[p].num_classes, -1, np.int32)
    lut[list(subset)] = np.arange(len(subset), dtype=np.int32)
    rows = np.flatnonzero(lut[pools[p].train.labels] >= 0)
    labels = lut[pools[p].train.labels[rows]]
    if quality == "corrupted":
        labels = _corrupt(labels, len(subset), config.corrupt_label_fraction, rng)
    if config.developer_recipe is None:
        steps = config.undertrained_steps if quality == "undertrained" else config.train_steps
        return _Job(p, subset, quality, rows, labels, steps, rng)
    recipe = _developer_recipes(config)[config.domains[p]]
    steps, total = _recipe_steps(recipe, len(rows), quality, config.undertrained_steps)
    return _Job(p, subset, quality, rows, labels, steps, rng, total, recipe)


def _fit_chunk(chunk: list[_Job], pool_feats: list[np.ndarray], n_max: int, k_max: int,
               config: MarketConfig, t_max: int | None = None) -> list[nnx.Linear]:
    """Heads of up to ``_CHUNK_DEVELOPERS`` developers from one compiled call; every chunk is
    padded to the same shapes (padding developers take 0 steps), so one compilation serves all.
    Heads start from N(0, 1/d) kernels and zero biases. ``t_max``: the scan length with a
    ``developer_recipe`` (the market's longest schedule; default ``config.train_steps``)."""
    c, d = _CHUNK_DEVELOPERS, pool_feats[0].shape[1]
    tuned = config.developer_recipe is not None
    t_max = config.train_steps if t_max is None else t_max
    batch = chunk[0].recipe.batch_size if tuned else config.batch_size
    padded = chunk + [chunk[-1]._replace(steps=0)] * (c - len(chunk))
    kernel = np.zeros((c, d, k_max), np.float32)
    feats = np.zeros((c, n_max, d), np.float32)
    labels = np.zeros((c, n_max), np.int32)
    mask = np.zeros((c, k_max), bool)
    indices = np.zeros((c, t_max, batch), np.int32)
    for i, job in enumerate(padded):
        k, n = len(job.subset), len(job.rows)
        kernel[i, :, :k] = job.rng.normal(0.0, d ** -0.5, (d, k))
        feats[i, :n], labels[i, :n], mask[i, :k] = pool_feats[job.pool][job.rows], job.labels, True
        if tuned:
            rows = _epoch_batches(n, job.recipe.epochs, batch, job.rng)
            indices[i, :rows.shape[0]] = rows
        else:
            indices[i] = _batches(n, config.train_steps, config.batch_size, job.rng)
    n_steps = np.asarray([job.steps for job in padded], np.int32)
    if tuned:
        r = [job.recipe for job in padded]
        w, b = _train_heads_recipe(
            kernel, np.zeros((c, k_max), np.float32), feats, labels, mask, indices, n_steps,
            np.asarray([job.total for job in padded], np.int32),
            np.asarray([_warmup_steps(x, job.total) for x, job in zip(r, padded)], np.int32),
            np.asarray([_recipes.SCHEDULES.index(x.schedule) for x in r], np.int32),
            np.asarray([x.head_learning_rate for x in r], np.float32),
            np.asarray([x.weight_decay for x in r], np.float32))
    else:
        w, b = _train_heads(kernel, np.zeros((c, k_max), np.float32), feats, labels, mask,
                            indices, n_steps, learning_rate=float(config.learning_rate))
    w, b = np.asarray(w), np.asarray(b)
    return [_linear(w[i, :, :len(job.subset)], b[i, :len(job.subset)])
            for i, job in enumerate(chunk)]


def _train_developers(jobs: list[_Job], pools: list[Task], pool_feats: list[np.ndarray],
                      featurize: Callable, config: MarketConfig,
                      progress: bool) -> tuple[DeveloperModel, ...]:
    n_max, k_max = max(len(j.rows) for j in jobs), max(len(j.subset) for j in jobs)
    t_max = None if config.developer_recipe is None else max(j.total for j in jobs)
    heads: list[nnx.Linear] = []
    with tqdm(total=len(jobs), desc="training developers", disable=not progress) as bar:
        for start in range(0, len(jobs), _CHUNK_DEVELOPERS):
            chunk = jobs[start:start + _CHUNK_DEVELOPERS]
            heads += _fit_chunk(chunk, pool_feats, n_max, k_max, config, t_max)
            bar.update(len(chunk))
    developers = []
    for j, (job, head) in enumerate(zip(jobs, heads)):
        pool, domain = pools[job.pool], config.domains[job.pool]
        classes = tuple(pool.label_names[c] for c in job.subset)
        corrupted = config.corrupt_label_fraction if job.quality == "corrupted" else 0.0
        meta = {"steps": job.steps, "n_train": len(job.rows), "corrupt_label_fraction": corrupted,
                "learning_rate": config.learning_rate}
        if job.recipe is not None:  # peak rate of its schedule, which spans schedule_steps
            meta |= {"learning_rate": job.recipe.head_learning_rate,
                     "schedule_steps": job.total, "developer_recipe": config.developer_recipe,
                     "recipe": job.recipe.to_dict()}
        developers.append(DeveloperModel(
            f"dev{j:03d}-{domain}-{'_'.join(classes)}-{job.quality}", domain, classes,
            job.quality, head, featurize, Split(pool.train.take(job.rows).inputs, job.labels),
            MappingProxyType(meta)))
    return tuple(developers)


def _make_users(plan: list[tuple], pools: list[Task], config: MarketConfig
                ) -> tuple[UserTask, ...]:
    users = []
    for u, (p, subset) in enumerate(plan):
        pool, seed = pools[p], _seed(config.seed, "user", u)
        classes = tuple(pool.label_names[c] for c in subset)
        few = _per_class(_select(pool.dev, subset), config.shots_per_class, seed, shuffle=True)
        test = _per_class(_select(pool.test, subset), config.test_per_class, seed + 1)
        users.append(UserTask(f"user{u:03d}-{config.domains[p]}-{'_'.join(classes)}",
                              config.domains[p], classes, few, test,
                              MappingProxyType({"seed": seed})))
    return tuple(users)


def build_market(config: MarketConfig, *, progress: bool = True, cache: bool = True) -> Market:
    """Build the market ``config`` describes (see the module docstring for the recipe).

    ``progress`` shows tqdm bars; ``cache`` lets ``pretrain_backbone`` reuse / store the vision
    backbone in the user's cache directory.

    Vision builds in seconds on a CPU (the backbone is cached after the first build); text embeds
    every developer-training and user-test text once with MiniLM (about a minute for the
    defaults on 2 CPU cores). Raises ``ValueError`` when the data cannot supply the requested
    sizes, and ``AssetMissingError`` when a domain's data is not installed.
    """
    if not isinstance(config, MarketConfig):
        raise TypeError(f"config must be a MarketConfig, got {type(config).__name__}")
    tasks, pretrain = _raw_domains(config)
    pools = _pools(config, tasks, pretrain)
    dev_plan, user_plan = _plan(pools, config)
    # Jobs before any embedding: a developer_recipe's step counts are checked here, not after a
    # minute of MiniLM. Each job draws from its own stream, so this order changes nothing.
    jobs = [_job(j, entry, pools, config) for j, entry in enumerate(dev_plan)]
    backbone, meta = None, {"domains": config.domains}
    if config.track == "vision":
        # pavejax.models is imported lazily here and below: it pulls in the text extra.
        from pavejax.models import PretrainConfig, pretrain_backbone

        result = pretrain_backbone(pretrain.inputs, pretrain.labels, PretrainConfig(
            arch="mlp", hidden=config.hidden, steps=config.backbone_steps, seed=config.seed),
            cache=cache)
        backbone = result.model
        featurize: Callable = _BackboneFeatures(backbone)
        meta |= {"backbone_key": result.key, "feature_map": "pretrained MLP on digits 0-4"}
    else:
        featurize = functools.partial(embed_texts, max_length=config.max_length)
        meta |= {"feature_map": f"all-MiniLM-L6-v2 mean pool, {config.max_length} tokens"}
    if config.track == "text":  # the long part of a text build: show it
        embed_texts([t for p in pools for t in p.train.inputs], max_length=config.max_length,
                    progress=progress)
    pool_feats = [np.asarray(featurize(p.train.inputs), np.float32) for p in pools]
    developers = _train_developers(jobs, pools, pool_feats, featurize, config, progress)
    return Market(config, developers, _make_users(user_plan, pools, config), featurize,
                  backbone, MappingProxyType(meta))


def developer_classifier(market: Market, developer: DeveloperModel) -> nnx.Module:
    """The developer's model as one NNX classifier on raw model inputs: vision, the backbone MLP
    with the developer's head ((n, 64) pixels -> logits); text, a ``TextClassifier`` (MiniLM,
    mean pooling) with it ((n, T) token ids and mask -> logits, tokens of length
    ``config.max_length``)."""
    k = len(developer.classes)
    if market.backbone is not None:
        from pavejax.models import with_new_head

        model = with_new_head(market.backbone, k)
        model.head = nnx.clone(developer.head)
        return model
    from pavejax.models import TextClassifier, load_minilm

    encoder, _ = load_minilm(max_length=market.config.max_length)
    model = TextClassifier(encoder, k, rngs=nnx.Rngs(0), pooling="mean")
    model.head.dense = nnx.clone(developer.head)
    return model
