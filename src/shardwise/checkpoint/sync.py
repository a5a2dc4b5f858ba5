"""Errors that every rank raises together: a check failing on one rank must not hang the rest."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from ..engine.comm import collectives as C
from ..engine.core.context import ModelGroup
from .manifest import CheckpointError, CheckpointNotFoundError

_KINDS: dict[str, type[Exception]] = {"ValueError": ValueError, "RuntimeError": RuntimeError,
                                      "CheckpointNotFoundError": CheckpointNotFoundError}


def agree(err: BaseException | None, cleanup: Callable[[], None] | None = None,
          group: ModelGroup | None = None) -> None:
    """Raise on every rank if any rank has an error: its own, else the first rank's message.

    Every rank of `group` (the model's ranks, [Note: model ranks]; None: the world) must call
    it at the same point (it is one all-reduce, plus an all-gather of the messages when
    something failed). `cleanup` runs on every rank before the raise.
    """
    group = group if group is not None else ModelGroup.world()
    if group.agree(err is None):
        return
    if cleanup is not None:
        cleanup()
    if not C.is_initialized() or group.size == 1:
        assert err is not None
        raise err
    mine = f"{type(err).__name__}\n{err}".encode() if err is not None else b""
    msgs = group.all_gather_bytes(mine)
    if err is not None:
        raise err
    r, msg = next((r, m.decode()) for r, m in zip(group.ranks, msgs) if m)
    kind, _, text = msg.partition("\n")
    raise _KINDS.get(kind, CheckpointError)(f"{text} (raised on rank {r})")


@contextlib.contextmanager
def agreed(convert: Callable[[Exception], BaseException] | None = None,
           cleanup: Callable[[], None] | None = None,
           group: ModelGroup | None = None) -> Iterator[None]:
    """Run the block, then `agree` on its outcome: every rank leaves the block normally, or
    every rank raises. Every rank of `group` (None: the world) must enter it (a rank with
    nothing to do runs an empty block). `convert` maps this rank's exception first (e.g.
    `as_error`)."""
    err: BaseException | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
        err = convert(e) if convert is not None else e
    agree(err, cleanup, group)


def as_error(e: BaseException) -> BaseException:
    """I/O failures become CheckpointError (str(e) names the file); the rest stay as they are."""
    if isinstance(e, OSError):
        return CheckpointError(str(e))
    return e
