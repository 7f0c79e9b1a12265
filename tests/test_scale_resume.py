"""Kill-and-resume: each private trainer, SIGKILLed in a worker process after its step-3
checkpoint, resumes here and ends bit-identical to an uninterrupted run, with an equal ledger."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from pavejax.checkpointing import TrainCheckpointer
from pavejax.paczero import train as zo_train
from tests import _scale_problems as P

REPO = Path(__file__).resolve().parent.parent
TRAINERS = ("dp-sam", "dp-s-pave", "paczero")
KILL_AFTER = 3
TIMEOUT_S = 300


def _committed_step(directory: Path) -> int | None:
    if not directory.exists():
        return None
    # Orbax renames a finished step directory to its bare number (tmp dirs carry a suffix).
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()]
    return max(steps, default=None)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Starts one worker per trainer, SIGKILLs each once step KILL_AFTER is committed."""
    root = tmp_path_factory.mktemp("killed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    logs = {t: open(root / f"{t}.log", "wb") for t in TRAINERS}  # noqa: SIM115
    procs = {t: subprocess.Popen([sys.executable, "-m", "tests._scale_problems", t,
                                  str(root / t)], cwd=REPO, env=env, stdout=logs[t],
                                 stderr=subprocess.STDOUT)
             for t in TRAINERS}

    def tails() -> str:
        return "\n".join(f"--- {t} ---\n" + (root / f"{t}.log").read_text(errors="replace")[-2000:]
                         for t in TRAINERS)

    deadline, result = time.monotonic() + TIMEOUT_S, {}
    try:
        while len(result) < len(procs):
            for t, p in procs.items():
                if t in result:
                    continue
                step = _committed_step(root / t)
                if step is not None and step >= KILL_AFTER:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
                    result[t] = (root / t, p.returncode)
                elif p.poll() is not None:
                    pytest.fail(f"{t} worker exited ({p.returncode}) before step {KILL_AFTER}:\n"
                                + tails())
            if time.monotonic() > deadline:
                pytest.fail(f"workers did not reach step {KILL_AFTER} in {TIMEOUT_S} s:\n"
                            + tails())
            time.sleep(0.02)
    finally:
        for t, p in procs.items():
            if p.poll() is None:
                p.kill()
                p.wait()
            logs[t].close()
    return result


def _same_bits(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and
        np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))


def _killed_midway(killed, trainer: str) -> Path:
    directory, returncode = killed[trainer]
    assert returncode == -signal.SIGKILL
    step = _committed_step(directory)
    assert KILL_AFTER <= step < P.STEPS, step  # killed after step 3 and before the end
    return directory


def test_dp_sam_resumes_bit_identical(killed):
    directory = _killed_midway(killed, "dp-sam")
    whole = P.run_sam()
    with TrainCheckpointer(directory) as ckpt:
        resumed = P.run_sam(checkpointer=ckpt)
        assert ckpt.latest_step() == P.STEPS
    assert _same_bits(resumed.params, whole.params)
    assert resumed.ledger == whole.ledger
    assert sum(e.count for e in resumed.ledger.entries) == P.STEPS
    assert resumed.losses == whole.losses


def test_dp_s_pave_resumes_bit_identical(killed):
    directory = _killed_midway(killed, "dp-s-pave")
    whole = P.run_spec()
    with TrainCheckpointer(directory) as ckpt:
        # no noise_key: the resumed run must take the killed run's key from its checkpoint
        resumed = P.run_spec(checkpointer=ckpt, noise_key=None)
    assert resumed.spec.vector.tobytes() == whole.spec.vector.tobytes()
    assert _same_bits(resumed.B, whole.B)
    assert resumed.ledger == whole.ledger  # one entry of count STEPS, resumed or not
    assert [e.count for e in resumed.ledger.entries] == [P.STEPS]
    assert resumed.spec.info["guarantee"] == whole.spec.info["guarantee"]
    np.testing.assert_array_equal(resumed.losses, whole.losses)


def test_paczero_resumes_bit_identical(killed):
    directory = _killed_midway(killed, "paczero")
    cfg = P.zo_config()
    whole = zo_train(cfg, P.zo_loss, P.zo_init(cfg), None, P.zo_pool(), dev_fn=P.zo_dev)
    # A template with another secret key (as an OS-seeded restart would draw): only the
    # checkpoint's secret key and index can lead to the killed run's result.
    fresh = P.zo_init(cfg, secret=7)
    assert int(fresh.secret) != int(whole.state.secret)
    with TrainCheckpointer(directory) as ckpt:
        done = zo_train(cfg, P.zo_loss, fresh, None, P.zo_pool(), dev_fn=P.zo_dev,
                        checkpointer=ckpt)
        assert ckpt.latest_step() == P.STEPS
    assert done.step == whole.step == P.STEPS
    assert _same_bits(done.trainable, whole.trainable) and _same_bits(done.best, whole.best)
    assert done.best_step == whole.best_step and done.best_dev == whole.best_dev
    assert int(done.state.secret) == int(whole.state.secret)
    assert _same_bits(jax.random.key_data(done.state.secret_key),
                      jax.random.key_data(whole.state.secret_key))
    np.testing.assert_array_equal(done.state.membership, whole.state.membership)
    assert done.host.log_posterior.tobytes() == whole.host.log_posterior.tobytes()
    assert done.mi_used == whole.mi_used
    assert (int(done.state.unanimous), int(done.state.releases)) == \
        (int(whole.state.unanimous), int(whole.state.releases))
    assert done.ledger == whole.ledger
    assert done.ledger.mutual_information() > 0  # the MI mechanism did spend
