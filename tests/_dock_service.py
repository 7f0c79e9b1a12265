"""Shared pieces of the dock-service tests: tiny DP spec and model releases, and a dock server
started as a real subprocess (``python -m pavejax dock serve``) on a free loopback port."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import threading
from pathlib import Path

import numpy as np

from pavejax.accounting import Ledger
from pavejax.accounting.events import gaussian_step_event
from pavejax.release import ReleaseMetadata, save_release, save_spec
from pavejax.service.loadtest import free_port, local_server, wait_ready  # noqa: F401
from pavejax.spec_types import PaveSpec, SpecSignature

ROOT = Path(__file__).resolve().parents[1]
BACKBONE = "ab" * 32
SIG = SpecSignature("tiny-mlp", BACKBONE, 2, ("l0/kernel", "l1/kernel"), (4, 6), "cd" * 32,
                    "gaussian")
OTHER_SIG = SpecSignature("other-mlp", "ef" * 32, 2, ("l0/kernel", "l1/kernel"), (4, 6),
                          "cd" * 32, "gaussian")
DELTA = 1e-5


def dp_ledger(sigma: float = 6.0, steps: int = 20) -> Ledger:
    """A replace-one ledger of full-batch Gaussian steps (fast to account)."""
    ledger = Ledger("replace_one", accountant="rdp")
    ledger.record(gaussian_step_event(sigma, q=1.0), count=steps, label="dp-s-pave")
    return ledger


def dp_spec(seed: int, sig: SpecSignature = SIG, *, sigma: float = 6.0,
            kind: str = "model") -> PaveSpec:
    """A model-side spec with a real DP guarantee (its ledger's epsilon at DELTA)."""
    ledger = dp_ledger(sigma)
    g = {"kind": "dp", "epsilon": ledger.epsilon(DELTA), "delta": DELTA,
         "relation": "replace_one", "accountant": "rdp"}
    vec = np.random.default_rng(seed).standard_normal(sig.dim).astype(np.float32)
    # the record fields generate_spec writes for plain-SGD full-batch DP-S-PAVE, so the
    # noise-aware scores can read the noise level (lr * sigma * C * sqrt(T) / n)
    config = {"optimizer": "sgd", "l1": 0.0, "learning_rate": 0.1, "steps": 20,
              "batch_size": 64, "layer_scaling": "none",
              "privacy": {"l2_clip": 1.0, "clipping": "joint"}}
    return PaveSpec(vec, sig, kind, {"mechanism": "dp-s-pave", "ledger": ledger.to_dict(),
                                     "guarantee": g, "config": config,
                                     "noise_multiplier": sigma, "num_examples": 64,
                                     "sampling_rate": 1.0})


def spec_release(path: Path, seed: int, **kw) -> Path:
    save_spec(path, dp_spec(seed, **kw))
    return path


def model_release(path: Path, seed: int, *, backbone_hash: str = BACKBONE,
                  classes=("negative", "positive"), name: str = "head") -> Path:
    """A tiny model release (one dense head), DP-trained by its record."""
    rng = np.random.default_rng(1000 + seed)
    tensors = {name: {"kernel": rng.standard_normal((4, len(classes))).astype(np.float32),
                      "bias": np.zeros(len(classes), np.float32)}}
    ledger = dp_ledger(4.0, 10)
    meta = ReleaseMetadata(kind="model", backbone_id="tiny-mlp", backbone_hash=backbone_hash,
                           mechanism="dp-sgd", ledger=ledger,
                           guarantee={"kind": "dp", "epsilon": ledger.epsilon(DELTA),
                                      "delta": DELTA},
                           extra={"classes": list(classes)})
    save_release(path, tensors, meta)
    return path


def cli_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "", **extra}


def serve(dock: Path, *args: str, port: int | None = None):
    """Run ``pavejax dock serve DOCK`` in a subprocess; yields ``(url, process)``."""
    return local_server(dock, *args, port=port, env={"PYTHONPATH": str(ROOT)})


class RecordingProxy:
    """A TCP proxy on a loopback port that forwards to ``target`` and records every byte the
    clients send (``sent``: one bytes object per connection)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.sent: list[bytearray] = []
        self._lock = threading.Lock()
        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port = self._server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            record = bytearray()
            with self._lock:
                self.sent.append(record)
            threading.Thread(target=self._pipe, args=(client, upstream, record),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, None),
                             daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if record is not None:
                    record.extend(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def requests_since(self, start: int) -> list[bytes]:
        with self._lock:
            return [bytes(r) for r in self.sent[start:]]

    def close(self) -> None:
        self._closed = True
        self._server.close()


def spec_fingerprints(vector) -> list[bytes]:
    """Byte strings that would reveal a spec if sent: its raw float32 vector (whole and a
    64-byte window), their base64, and decimal renderings of its first values (JSON list and
    repr, float32 and float64 rounding)."""
    vec = np.asarray(vector, "<f4")
    raw = vec.tobytes()
    return [raw, raw[:64], base64.b64encode(raw), base64.b64encode(raw[:48]),
            json.dumps([float(x) for x in vec[:4]])[1:-1].encode(),
            repr(float(vec[0])).encode(), str(vec[0]).encode()]


def leaked(sent: bytes, vector) -> list[bytes]:
    """The fingerprints of ``vector`` found in ``sent``."""
    return [f for f in spec_fingerprints(vector) if f in sent]
