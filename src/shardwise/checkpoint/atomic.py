"""Publishing a checkpoint directory atomically, and finding the last complete one.

[Note: atomic publish] Three names next to each other:

    TARGET            the published checkpoint
    TARGET.partial    the save in progress: every rank writes and fsyncs its file here,
                      then rank 0 writes manifest.json last
    TARGET.previous   the old checkpoint, moved aside only between the two renames below

Rank 0 publishes, after a barrier that follows every rank's fsync:

    1. rename TARGET -> TARGET.previous   (when TARGET exists)
    2. rename TARGET.partial -> TARGET; fsync the parent directory
    3. delete TARGET.previous

A rename is atomic, so a crash (or SIGKILL) at any moment leaves either the old complete
checkpoint (at TARGET, or at TARGET.previous between 1 and 2) or the new complete one at
TARGET; a half-written TARGET.partial is never read. `resolve` (load) falls back to
TARGET.previous when TARGET has no manifest; `prepare` (the next save) first moves it back
and deletes leftovers of a crashed save.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

from .manifest import MANIFEST
from .safetensors_io import fsync_dir

# Tests set this to simulate a crash at a named point of a save (see `crash_point`).
_crash_hook: Callable[[str], None] | None = None


def crash_point(name: str) -> None:
    if _crash_hook is not None:
        _crash_hook(name)


def partial_path(target: str) -> str:
    return target + ".partial"


def previous_path(target: str) -> str:
    return target + ".previous"


def is_complete(ckpt_dir: str) -> bool:
    return os.path.isfile(os.path.join(ckpt_dir, MANIFEST))


def remove(ckpt_dir: str) -> None:
    """Delete a checkpoint directory so that a crash midway never leaves it looking complete.

    The manifest goes first (and durably): without it the rest is a leftover, not a
    checkpoint with missing files.
    """
    try:
        os.unlink(os.path.join(ckpt_dir, MANIFEST))
        fsync_dir(ckpt_dir)
    except FileNotFoundError:
        pass
    shutil.rmtree(ckpt_dir, ignore_errors=True)


def check_target(target: str) -> None:
    """Refuse to replace something that is not a checkpoint (a typo must not delete data)."""
    if not os.path.lexists(target):
        return
    if not os.path.isdir(target):
        raise ValueError(f"save_checkpoint: {target} exists and is not a directory")
    if not is_complete(target) and os.listdir(target):
        raise ValueError(f"save_checkpoint: refusing to replace {target}: it is a non-empty "
                         f"directory without {MANIFEST}, so not a shardwise checkpoint")


def prepare(target: str) -> str:
    """Rank 0, before a save: recover from a crashed save, return an empty partial dir."""
    prev = previous_path(target)
    if is_complete(prev):
        if is_complete(target):
            remove(prev)  # the crash came after the new one was published
        else:
            if os.path.isdir(target) and not os.listdir(target):
                os.rmdir(target)
            if not os.path.lexists(target):
                os.rename(prev, target)  # the crash came between the two renames: undo 1
    check_target(target)
    partial = partial_path(target)
    if os.path.lexists(partial):
        shutil.rmtree(partial)
    os.makedirs(partial)
    return partial


def publish(target: str) -> None:
    """Rank 0, once every file and the manifest are durable in the partial dir."""
    partial, prev = partial_path(target), previous_path(target)
    parent = os.path.dirname(target) or "."
    if os.path.lexists(prev):
        remove(prev)  # incomplete leftovers (prepare keeps complete ones out of the way)
    if os.path.lexists(target):
        os.rename(target, prev)
        crash_point("moved_aside")
    os.rename(partial, target)
    fsync_dir(parent)
    crash_point("published")
    if os.path.lexists(prev):
        remove(prev)


def discard(target: str) -> None:
    """Rank 0, after a failed save: remove the partial dir (the old checkpoint is untouched)."""
    shutil.rmtree(partial_path(target), ignore_errors=True)


def resolve(target: str) -> str:
    """The directory to load for `target`: itself, or the copy a crashed save moved aside."""
    if not is_complete(target) and is_complete(previous_path(target)):
        return previous_path(target)
    return target
