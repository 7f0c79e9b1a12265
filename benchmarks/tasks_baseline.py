"""Non-private references per task: a frozen-feature probe, LoRA and full fine-tuning of real
MiniLM, each with the package's tuned recipe (:mod:`pavejax.recipes`).

For each text task of the suite (``movie``, ``amazon``, ``nyt``, ``tweets``: binary sentiment in
four domains; ``bbc``: 5-way news topics), on all-MiniLM-L6-v2 (real weights) and real text:

* ``probe``: a linear head on the frozen encoder's mean-pooled features (computed once per
  task), trained with the tuned ``"head"`` recipe (minibatch AdamW, warm-up and decay);
* ``lora``: LoRA factors on the recipe's targets plus a linear head on mean-pooled features;
* ``full``: every encoder weight plus the head (the upper reference).

Every method trains on the mean cross-entropy with shuffled minibatches (remainder dropped).
Full mode (sized for one accelerator; about 40 minutes on 2 CPU cores): 1,024 train / 512 test
examples per task (stratified), 64 tokens. ``--quick``: probe and LoRA only, 128 / 128
examples, 32 tokens, the recipes' other settings with batch 16. Rows: task, method, classes,
examples, steps, test accuracy, the test set's majority-class rate, and seconds (tokenisation
excluded; compilation included). Summary: ``probe_<task>``, ``lora_<task>`` and
``full_<task>`` test accuracies and
their means, and ``lora_minus_probe_<task>``.

``--sweep``: the choice of the recipes. For each task family and each method, every candidate of
``SWEEP`` trains on the training split of every task of the family and is scored on the task's
**dev** split (512 examples); the candidate with the best mean dev accuracy is chosen (ties: the
earlier candidate). The test splits are not encoded or read. Rows: family, method, candidate,
task, dev accuracy; the chosen recipes are written to ``--recipes-out`` (default: next to
``--out``, else ``tuned_recipes.json``) in the format of :func:`pavejax.recipes.load_recipes`;
``--recipes FILE`` runs the benchmark with such a file instead of the package presets. All
seeds are fixed: the same settings give the same numbers.
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

from pavejax import lora, recipes
from pavejax.data import iterate_batches, load_task
from pavejax.models import TextClassifier, load_minilm, mean_pool
from pavejax.optim import promotion_safe
from pavejax.recipes import Recipe

TASKS: tuple[str, ...] = ("movie", "amazon", "nyt", "tweets", "bbc")
METHODS: tuple[str, ...] = ("probe", "lora", "full")
_TRAINED = {"probe": "head", "lora": "lora", "full": "full"}


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Config:
    """What is measured; the defaults are the full mode.

    Attributes:
      tasks: task names, a non-empty subset of ``TASKS``.
      methods: a non-empty subset of ``METHODS``.
      train_size, dev_size, test_size: examples per task (stratified subsamples of the task's
        splits); ``dev_size`` is read by the sweep only.
      seq_len: tokens per example (truncated / padded).
      batch_size: overrides the recipes' minibatch size when set (``--quick``); must not exceed
        ``train_size``.
      eval_batch: batch size of feature extraction and evaluation (padded to fixed shape).
      seed: seed of the splits, the head and LoRA initialisation, and the batch order.
    """

    tasks: tuple[str, ...] = TASKS
    methods: tuple[str, ...] = METHODS
    train_size: int = 1024
    dev_size: int = 512
    test_size: int = 512
    seq_len: int = 64
    batch_size: int | None = None
    eval_batch: int = 128
    seed: int = 0

    def __post_init__(self):
        for name, allowed in (("tasks", TASKS), ("methods", METHODS)):
            value = getattr(self, name)
            value = (value,) if isinstance(value, str) else tuple(value)
            unknown = [t for t in value if t not in allowed]
            if not value or unknown:
                raise ValueError(f"{name} must be a non-empty subset of {allowed}, "
                                 f"got {getattr(self, name)!r}.")
            object.__setattr__(self, name, value)
        for name in ("train_size", "dev_size", "test_size", "eval_batch"):
            _positive_int(name, getattr(self, name))
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ValueError(f"seq_len must be an int >= 2 (room for [CLS] and [SEP]), "
                             f"got {self.seq_len!r}.")
        if self.batch_size is not None:
            _positive_int("batch_size", self.batch_size)
            if self.batch_size > self.train_size:
                raise ValueError(f"batch_size {self.batch_size} exceeds train_size "
                                 f"{self.train_size}; lower batch_size or raise train_size.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}.")

    def recipe(self, task: str, method: str,
               table: dict[str, dict[str, Recipe]] | None = None) -> Recipe:
        """The recipe of ``method`` on ``task``: from ``table`` (a sweep's file) or the presets,
        with this config's ``batch_size`` override."""
        trained = _TRAINED[method]
        r = (table[recipes.family_of(task)][trained] if table is not None
             else recipes.tuned(task, trained))
        return r if self.batch_size is None else r.replace(batch_size=self.batch_size)


# The full fine-tuning row runs in full mode only: its two compilations alone take most of the
# two-minute quick budget on 2 CPU cores.
QUICK = Config(methods=("probe", "lora"), train_size=128, dev_size=128, test_size=128,
               seq_len=32, batch_size=16)

# Candidates of the sweep, per method: changes to a base recipe. The base of each method is the
# first candidate; the grid spans the learning rate, the amount of training, the adapted layers,
# whether A trains, and the decay schedule.
_LORA = Recipe("lora", 1e-3, 1e-2, epochs=2, batch_size=32)
_FULL = Recipe("full", 5e-5, 1e-2, epochs=2, batch_size=32)
_HEAD = Recipe("head", 1e-2, 1e-2, epochs=20, batch_size=32)
_ALL = ("query", "key", "value", "attn_out", "ffn_in", "ffn_out")
SWEEP: dict[str, tuple[Recipe, ...]] = {
    "lora": tuple(_LORA.replace(**c) for c in (
        {}, {"learning_rate": 3e-3},
        {"lora_targets": _ALL, "learning_rate": 5e-4}, {"lora_targets": _ALL},
        {"lora_targets": _ALL, "epochs": 3},
    )),
    "full": tuple(_FULL.replace(**c) for c in (
        {}, {"learning_rate": 2e-5}, {"learning_rate": 1e-4},
    )),
    "head": tuple(_HEAD.replace(**c) for c in (
        {}, {"head_learning_rate": 3e-3}, {"head_learning_rate": 3e-2}, {"epochs": 60},
        {"epochs": 60, "head_learning_rate": 3e-3}, {"weight_decay": 0.1},
        {"schedule": "constant", "warmup_fraction": 0.0},
    )),
}
# The sweep's tasks: two sentiment domains of different styles (review snippets, tweets) and
# the topic task; amazon and nyt are not seen by the choice. A candidate costs about a minute
# per task on 2 CPU cores, which bounds the grid.
SWEEP_TASKS: tuple[str, ...] = ("movie", "tweets", "bbc")
QUICK_SWEEP: dict[str, tuple[Recipe, ...]] = {k: v[:2] for k, v in SWEEP.items()}


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


def _accuracy(pred: jax.Array, labels: np.ndarray) -> float:
    return float(np.mean(np.asarray(pred) == labels))


def _order(n: int, recipe: Recipe, seed: int) -> np.ndarray:
    """(steps, batch) int32 indices: one shuffled pass per epoch, remainder dropped."""
    return np.stack([idx for epoch in range(recipe.epochs)
                     for idx in iterate_batches(n, recipe.batch_size, seed + epoch,
                                                drop_last=True)])


@functools.partial(jax.jit, static_argnums=(3, 4))
def _fit_head(x, y, order, num_classes, recipe):
    opt = promotion_safe(recipe.optimizer(order.shape[0]))
    params = {"w": jnp.zeros((x.shape[1], num_classes), jnp.float32),
              "b": jnp.zeros((num_classes,), jnp.float32)}

    def step(carry, idx):
        p, s = carry
        loss, g = jax.value_and_grad(
            lambda p: _xent(x[idx] @ p["w"] + p["b"][None, :], y[idx]))(p)
        updates, s = opt.update(g, s, p)
        return (optax.apply_updates(p, updates), s), loss

    (params, _), losses = jax.lax.scan(step, (params, opt.init(params)), order)
    return params, losses


def fit_head(x: jax.Array, y: jax.Array, num_classes: int, recipe: Recipe,
             seed: int = 0) -> dict[str, jax.Array]:
    """Linear head on features ``x (n, d)`` and labels ``y (n,)`` trained with a ``"head"``
    recipe from zero (one compiled scan). Returns ``{"w": (d, k), "b": (k,), "losses"}``."""
    order = _order(int(x.shape[0]), recipe, seed)
    params, losses = _fit_head(x, y, jnp.asarray(order), num_classes, recipe)
    return {**params, "losses": losses}


@functools.cache
def _encoder_fns(graphdef, recipe: Recipe, total_steps: int):
    """The optimiser and jitted (step, predict) of one model structure and recipe; cached so that
    tasks with the same label space reuse the compiled code."""
    lcfg = lora.LoraConfig(recipe.lora_rank, alpha=recipe.lora_alpha)

    def labels(trainable):
        return {k: jax.tree.map(lambda _: "head" if k == "head" else "body", v)
                for k, v in trainable.items()}

    opt = promotion_safe(recipe.optimizer(total_steps, labels))

    def logits(trainable, frozen, ids, mask):
        p = dict(frozen["params"])
        p["head"] = trainable["head"]
        if recipe.trained == "full":
            p["encoder"] = trainable["body"]
        else:
            a = trainable["A"] if recipe.train_a else frozen["A"]
            p = lora.apply_lora(p, trainable["B"], a, lcfg)
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


def train_encoder(encoder, num_classes: int, train: dict[str, np.ndarray],
                  evals: dict[str, dict[str, np.ndarray]], recipe: Recipe, *, seed: int = 0,
                  eval_batch: int = 128, desc: str = "train") -> dict[str, Any]:
    """Fine-tunes ``recipe.trained`` (``"lora"`` or ``"full"``) plus a head on ``train`` and
    scores every split of ``evals``.

    ``train`` and each eval split: ``input_ids``, ``attention_mask`` ``(n, seq_len)`` int32 and
    ``label`` ``(n,)`` int32. Returns ``{"accuracy": {name: acc}, "steps", "first_loss",
    "last_loss", "body_change"}``: losses are mean cross-entropies of the first and last
    minibatch, in nats; ``body_change`` is the Frobenius norm of the change of the body (the
    LoRA update ``A B`` or the encoder weights).
    """
    if recipe.trained not in ("lora", "full"):
        raise ValueError(f"train_encoder trains LoRA or full weights, got a "
                         f"{recipe.trained!r} recipe; use fit_head on features for a head.")
    model = TextClassifier(encoder, num_classes, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    n = int(train["label"].shape[0])
    order = _order(n, recipe, seed)
    opt, step, predict = _encoder_fns(graphdef, recipe, order.shape[0])
    head = jax.tree.map(jnp.copy, params["head"])
    if recipe.trained == "full":
        trainable = {"body": jax.tree.map(jnp.copy, params["encoder"]), "head": head}
        frozen = {"params": params}
    else:
        lcfg = lora.LoraConfig(recipe.lora_rank, alpha=recipe.lora_alpha,
                               init="kaiming_uniform")
        B, A = lora.init_lora(jax.random.key(seed + 1), params, recipe.lora_predicate(), lcfg)
        trainable = {"B": B, "head": head} | ({"A": A} if recipe.train_a else {})
        frozen = {"params": params} | ({} if recipe.train_a else {"A": A})
    opt_state = opt.init(trainable)
    losses = []
    for idx in tqdm(order, desc=desc, leave=False, disable=None):
        batch = {k: jnp.asarray(v[idx]) for k, v in train.items()}
        trainable, opt_state, value = step(trainable, opt_state, frozen, batch)
        losses.append(value)
    accs = {name: _accuracy(_map_padded(functools.partial(predict, trainable, frozen), data,
                                        eval_batch), data["label"])
            for name, data in evals.items()}
    if recipe.trained == "full":
        diffs = jax.tree.map(lambda a, b: a - b, trainable["body"], params["encoder"])
    else:
        a = trainable["A"] if recipe.train_a else frozen["A"]
        diffs = {p: a[p] @ trainable["B"][p] for p in trainable["B"]}
    change = float(jnp.sqrt(sum(jnp.sum(jnp.square(d)) for d in jax.tree.leaves(diffs))))
    return {"accuracy": accs, "steps": int(order.shape[0]), "first_loss": float(losses[0]),
            "last_loss": float(losses[-1]), "body_change": change}


def _row(task, method, k, n_train, test, steps, accuracy, seconds) -> dict[str, Any]:
    majority = float(np.max(np.bincount(test["label"], minlength=k)) / test["label"].shape[0])
    return {"task": task, "method": method, "classes": k, "train_examples": n_train,
            "test_examples": int(test["label"].shape[0]), "steps": steps,
            "accuracy": accuracy, "majority": majority, "seconds": seconds}


def _method(encoder, k, train, evals, recipe, cfg, desc, feats=None):
    """(accuracy per eval split, steps) of one method; ``feats``: cached frozen features
    ``{"train", <eval names>}`` for a head recipe."""
    if recipe.trained == "head":
        head = fit_head(feats["train"], jnp.asarray(train["label"]), k, recipe, cfg.seed)
        accs = {name: _accuracy(jnp.argmax(feats[name] @ head["w"] + head["b"][None, :], -1),
                                data["label"]) for name, data in evals.items()}
        return accs, int(head["losses"].shape[0])
    res = train_encoder(encoder, k, train, evals, recipe, seed=cfg.seed,
                        eval_batch=cfg.eval_batch, desc=desc)
    return res["accuracy"], res["steps"]


def _features_of(encoder, splits: dict[str, dict], cfg: Config) -> dict[str, jax.Array]:
    return {name: encoder_features(encoder, data, cfg.eval_batch) for name, data in splits.items()}


def run_task(name: str, encoder, tok, cfg: Config,
             table: dict[str, dict[str, Recipe]] | None = None) -> list[dict[str, Any]]:
    """The rows of ``cfg.methods`` on one task's test split."""
    task = load_task(name, seed=cfg.seed, max_train=cfg.train_size, max_test=cfg.test_size)
    train, test = _encode(tok, task.train), _encode(tok, task.test)
    k, n = task.num_classes, int(train["label"].shape[0])
    rows = []
    for method in cfg.methods:
        recipe = cfg.recipe(name, method, table)
        t0 = time.perf_counter()
        feats = _features_of(encoder, {"train": train, "test": test}, cfg) \
            if method == "probe" else None
        accs, steps = _method(encoder, k, train, {"test": test}, recipe, cfg,
                              f"{method} {name}", feats)
        rows.append(_row(name, method, k, n, test, steps, accs["test"],
                         time.perf_counter() - t0))
    return rows


def run_benchmark(cfg: Config, table: dict[str, dict[str, Recipe]] | None = None
                  ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Rows for every task of ``cfg`` and the summary ``{<method>_<task>, <method>_mean,
    lora_minus_probe_<task>}`` (test accuracies in [0, 1])."""
    encoder, tok = load_minilm(max_length=cfg.seq_len)
    rows: list[dict[str, Any]] = []
    for name in tqdm(cfg.tasks, desc="tasks", disable=None):
        rows += run_task(name, encoder, tok, cfg, table)
    summary = {f"{r['method']}_{r['task']}": r["accuracy"] for r in rows}
    for method in cfg.methods:
        summary[f"{method}_mean"] = float(np.mean([r["accuracy"] for r in rows
                                                   if r["method"] == method]))
    if {"lora", "probe"} <= set(cfg.methods):
        for t in cfg.tasks:
            summary[f"lora_minus_probe_{t}"] = summary[f"lora_{t}"] - summary[f"probe_{t}"]
    return rows, summary


def sweep(cfg: Config, grid: dict[str, Sequence[Recipe]] | None = None
          ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Recipe]], dict[str, Any]]:
    """The recipe choice on the dev splits (module docstring): (rows, chosen, summary).

    ``chosen[family][trained]`` is the best candidate by mean dev accuracy over the family's
    tasks among ``cfg.tasks``; ``summary`` has ``<family>_<trained>_dev`` (its mean dev
    accuracy) and ``<family>_<trained>_candidate`` (its index in the grid).
    """
    grid = SWEEP if grid is None else grid
    encoder, tok = load_minilm(max_length=cfg.seq_len)
    by_family: dict[str, list[str]] = {}
    for t in cfg.tasks:
        by_family.setdefault(recipes.family_of(t), []).append(t)
    rows, scores = [], {}
    for name in tqdm(cfg.tasks, desc="tasks", disable=None):
        task = load_task(name, seed=cfg.seed, max_train=cfg.train_size, max_dev=cfg.dev_size)
        train, dev = _encode(tok, task.train), _encode(tok, task.dev)
        k = task.num_classes
        feats = (_features_of(encoder, {"train": train, "dev": dev}, cfg)
                 if "probe" in cfg.methods else None)
        for method in cfg.methods:
            for i, cand in enumerate(grid[_TRAINED[method]]):
                if cfg.batch_size is not None:
                    cand = cand.replace(batch_size=cfg.batch_size)
                t0 = time.perf_counter()
                accs, steps = _method(encoder, k, train, {"dev": dev}, cand, cfg,
                                      f"{method} {name} #{i}", feats)
                scores.setdefault((recipes.family_of(name), method, i), []).append(accs["dev"])
                rows.append({"family": recipes.family_of(name), "method": method,
                             "candidate": i, "task": name, "steps": steps,
                             "dev_accuracy": accs["dev"], "seconds": time.perf_counter() - t0,
                             "recipe": _describe(cand)})
    chosen: dict[str, dict[str, Recipe]] = {}
    summary: dict[str, Any] = {}
    for fam in by_family:
        for method in cfg.methods:
            means = [float(np.mean(scores[fam, method, i]))
                     for i in range(len(grid[_TRAINED[method]]))]
            best = int(np.argmax(means))
            trained = _TRAINED[method]
            chosen.setdefault(fam, {})[trained] = grid[trained][best].replace(
                source=f"dev-split sweep, candidate {best} of {len(means)}, mean dev accuracy "
                       f"{means[best]:.3f} over {', '.join(by_family[fam])}")
            summary[f"{fam}_{trained}_dev"] = means[best]
            summary[f"{fam}_{trained}_candidate"] = best
    return rows, chosen, summary


def _describe(r: Recipe) -> str:
    """The fields of ``r`` that its method uses, in one short string."""
    parts = [f"head_lr={r.head_learning_rate:g}", f"epochs={r.epochs}", f"batch={r.batch_size}",
             f"wd={r.weight_decay:g}", f"{r.schedule}/warmup={r.warmup_fraction:g}"]
    if r.trained != "head":
        parts.insert(0, f"lr={r.learning_rate:g}")
    if r.trained == "lora":
        parts += [f"r={r.lora_rank}", f"alpha={r.lora_alpha:g}",
                  f"targets={'+'.join(r.lora_targets)}", f"train_a={r.train_a}"]
    return " ".join(parts)


def run(cfg: Config, out: Path | None = None, *, quick: bool = False,
        table: dict[str, dict[str, Recipe]] | None = None) -> dict[str, Any]:
    """Runs the benchmark, prints the table and writes the JSON result to ``out`` if given."""
    rows, summary = run_benchmark(cfg, table)
    config = {"model": "all-MiniLM-L6-v2", "pooling": "mean", "quick": quick,
              **dataclasses.asdict(cfg),
              "recipes": {f"{t}/{m}": cfg.recipe(t, m, table).to_dict()
                          for t in cfg.tasks for m in cfg.methods}}
    config["tasks"], config["methods"] = list(cfg.tasks), list(cfg.methods)
    return _common.emit("tasks_baseline", config, rows, summary, out)


def run_sweep(cfg: Config, out: Path | None, recipes_out: Path, *, quick: bool = False,
              grid: dict[str, Sequence[Recipe]] | None = None) -> dict[str, Any]:
    """Runs the sweep, prints its table, writes the chosen recipes to ``recipes_out`` and the
    JSON result to ``out`` if given."""
    rows, chosen, summary = sweep(cfg, grid)
    recipes.save_recipes(recipes_out, chosen, {"chosen_on": "dev", "config": {
        "train_size": cfg.train_size, "dev_size": cfg.dev_size, "seq_len": cfg.seq_len,
        "tasks": list(cfg.tasks), "seed": cfg.seed}})
    summary["recipes_file"] = str(recipes_out)
    config = {"model": "all-MiniLM-L6-v2", "mode": "sweep", "quick": quick,
              **dataclasses.asdict(cfg)}
    config["tasks"], config["methods"] = list(cfg.tasks), list(cfg.methods)
    return _common.emit("tasks_baseline_sweep", config, rows, summary, out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    def extra(p):
        p.add_argument("--sweep", action="store_true",
                       help="choose the recipes on the dev splits and write them to JSON")
        p.add_argument("--recipes-out", type=Path, default=None,
                       help="where --sweep writes the chosen recipes")
        p.add_argument("--recipes", type=Path, default=None,
                       help="run with the recipes of this file instead of the package presets")
        p.add_argument("--methods", default=None,
                       help="comma-separated subset of probe,lora,full (default: all in full "
                            "mode, probe,lora with --quick)")

    args = _common.parse_args(__doc__.splitlines()[0], argv, extra=extra)
    base = QUICK if args.quick else Config()
    cfg = base if args.methods is None else dataclasses.replace(
        base, methods=tuple(args.methods.split(",")))
    if args.sweep:
        cfg = dataclasses.replace(cfg, tasks=SWEEP_TASKS)
        target = args.recipes_out or (args.out.with_suffix(".recipes.json") if args.out
                                      else Path("tuned_recipes.json"))
        return run_sweep(cfg, args.out, target, quick=args.quick,
                         grid=QUICK_SWEEP if args.quick else None)
    table = recipes.load_recipes(args.recipes) if args.recipes else None
    return run(cfg, args.out, quick=args.quick, table=table)


if __name__ == "__main__":
    main()
