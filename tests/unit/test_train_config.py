"""`shardwise train` configuration: defaults, TOML, dotted overrides, errors, --help."""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.train import config as C
from shardwise.train import options as O


def test_every_field_is_documented_and_in_help() -> None:
    text = O.help_text()
    assert "(undocumented)" not in text
    for key in O.all_keys():
        assert f"--{key} (" in text, key
    for s in C.SECTIONS:
        cls = type(getattr(C.Config(), s))
        docs = O.field_docs(cls)
        assert set(docs) >= {f.name for f in dataclasses.fields(cls)}, cls.__name__


def test_overrides_convert_types() -> None:
    values, path = O.parse_argv([
        "--train.steps", "12", "--train.lr=1e-3", "--shard.cpu_offload",
        "--resume", "--name", "x", "--model.preset", "tiny", "--config", "f.toml",
        "--shard.sharding_strategy", "shard_grad_op", "--data.max_bytes", "1_000_000",
    ])
    assert path == "f.toml"
    cfg = O.build(values)
    assert cfg.train.steps == 12 and cfg.train.lr == 1e-3
    assert cfg.shard.cpu_offload is True and cfg.resume is True and cfg.name == "x"
    assert cfg.shard.sharding_strategy == "SHARD_GRAD_OP"
    assert cfg.data.max_bytes == 1_000_000


def test_bool_flag_takes_explicit_value() -> None:
    values, _ = O.parse_argv(["--shard.cpu_offload", "false", "--overwrite"])
    cfg = O.build(values)
    assert cfg.shard.cpu_offload is False and cfg.overwrite is True


def test_toml_then_command_line(tmp_path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('name = "a"\n[train]\nsteps = 7\nlr = 0.01\n[model]\npreset = "tiny"\n')
    merged = {**O.read_toml(f), **O.parse_argv(["--train.steps", "9"])[0]}
    cfg = O.build(merged)
    assert (cfg.name, cfg.train.steps, cfg.train.lr, cfg.model.preset) == ("a", 9, 0.01, "tiny")


def test_resolved_config_round_trips() -> None:
    cfg = O.build({"train.steps": "3", "log.sample_prompt": 'say "hi"\n',
                   "shard.cpu_offload": True})
    again = O.build(O.flatten_toml(O.tomllib.loads(O.dumps_toml(cfg))))
    assert again == cfg


@pytest.mark.parametrize("argv, needle", [
    (["--train.stpes", "3"], "did you mean train.steps"),
    (["--train.steps", "three"], "train.steps='three' is not a valid int"),
    (["--train.steps", "0"], "train.steps=0 and train.epochs=0.0: give one of them"),
    (["--shard.sharding_strategy", "ZERO9"], "FULL_SHARD, SHARD_GRAD_OP"),
    (["--shard.mixed_precision", "int8"], "fp32, bf16, fp16"),
    (["--model.preset", "huge"], "tiny, small"),
    (["--model.n_head", "3"], "n_head=3 must divide d_model=128"),
    (["--train.min_lr_ratio", "2"], "train.min_lr_ratio=2.0 must be in [0, 1]"),
    (["--train.min_lr", "0"], "did you mean train.min_lr_ratio"),
    (["--data.val_fraction", "0.9"], "data.val_fraction=0.9"),
    (["--data.path", "/no/such/file"], "does not exist"),
    (["--resume", "--overwrite"], "contradict"),
    (["--train.steps"], "needs a value"),
    (["steps=3"], "unexpected argument"),
])
def test_errors_name_the_value(argv: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        O.build(O.parse_argv(argv)[0])
    assert needle in str(e.value)


def test_bad_toml_file(tmp_path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[train\nsteps = 1\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        O.read_toml(f)
    with pytest.raises(ValueError, match="does not exist"):
        O.read_toml(tmp_path / "missing.toml")
    f.write_text("[train]\nsteps = \"many\"\n")
    with pytest.raises(ValueError, match="train.steps='many'"):
        O.build(O.read_toml(f))
