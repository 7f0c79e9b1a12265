"""pavejax vs Opacus 1.6 (PyTorch, CPU): DP-SGD step time and peak memory on MiniLM.

Same work on both sides: all-MiniLM-L6-v2 (real weights, one ``model.safetensors``) with mean
pooling and a 2-way linear head, batches of 32 real movie-review sentences tokenized to 64
tokens by the pavejax tokenizer (the same token ids go to both frameworks), per-example gradients
of every trainable parameter clipped jointly to L2 norm 1, Gaussian noise with multiplier 1 on
the sum, division by the batch size, one SGD step. Two settings:

  ``lora``  LoRA r=8 on every query and value projection (B trained, A frozen) + the head;
            Opacus with ``grad_sample_mode="hooks"``; pavejax with the adapters applied
            factored inside the model (``pavejax.lora.LoraAdapters``: ``x W + (x A) B``, the
            same computation as Opacus' ``LoraLinear``; merging ``W + A B`` instead costs a
            dense ``d_in x d_out`` cotangent per example and adapted kernel, about 10% slower).
  ``full``  every parameter trained (22.6M; the BERT pooler is unused by mean pooling and left
            out on both sides); Opacus with ghost clipping (``grad_sample_mode="ghost"``);
            pavejax with ghost clipping too (``ClipConfig(method="ghost")``: book-keeping, the
            per-example norms from activations and output gradients, the word-embedding table
            through the rows each example touches, microbatches of 8); ``--method-full vmap``
            gives the materialised path with ``sparse_rows`` and microbatches of 4 instead.

Each framework runs in its own long-lived worker process (``_pavejax_worker.py``,
``_opacus_worker.py``); the driver alternates them chunk by chunk, so machine load drifts hit
both alike. Reported per framework, setting and mode: the median step time over the timed steps
(after warm-up; jax compiles ahead of time during setup, reported separately) and the peak RSS
of the worker process during those steps (the same measure for both frameworks); for pavejax
also XLA's own temp/argument bytes of the compiled DP step. Before timing, the first DP step of
each side runs at the same initial parameters and the per-example losses and gradient norms
are compared (``parity_*`` in the summary): both sides compute the same quantities.

Summary: ``lora_dp_speedup`` and ``full_dp_speedup`` (Opacus DP step time / pavejax DP step
time; > 1 means pavejax is faster), ``full_dp_mem_ratio`` (pavejax peak RSS / Opacus peak RSS
during full fine-tuning DP steps; < 1 means pavejax uses less), their LoRA/non-DP companions,
and each framework's DP overhead (DP / non-DP step time). The non-DP steps are the plain
whole-batch gradient on both sides; on CPU, XLA runs the whole-batch gradient of this model more
slowly than the microbatched per-example one, so pavejax's overhead can come out below 1.

Needs the ``peers`` extra (torch, opacus): ``pip install -e ".[peers]"``.

``--quick`` keeps the work (MiniLM, 32 x 64 tokens) and only cuts the steps: 1 warm-up DP step
(the parity step) and 2 timed steps per framework, setting and mode; it takes about 2 minutes on
an idle 2-core machine (2.8 CPU-minutes, a fifth of it XLA compiling the full fine-tuning DP
step) and twice that on a loaded one. Full mode: 3 warm-up + 12 timed DP steps (2 + 12 non-DP)
per side and setting, in 4 alternating rounds (about 5 minutes on an idle 2-core machine).

Sharp edge: PyTorch's OpenMP threads slow down far more than XLA's thread pool when other
processes compete for the cores (measured: torch's non-DP step 1.4 s idle, 5 s beside one busy
process), so on a loaded machine the ratios favour pavejax. ``load_avg_1m_*`` in the summary
record the load; trust runs whose load stays near the core count (the benchmark itself).

Measured (full mode, one run on an otherwise idle 2-core CPU, load median 1.65; pavejax's full
fine-tuning through ghost clipping in microbatches of 8): ``full_dp_speedup`` 1.42,
``full_dp_mem_ratio`` 0.77, ``lora_dp_speedup`` 1.08 (earlier, with the vmap path and
microbatches of 4: 1.21, 0.90 and 0.98-1.04 in two runs). The LoRA
DP step is bound by dense matmuls on both sides (about 90 GFLOP of forward and input-gradient
products per step, run at about 100 GFLOP/s by XLA's and by PyTorch's kernels alike; per-example
work is a few percent), so the two are at parity there and single runs scatter by +-5%.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import emit, parse_args

HERE = Path(__file__).resolve().parent
FRAMEWORKS = ("pavejax", "opacus")
SETTINGS = ("lora", "full")
MODES = ("dp", "nondp")
PEERS = ("torch", "opacus")
INSTALL_HINT = 'pip install -e ".[peers]"'


@dataclasses.dataclass(frozen=True)
class Config:
    """What is measured; the defaults are the full mode."""

    batch_size: int = 32
    seq_len: int = 64
    rank: int = 8
    noise_multiplier: float = 1.0
    clip: float = 1.0
    lr: float = 0.01
    num_batches: int = 4
    warmup_dp: int = 3
    warmup_nondp: int = 2
    rounds: int = 4
    steps_per_round: int = 3
    # Examples per vmapped chunk on the pavejax side: smaller chunks keep fewer per-example
    # gradients and activations alive and, on CPU, run faster or as fast (measured step time:
    # factored LoRA 4 and 8 within 2%, 32 about 40% slower; full 4 and 8 within 3%, 2 and 1
    # slower).
    microbatch_full: int | None = 8
    microbatch_lora: int | None = 4
    # How pavejax computes per-example norms and the clipped sum (pavejax.privacy.ClipConfig
    # method): full fine-tuning uses ghost clipping with book-keeping (one backward pass, no
    # per-example gradients) in microbatches of 8: XLA temp of the DP step on MiniLM, batch
    # 32 x 64, 714 / 423 / 269 MiB for the whole batch / 16 / 8, at DP / non-DP time 1.26 /
    # 1.24 / 1.22 (`python benchmarks/dp_overhead.py --settings full_ghost
    # [--ghost-microbatch 16|8]`).
    method_full: str = "ghost"
    method_lora: str = "vmap"
    seed: int = 0

    def __post_init__(self):
        for name in ("batch_size", "seq_len", "rank", "num_batches", "rounds", "steps_per_round"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_nondp < 0:
            raise ValueError(f"warmup_nondp must be >= 0, got {self.warmup_nondp}")
        if self.warmup_dp < 1:
            raise ValueError("warmup_dp must be >= 1: the first DP step is the parity check")
        for name in ("microbatch_full", "microbatch_lora"):
            mb = getattr(self, name)
            if mb is not None and (mb < 1 or self.batch_size % mb):
                raise ValueError(f"{name}={mb} must divide batch_size={self.batch_size}")

    @classmethod
    def quick(cls) -> Config:
        return cls(warmup_dp=1, warmup_nondp=0, rounds=2, steps_per_round=1)

    @property
    def timed_steps(self) -> int:
        return self.rounds * self.steps_per_round


def missing_peers() -> list[str]:
    """The peer frameworks (torch, opacus) that are not importable here."""
    return [name for name in PEERS if importlib.util.find_spec(name) is None]


def require_peers() -> None:
    """Exits with a message naming the install command when torch or opacus is missing."""
    missing = missing_peers()
    if missing:
        raise SystemExit(f"vs_opacus needs {' and '.join(missing)} (the 'peers' extra: "
                         f"torch==2.13.0, opacus==1.6.0); install with: {INSTALL_HINT}")


def write_inputs(path: Path, cfg: Config, model_dir: Path) -> Path:
    """Token batches, the classification head and the LoRA factors A shared by both workers."""
    import numpy as np

    from pavejax.data import load_task
    from pavejax.models import BertConfig, Tokenizer

    config = BertConfig.from_json(model_dir / "config.json")
    tokenizer = Tokenizer.from_file(model_dir / "tokenizer.json", cfg.seq_len,
                                    pad_id=config.pad_token_id)
    hidden, layers = config.hidden_size, config.num_layers
    task = load_task("movie", seed=cfg.seed)
    n = cfg.batch_size * cfg.num_batches
    if len(task.train) < n:
        raise ValueError(f"the movie task has {len(task.train)} training sentences, need {n}")
    tokens = tokenizer(list(task.train.inputs[:n]))
    shape = (cfg.num_batches, cfg.batch_size, cfg.seq_len)
    rng = np.random.default_rng(cfg.seed)
    arrays = {
        "input_ids": tokens.input_ids.reshape(shape),
        "attention_mask": tokens.attention_mask.reshape(shape),
        "labels": np.asarray(task.train.labels[:n], np.int32).reshape(shape[:2]),
        # Flax orientation (in, out); the torch worker transposes.
        "head_kernel": (rng.standard_normal((hidden, 2)) * 0.02).astype(np.float32),
        "head_bias": np.zeros((2,), np.float32),
    }
    for i in range(layers):
        for proj in ("query", "value"):  # N(0, 1/r), as pavejax.lora's "gaussian" init
            a = rng.standard_normal((hidden, cfg.rank)) / np.sqrt(cfg.rank)
            arrays[f"lora_a_{i}_{proj}"] = a.astype(np.float32)
    np.savez(path, **arrays)
    return path


class WorkerProcess:
    """A worker script run as a subprocess; ``call`` sends one command and waits for the reply."""

    def __init__(self, name: str, script: Path, log: Path):
        self.name, self.log_path = name, log
        self._log = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, str(script)], cwd=str(HERE),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, bufsize=1)

    def call(self, cmd: str, **fields: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker died during {cmd!r}:\n{self._tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"the {self.name} worker failed in {cmd!r}: {reply.get('error')}\n"
                               f"{reply.get('traceback', '')}")
        return reply

    def _tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-n:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
            except (RuntimeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _setup_request(setting: str, cfg: Config, data: Path, model_dir: Path) -> dict[str, Any]:
    return {"setting": setting, "data": str(data), "model_dir": str(model_dir),
            "rank": cfg.rank, "clip": cfg.clip, "noise_multiplier": cfg.noise_multiplier,
            "lr": cfg.lr, "seed": cfg.seed,
            "microbatch": cfg.microbatch_full if setting == "full" else cfg.microbatch_lora,
            "method": cfg.method_full if setting == "full" else cfg.method_lora}


def max_relative_diff(a: list[float], b: list[float]) -> float:
    """max_i |a_i - b_i| / max(|b_i|, 1e-12); the parity measure between two frameworks."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need two non-empty lists of equal length, got {len(a)} and {len(b)}")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def run_setting(setting: str, cfg: Config, data: Path, model_dir: Path,
                logs: Path) -> dict[str, Any]:
    """Both workers for one setting: setup, parity step, warm-up, alternating timed rounds."""
    workers = {fw: WorkerProcess(fw, HERE / f"_{fw}_worker.py", logs / f"{fw}-{setting}.log")
               for fw in FRAMEWORKS}
    out: dict[str, Any] = {"setup": {}, "chunks": {}, "first": {}}
    try:
        request = _setup_request(setting, cfg, data, model_dir)
        for fw, w in workers.items():
            out["setup"][fw] = w.call("setup", **request)
            print(f"[{setting}] {fw} ready: {out['setup'][fw]['framework']}", file=sys.stderr)
        counts = {fw: s["trainable_params"] for fw, s in out["setup"].items()}
        if len(set(counts.values())) != 1:
            raise RuntimeError(f"the two sides train different parameter counts: {counts}")
        step = {fw: 0 for fw in FRAMEWORKS}

        def chunk(fw: str, mode: str, steps: int, **extra: Any) -> dict[str, Any]:
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            reply = workers[fw].call("run", mode=mode, steps=steps, first=step[fw], **extra)
            step[fw] += steps
            return {**reply, "load_avg_1m": load}

        for fw in FRAMEWORKS:
            warm = chunk(fw, "dp", cfg.warmup_dp, report_first=True)
            out["first"][fw] = {"losses": warm["first_losses"], "norms": warm["first_norms"]}
            if cfg.warmup_nondp:
                chunk(fw, "nondp", cfg.warmup_nondp)
        for r in range(cfg.rounds):
            for fw in (FRAMEWORKS if r % 2 == 0 else FRAMEWORKS[::-1]):
                for mode in MODES:
                    c = chunk(fw, mode, cfg.steps_per_round)
                    out["chunks"].setdefault(f"{fw}/{mode}", []).append(c)
            print(f"[{setting}] round {r + 1}/{cfg.rounds} done", file=sys.stderr)
    finally:
        for w in workers.values():
            w.close()
    return out


