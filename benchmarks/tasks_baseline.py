"""Non-private baselines per task: frozen-feature probe and LoRA fine-tuning of real MiniLM.

For each text task of the suite (``movie``, ``amazon``, ``nyt``, ``tweets``: binary sentiment in
four domains; ``bbc``: 5-way news topics), on all-MiniLM-L6-v2 (real weights) and real text:

* ``probe``: the frozen encoder's mean-pooled features (computed once per task, in fixed-size
  jitted batches) and a multinomial logistic-regression head fitted by full-batch Adam with a
  small L2 penalty (a linear evaluation of the frozen backbone);
* ``lora``: LoRA rank 8 on every query and value projection (A frozen, B trained) plus a linear
  head on mean-pooled features, trained non-privately with Adam on the mean cross-entropy,
  shuffled minibatches (remainder dropped), a fixed number of epochs.

Full mode (sized for one accelerator): 1,024 train / 512 test examples per task (stratified),
64 tokens, batch 32, 2 epochs (64 LoRA steps). ``--quick``: 128 / 128 examples, 32 tokens,
batch 16, 2 epochs (16 LoRA steps). Rows: task, method, classes, examples, steps, test accuracy,
the test set's majority-class rate, and seconds (tokenisation excluded; compilation included,
so the first task of a label-space size pays it). Summary: ``probe_<task>`` and ``lora_<task>``
test accuracies, and their means. All seeds are fixed: the same settings give the same numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from pavejax import lora
from pavejax.data import iterate_batches, load_task
from pavejax.models import TextClassifier, load_minilm, mean_pool
from pavejax.optim import promotion_safe

TASKS: tuple[str, ...] = ("movie", "amazon", "nyt", "tweets", "bbc")
LORA_TARGETS: tuple[str, ...] = ("attention/query/kernel", "attention/value/kernel")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")


def _positive_float(name: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and np.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Config:
    """What is measured; the defaults are the full mode.

    Attributes:
      tasks: task names, a non-empty subset of ``TASKS``.
      train_size, test_size: examples per task (stratified subsamples of the task's splits).
      seq_len: tokens per example (truncated / padded).
      batch_size: LoRA minibatch size; must not exceed ``train_size``.
      epochs: LoRA passes over the training examples (``train_size // batch_size`` steps each).
      lora_rank: rank ``r`` of the factors on query and value.
      learning_rate: Adam learning rate of LoRA ``B`` and the head.
      probe_steps, probe_learning_rate: full-batch Adam steps and rate of the probe head.
      probe_l2: coefficient of ``0.5 * ||W||^2`` added to the probe's mean cross-entropy.
      eval_batch: batch size of feature extraction and evaluation (padded to fixed shape).
      seed: seed of the splits, the head and LoRA initialisation, and the batch order.
    """

    tasks: tuple[str, ...] = TASKS
    train_size: int = 1024
    test_size: int = 512
    seq_len: int = 64
    batch_size: int = 32
    epochs: int = 2
    lora_rank: int = 8
    learning_rate: float = 1e-3
    probe_steps: int = 500
    probe_learning_rate: float = 1e-2
    probe_l2: float = 1e-3
    eval_batch: int = 128
    seed: int = 0

    def __post_init__(self):
        tasks = (self.tasks,) if isinstance(self.tasks, str) else tuple(self.tasks)
        unknown = [t for t in tasks if t not in TASKS]
        if not tasks or unknown:
            raise ValueError(f"tasks must be a non-empty subset of {TASKS}, got {self.tasks!r}.")
        object.__setattr__(self, "tasks", tasks)
        for name in ("train_size", "test_size", "batch_size", "epochs", "lora_rank",
                     "probe_steps", "eval_batch"):
            _positive_int(name, getattr(self, name))
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ValueError(f"seq_len must be an int >= 2 (room for [CLS] and [SEP]), "
                             f"got {self.seq_len!r}.")
        if self.batch_size > self.train_size:
            raise ValueError(f"batch_size {self.batch_size} exceeds train_size "
                             f"{self.train_size}; lower batch_size or raise train_size.")
        _positive_float("learning_rate", self.learning_rate)
        _positive_float("probe_learning_rate", self.probe_learning_rate)
        _positive_float("probe_l2", self.probe_l2, allow_zero=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}.")


QUICK = Config(train_size=128, test_size=128, seq_len=32, batch_size=16, epochs=2)


def _encode(tok, split) -> dict[str, np.ndarray]:
    t = tok(list(split.inputs))
    return {"input_ids": t.input_ids, "attention_mask": t.attention_mask,
            "label": np.asarray(split.labels, np.int32)}


def _map_padded(fn, data: dict[str, np.ndarray], batch: int) -> jax.Array:
    """Applies ``fn(input_ids, attention_mask)`` in fixed-size batches (one compilation); the last
    batch is padded with all-padding rows whose outputs are dropped."""
    n = data["input_ids"].shape[0]
    outs = []
    for start in range(0, n, batch):
        ids = data["input_ids"][start:start + batch]
        mask = data["attention_mask"][start:start + batch]
        pad = batch - ids.shape[0]
        if pad:
            ids = np.concatenate([ids, np.zeros((pad, ids.shape[1]), ids.dtype)])
            mask = np.concatenate([mask, np.zeros((pad, mask.shape[1]), mask.dtype)])
        outs.append(fn(jnp.asarray(ids), jnp.asarray(mask))[:batch - pad])
    return jnp.concatenate(outs)


@functools.partial(jax.jit, static_argnums=0)
def _features(graphdef, state, input_ids, attention_mask):
    hidden = nnx.merge(graphdef, state)(input_ids, attention_mask)
    return mean_pool(hidden, attention_mask)


def encoder_features(encoder, data: dict[str, np.ndarray], batch: int = 128) -> jax.Array:
    """Frozen mean-pooled features of ``encoder``: ``(n, seq_len)`` ids/mask -> ``(n, hidden)``
    float32, the same pooling as ``TextClassifier(pooling="mean")``."""
    graphdef, state = nnx.split(encoder)
    return _map_padded(functools.partial(_features, graphdef, state), data, batch)


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)
    return -jnp.mean(picked)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _fit_probe(x, y, num_classes, steps, learning_rate, l2):
    opt = promotion_safe(optax.adam(learning_rate))
    # The objective is convex, so a zero start loses nothing and needs no key.
    params = {"w": jnp.zeros((x.shape[1], num_classes), jnp.float32),
              "b": jnp.zeros((num_classes,), jnp.float32)}

    def loss(p):
        return _xent(x @ p["w"] + p["b"][None, :], y) + 0.5 * l2 * jnp.sum(jnp.square(p["w"]))

    def step(carry, _):
        p, s = carry
        updates, s = opt.update(jax.grad(loss)(p), s, p)
        return (optax.apply_updates(p, updates), s), None

    (params, _), _ = jax.lax.scan(step, (params, opt.init(params)), None, length=steps)
    return params


def fit_probe(x: jax.Array, y: jax.Array, num_classes: int, cfg: Config) -> dict[str, jax.Array]:
    """Logistic-regression head on features ``x (n, d)`` float32 and labels ``y (n,)`` int32:
    ``cfg.probe_steps`` full-batch Adam steps from zero on mean cross-entropy + L2.
    Returns ``{"w": (d, num_classes), "b": (num_classes,)}``."""
    return _fit_probe(x, y, num_classes, cfg.probe_steps, cfg.probe_learning_rate, cfg.probe_l2)


def _accuracy(pred: jax.Array, labels: np.ndarray) -> float:
    return float(np.mean(np.asarray(pred) == labels))


def _is_lora_target(path: str, _leaf) -> bool:
    return path.endswith(LORA_TARGETS)


@functools.cache
def _lora_fns(graphdef, lcfg: lora.LoraConfig, learning_rate: float):
    """The optimiser and jitted (step, predict) for one model structure; cached so that tasks
    with the same label space reuse the compiled code."""
    opt = promotion_safe(optax.adam(learning_rate))

    def logits(trainable, frozen, ids, mask):
        p = dict(frozen["params"])
        p["head"] = trainable["head"]
        p = lora.apply_lora(p, trainable["B"], frozen["A"], lcfg)
        return nnx.merge(graphdef, p)(ids, mask)

    def loss(trainable, frozen, batch):
        return _xent(logits(trainable, frozen, batch["input_ids"], batch["attention_mask"]),
                     batch["label"])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(trainable, opt_state, frozen, batch):
        value, grads = jax.value_and_grad(loss)(trainable, frozen, batch)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, value

    @jax.jit
    def predict(trainable, frozen, ids, mask):
        return jnp.argmax(logits(trainable, frozen, ids, mask), axis=-1)

    return opt, step, predict


def train_lora(encoder, num_classes: int, train: dict[str, np.ndarray],
               test: dict[str, np.ndarray], cfg: Config, desc: str = "lora") -> dict[str, Any]:
    """Fine-tunes LoRA (query, value) + a head on ``train`` and evaluates on ``test``.

    ``train``/``test``: ``input_ids``, ``attention_mask`` ``(n, seq_len)`` int32 and ``label``
    ``(n,)`` int32. Returns ``{"accuracy", "steps", "first_loss", "last_loss", "b_norm"}``:
    losses are mean cross-entropies of the first and last minibatch, in nats; ``b_norm`` is the
    Frobenius norm of the trained ``B`` factors (zero at the start).
    """
    model = TextClassifier(encoder, num_classes, rngs=nnx.Rngs(cfg.seed))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    lcfg = lora.LoraConfig(cfg.lora_rank)
    B, A = lora.init_lora(jax.random.key(cfg.seed + 1), params, _is_lora_target, lcfg)
    opt, step, predict = _lora_fns(graphdef, lcfg, cfg.learning_rate)
    trainable = {"B": B, "head": jax.tree.map(jnp.copy, params["head"])}
    frozen = {"params": params, "A": A}
    opt_state = opt.init(trainable)
    n = train["label"].shape[0]
    steps = cfg.epochs * (n // cfg.batch_size)
    losses = []
    with tqdm(total=steps, desc=desc, leave=False, disable=None) as bar:
        for epoch in range(cfg.epochs):
            for idx in iterate_batches(n, cfg.batch_size, cfg.seed + epoch, drop_last=True):
                batch = {k: jnp.asarray(v[idx]) for k, v in train.items()}
                trainable, opt_state, value = step(trainable, opt_state, frozen, batch)
                losses.append(value)
                bar.update()
    pred = _map_padded(functools.partial(predict, trainable, frozen), test, cfg.eval_batch)
    losses = [float(v) for v in losses]
    b_norm = float(jnp.sqrt(sum(jnp.sum(jnp.square(b)) for b in trainable["B"].values())))
    return {"accuracy": _accuracy(pred, test["label"]), "steps": steps,
            "first_loss": losses[0], "last_loss": losses[-1], "b_norm": b_norm}


def _row(task, method, k, n_train, test, steps, accuracy, seconds) -> dict[str, Any]:
    majority = float(np.max(np.bincount(test["label"], minlength=k)) / test["label"].shape[0])
    return {"task": task, "method": method, "classes": k, "train_examples": n_train,
            "test_examples": int(test["label"].shape[0]), "steps": steps,
            "accuracy": accuracy, "majority": majority, "seconds": seconds}


def run_task(name: str, encoder, tok, cfg: Config) -> list[dict[str, Any]]:
    """The ``probe`` and ``lora`` rows of one task."""
    task = load_task(name, seed=cfg.seed, max_train=cfg.train_size, max_test=cfg.test_size)
    train, test = _encode(tok, task.train), _encode(tok, task.test)
    k, n = task.num_classes, int(train["label"].shape[0])

    t0 = time.perf_counter()
    x_train = encoder_features(encoder, train, cfg.eval_batch)
    x_test = encoder_features(encoder, test, cfg.eval_batch)
    head = fit_probe(x_train, jnp.asarray(train["label"]), k, cfg)
    pred = jnp.argmax(x_test @ head["w"] + head["b"][None, :], axis=-1)
    probe_acc = _accuracy(pred, test["label"])
    rows = [_row(name, "probe", k, n, test, cfg.probe_steps, probe_acc, time.perf_counter() - t0)]

    t0 = time.perf_counter()
    res = train_lora(encoder, k, train, test, cfg, desc=f"lora {name}")
    rows.append(_row(name, "lora", k, n, test, res["steps"], res["accuracy"],
                     time.perf_counter() - t0))
    return rows


def run_benchmark(cfg: Config) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Rows for every task of ``cfg`` and the summary ``{probe_<task>, lora_<task>,
    probe_mean, lora_mean}`` (test accuracies in [0, 1])."""
    encoder, tok = load_minilm(max_length=cfg.seq_len)
    rows: list[dict[str, Any]] = []
    for name in tqdm(cfg.tasks, desc="tasks", disable=None):
        rows += run_task(name, encoder, tok, cfg)
    summary = {f"{r['method']}_{r['task']}": r["accuracy"] for r in rows}
    for method in ("probe", "lora"):
        summary[f"{method}_mean"] = float(np.mean([r["accuracy"] for r in rows
                                                   if r["method"] == method]))
    return rows, summary


def run(cfg: Config, out: Path | None = None, *, quick: bool = False) -> dict[str, Any]:
    """Runs the benchmark, prints the table and writes the JSON result to ``out`` if given."""
    rows, summary = run_benchmark(cfg)
    config = {"model": "all-MiniLM-L6-v2", "pooling": "mean",
              "lora_targets": ["query", "value"], "optimizer": "adam", "quick": quick,
              **dataclasses.asdict(cfg)}
    config["tasks"] = list(cfg.tasks)
    return _common.emit("tasks_baseline", config, rows, summary, out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _common.parse_args(__doc__.splitlines()[0], argv)
    return run(QUICK if args.quick else Config(), args.out, quick=args.quick)


if __name__ == "__main__":
    main()
