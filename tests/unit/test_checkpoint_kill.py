"""SIGKILL a job at random moments while it saves checkpoints back to back, many times.

After every kill the checkpoint must load, as exactly one version: the last one the job
reported saved, or the one it was saving when it died. Rounds alternate 1 and 2 ranks (both
ranks are killed, in random order). Children fork from a forkserver that has torch loaded,
so a round costs a fraction of a second.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import signal
import time

import shardwise as sw
from shardwise.testing import free_port
from tests.unit import ckpt_kill_child as child

ROUNDS = 10


def test_sigkill_during_save_never_leaves_a_bad_checkpoint(tmp_path: object) -> None:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.unit.ckpt_kill_child"])
    path = os.path.join(str(tmp_path), "ckpt")
    model, opt = child.make()
    child.set_version(model, opt, 0)
    sw.save_checkpoint(path, model, opt, step=0, extra={"v": 0})
    warm = ctx.Process(target=child.noop)  # start the forkserver (imports torch) now
    warm.start()
    warm.join()
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    last = waited = 0
    for rnd in range(ROUNDS):
        world = 1 + rnd % 2
        recv, send = ctx.Pipe(duplex=False)
        reported: list[int] = []
        port = free_port()
        procs = [ctx.Process(target=child.saver, daemon=True,
                             args=(path, last + 1, send if r == 0 else None, r, world, port))
                 for r in range(world)]
        try:
            for p in procs:
                p.start()
            send.close()
            # Half the rounds kill during start-up or the first save (which also recovers
            # what the last kill left), half at a random point of a later save.
            if rnd % 4 >= 2 and recv.poll(timeout=60):
                reported.append(recv.recv())
                waited += 1
            time.sleep(rng.uniform(0.0, 0.4))
            for p in rng.sample(procs, len(procs)):
                # A rank whose peer was just killed fails its collective and may be gone
                # (reaped by the forkserver) before its own turn comes.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                time.sleep(rng.uniform(0, 0.02))
        finally:
            for p in procs:
                p.kill()
                p.join()
        while recv.poll():
            try:
                reported.append(recv.recv())
            except EOFError:
                break
        hi = max(reported, default=last)
        model, opt = child.make()
        extra = sw.load_checkpoint(path, model, opt)
        v = extra["v"]
        what = f"seed {seed} round {rnd} (world {world}): reported {reported}, loaded {v}"
        assert v in (hi, hi + 1), what
        assert child.version_of(model, opt) == {float(v)}, what
        last = v
    assert last >= waited > 0, f"seed {seed}: only {last} saves in {ROUNDS} rounds"
    # A clean save afterwards leaves nothing of the crashed ones behind.
    sw.save_checkpoint(path, model, opt, step=last + 1, extra={"v": last + 1})
    assert os.listdir(str(tmp_path)) == ["ckpt"]
