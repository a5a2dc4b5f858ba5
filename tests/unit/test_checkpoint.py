"""Checkpoints in one process: round trip, refusal of damaged files by name, crash points,
architecture mismatches, offline export through the CLI."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import shardwise as sw
from shardwise.checkpoint import atomic
from shardwise.commands import export as export_cmd
from tests.models import TinyLM, loss_fn, make_batch, make_model


def trained(seed: int = 0, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model("lm", seed)
    sw.shard_model(model, auto_wrap_policy="transformer")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(steps):
        x, y = make_batch("lm", s, 4)
        loss_fn("lm", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def fresh(seed: int = 5) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model("lm", seed)
    sw.shard_model(model, auto_wrap_policy=None)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = sw.full_state_dict(a), sw.full_state_dict(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture()
def ckpt(tmp_path: object) -> tuple[str, torch.nn.Module, torch.optim.Optimizer]:
    model, opt = trained()
    path = os.path.join(str(tmp_path), "ckpt")
    sw.save_checkpoint(path, model, opt, step=2, extra={"epoch": 1, "pos": [3, 4]})
    return path, model, opt


def test_round_trip_continues_identically(ckpt: tuple) -> None:
    path, model, opt = ckpt
    m2, o2 = fresh()
    assert sw.load_checkpoint(path, m2, o2) == {"epoch": 1, "pos": [3, 4]}
    assert same_params(model, m2)
    assert o2.param_groups[0]["lr"] == 1e-2 and o2.param_groups[0]["betas"] == (0.9, 0.999)
    x, y = make_batch("lm", 7, 4)
    for m, o in ((model, opt), (m2, o2)):
        loss_fn("lm", m(x), y).backward()
        o.step()
    assert same_params(model, m2)
    assert sorted(os.listdir(os.path.dirname(path))) == ["ckpt"]  # no temporaries left


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x55]))


@pytest.mark.parametrize("damage", ["flip_data", "flip_header", "truncate", "delete",
                                    "manifest_edit", "manifest_truncate", "manifest_delete"])
def test_damaged_checkpoint_refused_by_name_model_untouched(ckpt: tuple, damage: str) -> None:
    path, _, _ = ckpt
    data = os.path.join(path, "rank00000.safetensors")
    manifest = os.path.join(path, "manifest.json")
    expect = {"flip_data": "rank00000.safetensors is corrupted",
              "flip_header": "rank00000.safetensors is corrupted",
              "truncate": "rank00000.safetensors is truncated",
              "delete": "rank00000.safetensors is missing",
              "manifest_edit": "manifest.json is corrupted",
              "manifest_truncate": "manifest.json is unreadable or corrupted",
              "manifest_delete": "manifest.json is missing"}[damage]
    if damage == "flip_data":
        _flip(data, -5)
    elif damage == "flip_header":
        _flip(data, 20)
    elif damage == "truncate":
        os.truncate(data, os.path.getsize(data) - 100)
    elif damage == "delete":
        os.unlink(data)
    elif damage == "manifest_edit":
        text = open(manifest).read().replace('"step": 2', '"step": 3')
        open(manifest, "w").write(text)
    elif damage == "manifest_truncate":
        os.truncate(manifest, os.path.getsize(manifest) // 2)
    else:
        os.unlink(manifest)
    m2, o2 = fresh()
    before = sw.full_state_dict(m2)
    with pytest.raises(sw.CheckpointError, match=expect):
        sw.load_checkpoint(path, m2, o2)
    after = sw.full_state_dict(m2)
    assert all(torch.equal(before[k], after[k]) for k in before) and not o2.state


def test_unverified_load_still_refuses_a_damaged_header(ckpt: tuple) -> None:
    path, _, _ = ckpt
    data = os.path.join(path, "rank00000.safetensors")
    with open(data, "r+b") as f:
        f.write(b"\xff" * 8)  # header length: absurd
    with pytest.raises(sw.CheckpointError, match="rank00000.safetensors"):
        sw.load_checkpoint(path, fresh()[0], verify=False)


def test_architecture_mismatch_names_first_key_and_shapes(ckpt: tuple) -> None:
    path, _, _ = ckpt
    wider = TinyLM(d=8)
    sw.shard_model(wider, auto_wrap_policy=None)
    with pytest.raises(sw.CheckpointError,
                       match=r"pos has shape \(5, 6\) in the checkpoint, \(5, 8\) in the model"):
        sw.load_checkpoint(path, wider)
    deeper = TinyLM(n_layers=4)
    sw.shard_model(deeper, auto_wrap_policy=None)
    with pytest.raises(sw.CheckpointError, match=r"blocks.3.gate \(shape \(\)\) is not in"):
        sw.load_checkpoint(path, deeper)
    shallower = TinyLM(n_layers=2)
    sw.shard_model(shallower, auto_wrap_policy=None)
    with pytest.raises(sw.CheckpointError, match=r"blocks.2.gate \(shape \(\)\) is in the "
                                                 r"checkpoint but not in the model"):
        sw.load_checkpoint(path, shallower)


def test_optimizer_mismatches_are_refused(ckpt: tuple, tmp_path: object) -> None:
    path, model, _ = ckpt
    m2, _ = fresh()
    sgd_groups = torch.optim.AdamW([{"params": list(m2.parameters())[:3]},
                                    {"params": list(m2.parameters())[3:]}])
    with pytest.raises(sw.CheckpointError, match="1 param groups, this one has 2"):
        sw.load_checkpoint(path, m2, sgd_groups)
    model_only = os.path.join(str(tmp_path), "model_only")
    sw.save_checkpoint(model_only, model)
    with pytest.raises(sw.CheckpointError, match="holds no optimizer state"):
        sw.load_checkpoint(model_only, *fresh())
    assert sw.load_checkpoint(model_only, m2) is None and same_params(model, m2)


def test_bad_arguments_raise_before_writing(tmp_path: object) -> None:
    model, opt = trained(steps=0)
    root = str(tmp_path)
    with pytest.raises(ValueError, match="extra must be JSON-serializable"):
        sw.save_checkpoint(os.path.join(root, "a"), model, extra={"x": object()})
    with pytest.raises(ValueError, match="step=1.5 must be an int"):
        sw.save_checkpoint(os.path.join(root, "a"), model, step=1.5)  # type: ignore[arg-type]
    keep = os.path.join(root, "notes")
    os.makedirs(keep)
    open(os.path.join(keep, "todo.txt"), "w").write("precious")
    with pytest.raises(ValueError, match="refusing to replace .*notes"):
        sw.save_checkpoint(keep, model)
    assert os.listdir(root) == ["notes"] and os.listdir(keep) == ["todo.txt"]


class _Crash(BaseException):
    """Not an Exception: no handler in the library sees it, as with a SIGKILL."""


@pytest.mark.parametrize("point,survivor", [("files_written", 1), ("manifest_written", 1),
                                            ("moved_aside", 1), ("published", 2)])
def test_crash_at_each_point_of_a_save(tmp_path: object, point: str, survivor: int,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.path.join(str(tmp_path), "ckpt")
    models = {v: trained(seed=v, steps=1) for v in (1, 2, 3)}
    sw.save_checkpoint(path, *models[1], step=1, extra={"v": 1})

    def crash(name: str) -> None:
        if name == point:
            raise _Crash(name)

    monkeypatch.setattr(atomic, "_crash_hook", crash)
    with pytest.raises(_Crash):
        sw.save_checkpoint(path, *models[2], step=2, extra={"v": 2})
    monkeypatch.setattr(atomic, "_crash_hook", None)
    m, o = fresh()
    assert sw.load_checkpoint(path, m, o) == {"v": survivor}
    assert same_params(m, models[survivor][0])
    # The next save recovers whatever the crash left and cleans up after itself.
    sw.save_checkpoint(path, *models[3], step=3, extra={"v": 3})
    assert sorted(os.listdir(str(tmp_path))) == ["ckpt"]
    assert sw.load_checkpoint(path, m, o) == {"v": 3} and same_params(m, models[3][0])


def test_load_into_a_meta_device_model(ckpt: tuple) -> None:
    path, model, _ = ckpt
    with torch.device("meta"):
        meta = make_model("lm", 0)
    sw.shard_model(meta, auto_wrap_policy="transformer")
    sw.load_checkpoint(path, meta)
    x, _ = make_batch("lm", 3, 2)
    with torch.no_grad():
        torch.testing.assert_close(meta(x), model(x), rtol=0, atol=0)


def test_cli_export_offline_loads_with_load_file(ckpt: tuple, tmp_path: object,
                                                 capsys: pytest.CaptureFixture) -> None:
    path, model, _ = ckpt
    x, _ = make_batch("lm", 11, 3)
    with torch.no_grad():
        want = model(x)
    for limit, n_files in (("5GB", 1), ("400B", None)):
        out = os.path.join(str(tmp_path), f"out_{limit}")
        assert export_cmd.main([path, out, "--max-shard-size", limit, "--verbose"]) == 0
        printed = capsys.readouterr().out
        assert "verify [1/1] rank00000.safetensors" in printed
        assert "write  [1/" in printed and "embed.weight" in printed
        names = sorted(os.listdir(out))
        if n_files == 1:
            assert names == ["model.safetensors"]
            sd = load_file(os.path.join(out, "model.safetensors"))
        else:
            index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
            assert len(names) > 3 and index["weight_map"]["embed.weight"] in names
            sd = {}
            for f in sorted(set(index["weight_map"].values())):
                sd.update(load_file(os.path.join(out, f)))
        assert "head.weight" not in sd  # tied: stored once
        plain = TinyLM()
        missing, unexpected = plain.load_state_dict(sd, strict=False)
        assert missing == ["head.weight"] and unexpected == []
        with torch.no_grad():
            torch.testing.assert_close(plain(x), want, rtol=0, atol=0)
    # A .safetensors file name: exactly that file, however small the limit.
    single = os.path.join(str(tmp_path), "weights", "lm.safetensors")
    assert export_cmd.main([path, single, "--max-shard-size", "400B"]) == 0
    capsys.readouterr()
    assert os.listdir(os.path.dirname(single)) == ["lm.safetensors"]
    assert load_file(single).keys() == sd.keys()
    # Damage is refused by name: one `error:` line, exit 2, no traceback.
    _flip(os.path.join(path, "rank00000.safetensors"), -1)
    assert export_cmd.main([path, os.path.join(str(tmp_path), "bad")]) == 2
    err = capsys.readouterr().err
    assert "rank00000.safetensors is corrupted" in err and len(err.strip().splitlines()) == 1


def test_parse_size() -> None:
    assert export_cmd.parse_size("5GB") == 5 * 10**9
    assert export_cmd.parse_size("512MiB") == 512 * 2**20
    assert export_cmd.parse_size("1000") == 1000
    with pytest.raises(Exception, match="not a size"):
        export_cmd.parse_size("lots")


def _rss_mb(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux /proc to reset the peak-memory mark")
def test_offline_export_memory_is_bounded_by_the_largest_tensor(tmp_path: object) -> None:
    from shardwise.checkpoint.export import export_checkpoint

    # 8 tensors of 4 MiB (32 MiB of model, 96 MiB with AdamW state): a 4 MiB bound.
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(8)])
    sw.shard_model(model, auto_wrap_policy=None)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    ckpt = os.path.join(str(tmp_path), "ckpt")
    sw.save_checkpoint(ckpt, model, opt)
    del model, opt
    base = _rss_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM, the peak resident set, to now
    export_checkpoint(ckpt, os.path.join(str(tmp_path), "out"))
    peak = _rss_mb("VmHWM") - base
    assert peak < 3 * 4, f"export peaked at +{peak:.1f} MiB for 4 MiB tensors (32 MiB model)"


def test_leftovers_of_a_crash_while_deleting_are_ignored_then_cleaned(ckpt: tuple) -> None:
    path, model, opt = ckpt
    # A crash while deleting the old copy (its manifest goes first) or while writing.
    for leftover in (atomic.previous_path(path), atomic.partial_path(path)):
        os.makedirs(leftover)
        open(os.path.join(leftover, "rank00000.safetensors"), "wb").write(b"half")
    m2, _ = fresh()
    sw.load_checkpoint(path, m2)
    assert same_params(model, m2)
    sw.save_checkpoint(path, model, opt)
    assert sorted(os.listdir(os.path.dirname(path))) == ["ckpt"]
    # Deleting a checkpoint that way never leaves one that looks complete.
    atomic.remove(path)
    assert not os.path.exists(path)


def test_loaded_state_does_not_depend_on_the_files(ckpt: tuple) -> None:
    path, model, opt = ckpt
    m2, o2 = fresh()
    sw.load_checkpoint(path, m2, o2)
    for name in os.listdir(path):
        os.truncate(os.path.join(path, name), 0)  # a memory-mapped view would now SIGBUS
    x, y = make_batch("lm", 7, 4)
    for m, o in ((model, opt), (m2, o2)):
        loss_fn("lm", m(x), y).backward()
        o.step()
    assert same_params(model, m2)


def test_manifest_version_marks_rows_on_another_dim() -> None:
    """A checkpoint with a tensor sharded on dim 1 must not look readable to a shardwise that
    predates the "dim" field (it would read the pieces as dim-0 rows): it says version 2;
    one without such tensors stays version 1. Both parse; a version-1 manifest that claims a
    dim is refused."""
    from shardwise.checkpoint import manifest as M

    def make(dim: int) -> M.Manifest:
        info = M.TensorInfo((4, 6), torch.float32, [("rank00000.safetensors", 0, 6 if dim
                                                     else 4)], dim)
        return M.Manifest(step=1, extra=None, versions={}, saved_by={},
                          files={"rank00000.safetensors": {"bytes": 1, "sha256": "x"}},
                          tensors={"model/w": info}, model_keys=["w"], aliases={},
                          optimizer=None)

    for dim, version in ((0, 1), (1, 2)):
        body = json.loads(make(dim).to_json())
        assert body["format_version"] == version
        assert M._parse(dict(body), "m").tensors["model/w"].dim == dim
    bad = json.loads(make(1).to_json())
    bad.pop("sha256")
    bad["format_version"] = 1
    bad["sha256"] = M._digest(bad)
    with pytest.raises(M.CheckpointError, match="rows on dim 1 in a format_version 1"):
        M._parse(bad, "m")
