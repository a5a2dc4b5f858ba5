"""The GPT of `shardwise train`: presets, parameter counts, meta-device build, init rules."""

from __future__ import annotations

import pytest
import torch

from shardwise.train import rundir
from shardwise.train.config import Config, TrainSection
from shardwise.train.model import GPT, PRESETS, GPTConfig, preset
from shardwise.train.trainer import lr_at


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_builds_on_meta_with_its_exact_count(name: str) -> None:
    with torch.device("meta"):
        m = GPT(PRESETS[name])
    assert sum(p.numel() for p in m.parameters()) == PRESETS[name].num_params()
    assert not list(m.buffers())  # nothing that would be left on the meta device


def test_7b_is_7b_class() -> None:
    c = PRESETS["7b"]
    assert (c.n_layer, c.d_model, c.n_head, c.vocab_size) == (32, 4096, 32, 32000)
    assert 6.0e9 < c.num_params() < 7.5e9


def test_head_is_tied_and_forward_shapes() -> None:
    torch.manual_seed(0)
    m = GPT(PRESETS["tiny"])
    x = torch.randint(0, 256, (2, 10))
    assert m(x).shape == (2, 10, 256)
    loss = m(x, torch.randint(0, 256, (2, 10)))
    assert loss.ndim == 0 and abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    loss.backward()
    assert m.wte.grad is not None  # one parameter, gradients from both ends
    with pytest.raises(ValueError, match="exceeds block_size"):
        m(torch.zeros(1, 65, dtype=torch.long))


def test_each_module_initializes_only_its_own_parameters() -> None:
    """sw.materialize calls reset_parameters on every module, parents first."""
    torch.manual_seed(0)
    m = GPT(PRESETS["tiny"])
    for module in m.modules():
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        own = {n for n, _ in module.named_parameters(recurse=False)}
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        for n, p in module.named_parameters():
            if n not in own:
                assert torch.equal(p, before[n]), f"{type(module).__name__} touched {n}"


def test_init_scales() -> None:
    torch.manual_seed(0)
    m = GPT(preset("small", n_layer=8))
    assert abs(m.wte.std().item() - 0.02) < 2e-3
    assert abs(m.blocks[0].attn.w_out.std().item() - 0.02 / 4) < 1e-3
    assert torch.equal(m.norm.weight, torch.ones_like(m.norm.weight))


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="n_head=5 must divide d_model=64"):
        GPTConfig(d_model=64, n_head=5)
    with pytest.raises(ValueError, match="not one of"):
        preset("huge")


def test_lr_schedule() -> None:
    t = TrainSection(steps=100, lr=1.0, min_lr_ratio=0.1, warmup_steps=10)
    assert lr_at(5, t) == pytest.approx(0.5)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(100, t) == pytest.approx(0.1)
    assert 0.1 < lr_at(55, t) < 1.0
    c = TrainSection(steps=100, lr=1.0, min_lr_ratio=0.1, warmup_steps=0, schedule="constant")
    assert lr_at(1, c) == lr_at(100, c) == 1.0
    # The end of the decay follows lr: a small lr needs no min_lr of its own.
    small = TrainSection(steps=100, lr=1e-4)
    assert lr_at(100, small) == pytest.approx(1e-5)


def test_run_names_never_clobber(tmp_path) -> None:
    out = str(tmp_path)
    assert rundir.resolve_name(Config(out_dir=out)).name == "small-1"
    (tmp_path / "small-1").mkdir()
    assert rundir.resolve_name(Config(out_dir=out)).name == "small-2"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="already exists"):
        rundir.resolve_name(Config(out_dir=out, name="mine"))
    assert rundir.resolve_name(Config(out_dir=out, name="mine", overwrite=True)).name == "mine"
    with pytest.raises(ValueError, match="holds no checkpoint"):
        rundir.resolve_name(Config(out_dir=out, name="mine", resume=True))


def test_truncate_metrics_on_resume(tmp_path) -> None:
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(f'{{"step": {i}}}\n' for i in range(1, 8)))
    rundir.truncate_metrics(p, 4)
    assert p.read_text().count("\n") == 4
