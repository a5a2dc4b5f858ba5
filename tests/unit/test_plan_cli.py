"""`shardwise plan` on the command line: the table, the comparison, JSON and errors."""

from __future__ import annotations

import json

import pytest

from shardwise.commands.plan import main


def test_human_output_compares_every_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--model", "7b", "--world-size", "8", "--mixed-precision", "bf16",
               "--device", "h100-80gb", "--batch-size", "1", "--seq-len", "4096"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "GPT '7b'" in out and "8 x h100-80gb" in out
    for line in ("= model states", "activations, peak", "total (the step peak)", "verdict:"):
        assert line in out
    table = out.split("every strategy")[1].splitlines()[2:]
    assert [row[2:].split()[0] for row in table] == [
        "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
    marked = [row for row in table if row.startswith("*")]
    assert len(marked) == 1 and "yes" in marked[0]  # the marked one fits
    assert " no " in table[2]  # NO_SHARD: 16 bytes x 6.6B per rank does not fit in 80 GB


def test_json_is_plan_to_dict(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--params", "7.5e9", "--world-size", "16", "--strategy", "no_shard",
               "--mixed-precision", "bf16", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["sharding_strategy"] == "NO_SHARD"
    assert d["per_rank"]["model_states_bytes"] == pytest.approx(16 * 7.5e9, rel=1e-6)
    assert d["time"] is None and d["fits"] is None  # no device given


def test_bare_count_with_shape(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--params", "6.6e9", "--layers", "32", "--hidden", "4096", "--heads", "32",
               "--world-size", "16", "--device", "a100-80gb", "--interconnect", "ib-200g",
               "--batch-size", "1", "--seq-len", "2048", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["shape"]["n_layers"] == 32 and d["units"] == 33
    assert d["comm"]["inter_node_bytes"] > 0 and d["time"]["bound"] in ("compute",
                                                                       "interconnect")


@pytest.mark.parametrize("argv, words", [
    (["--model", "nope"], ["nope", "tiny", "7b"]),
    (["--params", "1e9", "--device", "tpu"], ["tpu", "h100-80gb"]),
    (["--params", "1e9", "--layers", "4"], ["--hidden", "--heads"]),
])
def test_errors(argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err


def test_needs_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--world-size", "8"])
    assert e.value.code == 2
    assert "--params" in capsys.readouterr().err


def test_seq_len_alone_plans_batch_one(capsys: pytest.CaptureFixture[str]) -> None:
    """--help says batch 1 is the default; --seq-len without --batch-size planned no
    activations ("activations unknown") before issue 42."""
    rc = main(["--model", "small", "--world-size", "2", "--seq-len", "128", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["batch_size"] == 1 and d["seq_len"] == 128
    assert d["per_rank"]["activations_bytes"] and d["per_rank"]["activations_bytes"] > 0
    assert not any("unknown" in n for n in d["notes"])
