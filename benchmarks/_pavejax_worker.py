"""pavejax side of ``vs_opacus.py``: a long-lived process that times DP and non-DP steps.

Speaks the protocol of ``_worker_protocol`` (commands ``setup``, ``run``, ``quit``).
The DP step is one jitted function with the trainable buffers donated: per-example gradients
(``pavejax.privacy.clipped_sum``: vmap, joint L2 clipping, optional microbatching, sparse rows
for the word-embedding table), Gaussian noise on the sum (``privatize_sum``), division by the
batch size and an SGD update. The non-DP step is the batched gradient of the mean loss and the
same SGD update.

Settings (the same as the Opacus worker):
  ``lora``: LoRA rank r on every query and value kernel (A frozen, B trained) plus the
    classification head; everything else frozen. The adapters run factored inside the model
    (``pavejax.lora.LoraAdapters``: ``x W + (x A) B``, as Opacus' ``LoraLinear``), so the
    per-example gradient of each B is a rank-r product; ``lora_mode="merged"`` in the setup
    request runs ``apply_lora``'s merged weights instead (for comparison).
  ``full``: every parameter the classifier uses is trained (the unused BERT pooler is frozen,
    as the torch model has none).
"""

from __future__ import annotations

import time
from typing import Any

import _common  # noqa: F401  (puts the source checkout on sys.path)
import _worker_protocol as protocol
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pavejax.lora import LoraAdapters, LoraConfig, apply_lora, init_lora
from pavejax.models import TextClassifier, load_bert
from pavejax.privacy import ClipConfig, clipped_sum, privatize_sum

PyTree = Any
WORD_EMBEDDINGS = "encoder/embeddings/word/embedding"


LORA_MODES = ("factored", "merged")


def lora_paths(num_layers: int) -> dict[str, str]:
    """Shared-file key of each LoRA factor A -> its path in the classifier params."""
    return {f"lora_a_{i}_{proj}": f"encoder/layers/{i}/attention/{proj}/kernel"
            for i in range(num_layers) for proj in ("query", "value")}


