"""Opacus 1.6 side of ``vs_opacus.py``: a long-lived PyTorch (CPU) process that times steps.

Speaks the protocol of ``_worker_protocol`` (commands ``setup``, ``run``, ``quit``). It imports
neither jax nor pavejax: the model is a minimal BERT written here (``nn.Embedding``,
``nn.Linear``, ``nn.LayerNorm``, exact GELU, masked mean pooling, a 2-way linear head) and is
filled from the same ``model.safetensors`` as the pavejax model; the classification head, the
LoRA factors A and the token batches come from the driver's shared ``.npz`` file.

Opacus is used as its documentation recommends for each setting:
  ``lora``: ``grad_sample_mode="hooks"`` (per-sample gradients of the small LoRA factors and
    the head are materialised, which is cheapest for rank-r adapters);
  ``full``: ``grad_sample_mode="ghost"`` (Fast Gradient Clipping with ghost norms; the returned
    wrapped criterion runs the two backward passes).
Both with ``noise_multiplier``, ``max_grad_norm``, flat (joint) clipping, ``loss_reduction="mean"``
and plain SGD. The batch is fixed-size (no Poisson sampling), as on the pavejax side. The
non-private step runs the same module with Opacus' hooks disabled and the plain SGD optimizer.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import _worker_protocol as protocol
import numpy as np
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine, __version__ as opacus_version
from safetensors.torch import load_file
from torch import nn

# Opacus registers full backward hooks; with frozen inputs torch warns on every step.
warnings.filterwarnings("ignore", message="Full backward hook is firing")


class LoraLinear(nn.Module):
    """``base(x) + (x A) B`` with frozen base and A, trainable B (scale 1, alpha = rank)."""

    def __init__(self, base: nn.Linear, a: np.ndarray):
        super().__init__()
        d_in, rank = a.shape
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(d_in, rank, bias=False).requires_grad_(False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        with torch.no_grad():
            self.lora_a.weight.copy_(torch.from_numpy(np.ascontiguousarray(a.T)))
            self.lora_b.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class Layer(nn.Module):
    """One post-LN BERT block (attention with fused SDPA kernel, then exact-GELU MLP)."""

    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.output = nn.Linear(intermediate, hidden)
        self.norm = nn.LayerNorm(hidden, eps=eps)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, h: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.query(h)), self._split(self.key(h)), self._split(self.value(h))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        ctx = ctx.transpose(1, 2).reshape(h.shape)
        h = self.attn_norm(h + self.attn_out(ctx))
        return self.norm(h + self.output(F.gelu(self.intermediate(h))))


class BertClassifier(nn.Module):
    """BERT encoder + masked mean pooling + linear head; ``forward(ids, mask) -> (B, 2)``."""

    def __init__(self, cfg: dict[str, Any], num_labels: int = 2):
        super().__init__()
        hidden, eps = cfg["hidden_size"], float(cfg.get("layer_norm_eps", 1e-12))
        self.word = nn.Embedding(cfg["vocab_size"], hidden)
        self.position = nn.Embedding(cfg["max_position_embeddings"], hidden)
        self.token_type = nn.Embedding(cfg.get("type_vocab_size", 2), hidden)
        self.emb_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(
            Layer(hidden, cfg["num_attention_heads"], cfg["intermediate_size"], eps)
            for _ in range(cfg["num_hidden_layers"]))
        self.head = nn.Linear(hidden, num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        # Batch-first position/type ids: Opacus needs a per-sample input for every embedding.
        positions = torch.arange(t, device=input_ids.device).expand(b, t).contiguous()
        h = self.word(input_ids) + self.token_type(torch.zeros_like(input_ids))
        h = self.emb_norm(h + self.position(positions))
        key_mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            h = layer(h, key_mask)
        m = attention_mask.to(h.dtype)[:, :, None]
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return self.head(pooled)


def _hf_names(num_layers: int) -> dict[str, str]:
    """Hugging Face tensor name -> parameter name in ``BertClassifier``."""
    names = {"embeddings.word_embeddings.weight": "word.weight",
             "embeddings.position_embeddings.weight": "position.weight",
             "embeddings.token_type_embeddings.weight": "token_type.weight",
             "embeddings.LayerNorm.weight": "emb_norm.weight",
             "embeddings.LayerNorm.bias": "emb_norm.bias"}
    ours = {"attention.self.query": "query", "attention.self.key": "key",
            "attention.self.value": "value", "attention.output.dense": "attn_out",
            "attention.output.LayerNorm": "attn_norm", "intermediate.dense": "intermediate",
            "output.dense": "output", "output.LayerNorm": "norm"}
    for i in range(num_layers):
        for hf, mine in ours.items():
            for kind in ("weight", "bias"):
                names[f"encoder.layer.{i}.{hf}.{kind}"] = f"layers.{i}.{mine}.{kind}"
    return names


def load_classifier(model_dir: Path, shared: Any) -> BertClassifier:
    """MiniLM weights from ``model.safetensors`` plus the shared head (pooler unused)."""
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    model = BertClassifier(cfg)
    tensors = load_file(str(model_dir / "model.safetensors"))
    state = {mine: tensors[hf] for hf, mine in _hf_names(cfg["num_hidden_layers"]).items()}
    state["head.weight"] = torch.from_numpy(np.ascontiguousarray(shared["head_kernel"].T))
    state["head.bias"] = torch.from_numpy(np.array(shared["head_bias"]))
    model.load_state_dict(state, strict=True)
    return model


def _attach_lora(model: BertClassifier, shared: Any) -> None:
    model.requires_grad_(False)
    for i, layer in enumerate(model.layers):
        for proj in ("query", "value"):
            setattr(layer, proj, LoraLinear(getattr(layer, proj), shared[f"lora_a_{i}_{proj}"]))
    model.head.requires_grad_(True)


class Worker:
    """One Opacus-wrapped model; ``run`` times DP (wrapped) or non-DP (hooks off) steps."""

    def setup(self, request: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        torch.manual_seed(int(request.get("seed", 0)))
        shared = np.load(request["data"])
        model = load_classifier(Path(request["model_dir"]), shared)
        self.setting = request["setting"]
        if self.setting == "lora":
            _attach_lora(model, shared)
            mode = "hooks"
        elif self.setting == "full":
            mode = "ghost"
        else:
            raise ValueError(f"setting must be 'lora' or 'full', got {self.setting!r}")
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        self.batches = [
            (torch.from_numpy(shared["input_ids"][i].astype(np.int64)),
             torch.from_numpy(shared["attention_mask"][i].astype(np.int64)),
             torch.from_numpy(shared["labels"][i].astype(np.int64)))
            for i in range(shared["input_ids"].shape[0])
        ]
        batch_size = int(shared["labels"].shape[1])
        # The loader only tells Opacus the sampling rate (= batch/dataset) for its accountant;
        # steps are fed the shared fixed-size batches directly.
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.arange(batch_size * len(self.batches))),
            batch_size=batch_size)
        self.plain_sgd = torch.optim.SGD(params, lr=float(request["lr"]))
        self.criterion = nn.CrossEntropyLoss()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "secure RNG off" and similar advisories
            made = PrivacyEngine(accountant="rdp").make_private(
                module=model, optimizer=self.plain_sgd, criterion=self.criterion,
                data_loader=loader, noise_multiplier=float(request["noise_multiplier"]),
                max_grad_norm=float(request["clip"]), poisson_sampling=False,
                clipping="flat", loss_reduction="mean", grad_sample_mode=mode)
        if mode == "ghost":
            self.module, self.dp_optimizer, self.dp_criterion, _ = made
        else:
            self.module, self.dp_optimizer, _ = made
            self.dp_criterion = self.criterion
        self.mode = mode
        return {"trainable_params": sum(p.numel() for p in params),
                "load_s": time.perf_counter() - t0, "compile_dp_s": 0.0, "compile_nondp_s": 0.0,
                "rss_mib": protocol.current_rss_mib(), "grad_sample_mode": mode,
                "framework": f"torch {torch.__version__}, opacus {opacus_version} "
                             f"({torch.get_num_threads()} threads)"}

    def _per_sample_norms(self) -> torch.Tensor:
        if self.mode == "ghost":
            return self.module.per_sample_gradient_norms
        norms = [p.grad_sample.reshape(len(p.grad_sample), -1).norm(2, dim=-1)
                 for p in self.dp_optimizer.params]
        return torch.stack(norms, dim=1).norm(2, dim=1)

    def _dp(self, i: int, record: bool = False) -> None:
        ids, mask, labels = self.batches[i % len(self.batches)]
        self.dp_optimizer.zero_grad(set_to_none=True)
        logits = self.module(ids, mask)
        loss = self.dp_criterion(logits, labels)
        loss.backward()
        if record:
            with torch.no_grad():
                losses = F.cross_entropy(logits, labels, reduction="none")
            self.last = (losses.tolist(), self._per_sample_norms().tolist())
        self.dp_optimizer.step()

    def _nondp(self, i: int) -> None:
        ids, mask, labels = self.batches[i % len(self.batches)]
        self.module.disable_hooks()
        try:
            self.plain_sgd.zero_grad(set_to_none=True)
            self.criterion(self.module(ids, mask), labels).backward()
            self.plain_sgd.step()
        finally:
            self.module.enable_hooks()

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        first, steps = int(request["first"]), int(request["steps"])
        if request["mode"] != "dp":
            return protocol.timed_chunk(self._nondp, first, steps)
        if not request.get("report_first"):
            return protocol.timed_chunk(self._dp, first, steps)
        out = protocol.timed_chunk(lambda i: self._dp(i, record=True), first, 1)
        rest = protocol.timed_chunk(self._dp, first + 1, steps - 1)
        out["times"] += rest["times"]
        out["peak_rss_mib"] = max(out["peak_rss_mib"], rest["peak_rss_mib"])
        return {**out, "first_losses": self.last[0], "first_norms": self.last[1]}


def main() -> None:
    w = Worker()
    protocol.serve({"setup": w.setup, "run": w.run})


if __name__ == "__main__":
    main()
