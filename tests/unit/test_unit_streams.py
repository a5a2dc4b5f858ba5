"""Issue 41 part 3, the CUDA-only paths of engine/core/unit.py checked on the CPU with fakes:
the CPU-offload gradient copy rule and hpZ's kept-rows hand-off to the copy-in stream."""

from __future__ import annotations

from typing import Any

from shardwise.engine.core import unit as U


def test_offload_copy_honours_pin_memory_and_blocks_for_readers() -> None:
    # (into pinned memory, without blocking): FSDP2's rule. pin_memory=False was ignored
    # (always pinned); a hooked parameter's copy ran without blocking.
    assert U.offload_copy(pin_memory=True, fresh=True, hooked=False) == (True, True)
    assert U.offload_copy(pin_memory=False, fresh=True, hooked=False) == (False, False)
    assert U.offload_copy(pin_memory=True, fresh=False, hooked=False) == (True, False)
    assert U.offload_copy(pin_memory=True, fresh=True, hooked=True) == (True, False)


class _Stream:
    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, ev: Any) -> None:
        self.waited.append(ev)


class _Rows:
    def __init__(self) -> None:
        self.recorded: list[Any] = []

    def record_stream(self, stream: Any) -> None:
        self.recorded.append(stream)


def test_hpz_kept_rows_are_waited_for_and_kept_alive_by_the_copy_in_stream() -> None:
    # Written on the compute stream after forward, read by copy_in in backward: the reader
    # waits for the write's event, and the rows are recorded on it so that freeing them
    # after the gather cannot hand out their memory before the read ran.
    written, stream, rows = object(), _Stream(), _Rows()
    kept = U.KeptRows([rows], written)  # type: ignore[list-item]
    kept.hand_to(stream, rows)  # type: ignore[arg-type]
    assert stream.waited == [written] and rows.recorded == [stream]


def test_unshard_hands_kept_rows_to_copy_in_before_reading_them() -> None:
    import inspect

    src = inspect.getsource(U.Unit.unshard)
    assert src.index("kept.hand_to(streams.copy_in, rows)") < src.index("shard.copy_(rows")
    assert "written = record(" in inspect.getsource(U.keep)