def cross_entropy(logits: jax.Array, label: jax.Array) -> jax.Array:
    """Mean cross entropy of (..., K) logits against integer labels (...)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, label[..., None].astype(jnp.int32), axis=-1)
    return -jnp.mean(picked)


def _sgd(params: PyTree, grads: PyTree, lr: float) -> PyTree:
    return jax.tree.map(lambda p, g: p - jnp.asarray(lr, p.dtype) * g, params, grads)


class Setting:
    """Model, trainable/frozen split and loss of one benchmark setting."""

    def __init__(self, request: dict[str, Any]):
        shared = np.load(request["data"])
        encoder, _ = load_bert(request["model_dir"], max_length=int(shared["input_ids"].shape[-1]))
        model = TextClassifier(encoder, 2, rngs=nnx.Rngs(0))
        self.graphdef, state = nnx.split(model)
        params = nnx.to_pure_dict(state)
        params["head"]["dense"]["kernel"] = jnp.asarray(shared["head_kernel"])
        params["head"]["dense"]["bias"] = jnp.asarray(shared["head_bias"])
        pooler = params["encoder"].pop("pooler")  # mean pooling never reads it
        self.setting = request["setting"]
        if self.setting == "lora":
            self.lora = LoraConfig(rank=int(request["rank"]))
            self.lora_mode = request.get("lora_mode", "factored")
            if self.lora_mode not in LORA_MODES:
                raise ValueError(f"lora_mode must be one of {LORA_MODES}, got {self.lora_mode!r}")
            names = lora_paths(encoder.config.num_layers)
            wanted = set(names.values())
            b, a = init_lora(jax.random.key(0), params,
                             lambda path, leaf: path in wanted, self.lora)
            for key, path in names.items():
                a[path] = jnp.asarray(shared[key])
            self.trainable = {"B": b, "head": params["head"]}
            self.frozen = {"encoder": params["encoder"], "A": a, "pooler": pooler}
            sparse = ()
        elif self.setting == "full":
            self.trainable = params
            self.frozen = {"pooler": pooler}
            sparse = {WORD_EMBEDDINGS: "input_ids"}
        else:
            raise ValueError(f"setting must be 'lora' or 'full', got {self.setting!r}")
        method = request.get("method", "vmap")
        self.clip = ClipConfig(float(request["clip"]), sparse_rows=sparse if method == "vmap"
                               else (), method=method)
        self.microbatch = request.get("microbatch")
        self.batches = [
            {"input_ids": jnp.asarray(shared["input_ids"][i]),
             "attention_mask": jnp.asarray(shared["attention_mask"][i]),
             "label": jnp.asarray(shared["labels"][i])}
            for i in range(shared["input_ids"].shape[0])
        ]

    def params(self, trainable: PyTree, frozen: PyTree) -> PyTree:
        """The full pure-dict parameters of the classifier (LoRA merged only if so asked)."""
        if self.setting == "lora":
            params = {"encoder": frozen["encoder"], "head": trainable["head"]}
            if self.lora_mode == "merged":
                params = apply_lora(params, trainable["B"], frozen["A"], self.lora)
        else:
            params = {"encoder": trainable["encoder"], "head": trainable["head"]}
        return {"encoder": {**params["encoder"], "pooler": frozen["pooler"]},
                "head": params["head"]}

    def loss(self, trainable: PyTree, frozen: PyTree, batch: dict[str, jax.Array]) -> jax.Array:
        """Mean loss; ``batch`` leaves are (B, T)/(B,) or a single example (T,)/()."""
        model = nnx.merge(self.graphdef, self.params(trainable, frozen))
        lora = None
        if self.setting == "lora" and self.lora_mode == "factored":
            lora = LoraAdapters(trainable["B"], frozen["A"], self.lora)
        logits = model(batch["input_ids"], batch["attention_mask"], lora=lora)
        return cross_entropy(logits, batch["label"])


def make_steps(s: Setting, lr: float, noise_multiplier: float):
    """(dp_step, nondp_step), both jitted with the trainable buffers donated."""
    batch_size = int(s.batches[0]["label"].shape[0])
    sensitivity = s.clip.sensitivity(len(jax.tree.leaves(s.trainable)))

    def dp_step(trainable, frozen, batch, key):
        r = clipped_sum(s.loss, trainable, frozen, batch, None, s.clip,
                        microbatch_size=s.microbatch)
        grad = privatize_sum(r.grad_sum, key, noise_multiplier=noise_multiplier,
                             sensitivity=sensitivity, expected_batch_size=batch_size)
        return _sgd(trainable, grad, lr), r.losses, r.norms

    def nondp_step(trainable, frozen, batch):
        loss, grad = jax.value_and_grad(s.loss)(trainable, frozen, batch)
        return _sgd(trainable, grad, lr), loss

    return jax.jit(dp_step, donate_argnums=0), jax.jit(nondp_step, donate_argnums=0)


def _memory(compiled) -> dict[str, int] | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    return {"temp_bytes": int(m.temp_size_in_bytes),
            "argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes),
            "alias_bytes": int(m.alias_size_in_bytes)}


class Worker:
    """Holds the current trainable state; each step replaces it (donated buffers)."""

    def __init__(self):
        self.s: Setting | None = None

    def setup(self, request: dict[str, Any]) -> dict[str, Any]:
        """Loads the model and compiles both steps ahead of time (compile time reported)."""
        t0 = time.perf_counter()
        s = self.s = Setting(request)
        dp, nondp = make_steps(s, float(request["lr"]), float(request["noise_multiplier"]))
        self.trainable = s.trainable
        self.key = jax.random.key(int(request.get("seed", 0)))
        batch = s.batches[0]
        load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.dp_step = dp.lower(self.trainable, s.frozen, batch, self.key).compile()
        t2 = time.perf_counter()
        self.nondp_step = nondp.lower(self.trainable, s.frozen, batch).compile()
        t3 = time.perf_counter()
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.trainable))
        return {"trainable_params": n, "load_s": load_s, "compile_dp_s": t2 - t1,
                "compile_nondp_s": t3 - t2, "rss_mib": protocol.current_rss_mib(),
                "xla_memory": {"dp": _memory(self.dp_step), "nondp": _memory(self.nondp_step)},
                "framework": f"jax {jax.__version__} ({jax.default_backend()})"}

    def _dp(self, i: int) -> None:
        batch = self.s.batches[i % len(self.s.batches)]
        key = jax.random.fold_in(self.key, i)
        self.trainable, losses, norms = self.dp_step(self.trainable, self.s.frozen, batch, key)
        jax.block_until_ready(self.trainable)
        self.last = (losses, norms)

    def _nondp(self, i: int) -> None:
        batch = self.s.batches[i % len(self.s.batches)]
        self.trainable, _ = self.nondp_step(self.trainable, self.s.frozen, batch)
        jax.block_until_ready(self.trainable)

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        step = self._dp if request["mode"] == "dp" else self._nondp
        if request.get("report_first"):
            # The first step of the chunk at the current parameters, for the parity check.
            out = protocol.timed_chunk(step, int(request["first"]), 1)
            losses, norms = (np.asarray(x).tolist() for x in self.last)
            rest = protocol.timed_chunk(step, int(request["first"]) + 1,
                                        int(request["steps"]) - 1)
            out["times"] += rest["times"]
            out["peak_rss_mib"] = max(out["peak_rss_mib"], rest["peak_rss_mib"])
            return {**out, "first_losses": losses, "first_norms": norms}
        return protocol.timed_chunk(step, int(request["first"]), int(request["steps"]))


def main() -> None:
    w = Worker()
    protocol.serve({"setup": w.setup, "run": w.run})


if __name__ == "__main__":
    main()