def summarize(results: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows (one per setting, framework and mode) and the summary ratios.

    ``results[setting]`` is what :func:`run_setting` returns. Step time: median over all timed
    steps of that framework/mode; peak: the largest per-chunk peak RSS.
    """
    rows, summary = [], {}
    per_chunk, loads = True, []
    for setting, res in results.items():
        med, peak = {}, {}
        for fw in FRAMEWORKS:
            setup = res["setup"][fw]
            for mode in MODES:
                chunks = res["chunks"][f"{fw}/{mode}"]
                times = [t for c in chunks for t in c["times"]]
                med[fw, mode] = statistics.median(times)
                loads += [c["load_avg_1m"] for c in chunks if "load_avg_1m" in c]
                peak[fw, mode] = max(c["peak_rss_mib"] for c in chunks)
                per_chunk &= all(c["peak_is_chunk"] for c in chunks)
                xla = (setup.get("xla_memory") or {}).get(mode) or {}
                rows.append({
                    "setting": setting, "framework": fw, "mode": mode,
                    "median_step_s": med[fw, mode], "min_step_s": min(times),
                    "max_step_s": max(times), "timed_steps": len(times),
                    "peak_rss_mib": peak[fw, mode],
                    "rss_before_mib": min(c["rss_before_mib"] for c in chunks),
                    "xla_temp_mib": xla["temp_bytes"] / 2**20 if xla else "",
                    "xla_args_mib": xla["argument_bytes"] / 2**20 if xla else "",
                    "trainable_params": setup["trainable_params"],
                    "compile_s": setup.get(f"compile_{mode}_s", 0.0),
                })
        for mode in MODES:
            summary[f"{setting}_{mode}_speedup"] = med["opacus", mode] / med["pavejax", mode]
            summary[f"{setting}_{mode}_mem_ratio"] = peak["pavejax", mode] / peak["opacus", mode]
        for fw in FRAMEWORKS:
            summary[f"{setting}_{fw}_dp_overhead"] = med[fw, "dp"] / med[fw, "nondp"]
        first = res["first"]
        summary[f"{setting}_parity_loss_rel"] = max_relative_diff(
            first["pavejax"]["losses"], first["opacus"]["losses"])
        summary[f"{setting}_parity_norm_rel"] = max_relative_diff(
            first["pavejax"]["norms"], first["opacus"]["norms"])
    # False where the kernel refused to reset the peak: peaks then include loading/compiling.
    summary["peak_rss_is_per_chunk"] = per_chunk
    if loads:
        # 1-minute load average before each timed chunk (the running worker adds about the
        # core count itself): far above it means other work shared the cores.
        summary["load_avg_1m_median"] = statistics.median(loads)
        summary["load_avg_1m_max"] = max(loads)
    return rows, summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    def extra(p):
        p.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
        p.add_argument("--method-full", choices=("ghost", "ghost_two_pass", "vmap"),
                       default="ghost", help="pavejax's per-example method for full "
                       "fine-tuning (vmap: materialised, microbatches of 4, sparse_rows)")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    require_peers()
    from pavejax import assets

    cfg = Config.quick() if args.quick else Config()
    if args.method_full != cfg.method_full:
        cfg = dataclasses.replace(cfg, method_full=args.method_full,
                                  microbatch_full=4 if args.method_full == "vmap" else 8)
    model_dir = assets.require("minilm")
    with tempfile.TemporaryDirectory(prefix="vs_opacus_") as tmp:
        tmp_path = Path(tmp)
        data = write_inputs(tmp_path / "inputs.npz", cfg, model_dir)
        results = {s: run_setting(s, cfg, data, model_dir, tmp_path) for s in args.settings}
    rows, summary = summarize(results)
    setup = {s: {fw: {k: v for k, v in r["setup"][fw].items() if k != "ok"}
                 for fw in FRAMEWORKS} for s, r in results.items()}
    config = {**dataclasses.asdict(cfg), "quick": args.quick, "settings": args.settings,
              "timed_steps": cfg.timed_steps, "task": "movie", "model": "all-MiniLM-L6-v2",
              "workers": setup}
    return emit("vs_opacus", config, rows, summary, args.out)


if __name__ == "__main__":
    main()
