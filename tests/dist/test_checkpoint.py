"""Save at 2 ranks; resume at 1, 3 and 4 (other strategies too) and match one long run.

Process groups are few on purpose (3 spawns in all): every case that can share a group does.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import shardwise as sw
from shardwise.testing import run_distributed
from shardwise.train.model import GPT, GPTConfig
from tests.dist import ckpt_workers as W
from tests.models import make_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, run_distributed(W.save_at_2, 2, root)


def test_save_at_2_writes_one_file_per_rank(saved: tuple[str, list[dict]]) -> None:
    root, res = saved
    assert res[0]["files"] == ["manifest.json", "rank00000.safetensors",
                               "rank00001.safetensors"]
    m = json.load(open(os.path.join(root, "c2", "manifest.json")))
    assert m["step"] == W.STEPS and m["extra"] == {"data_pos": 36, "tag": "c2"}
    assert set(m["versions"]) >= {"shardwise", "torch", "safetensors"}
    emb = m["tensors"]["model/embed.weight"]
    assert emb["shape"] == [11, 6] and [p[1:] for p in emb["pieces"]] == [[0, 6], [6, 11]]
    assert m["model"]["aliases"] == {"head.weight": "embed.weight"}
    assert "optim/embed.weight/exp_avg" in m["tensors"]
    assert "optim/pos/exp_avg" not in m["tensors"]  # frozen: no optimizer state


def test_resume_at_1_3_4_ranks_matches_uninterrupted_run(saved: tuple[str, list[dict]]
                                                          ) -> None:
    root, _ = saved
    # 3 ranks, another strategy and wrap policy; saving there writes 3 files.
    r3 = run_distributed(W.resume, 3, root, "SHARD_GRAD_OP", "size", "c3", "c3n")
    # 4 ranks as 2 replicas x 2 shards: only replica 0 writes.
    r4 = run_distributed(W.resume, 4, root, "HYBRID_SHARD", "transformer", "c4",
                         env={"LOCAL_WORLD_SIZE": "2"})
    for res in r3 + r4:
        assert res["extra"] == {"data_pos": 36, "tag": "c2"}
        assert res["at_load"] < W.TOL and res["after_step"] < W.TOL, res
    assert r4[0]["files"] == ["manifest.json", "rank00000.safetensors",
                              "rank00001.safetensors"]
    assert r3[0]["files"] == ["manifest.json"] + [f"rank0000{r}.safetensors" for r in range(3)]
    assert r3[0]["no_shard_files"] == ["manifest.json", "rank00000.safetensors"]
    # 1 rank, in this process (no process group), NO_SHARD: from c2, and from c4 (saved
    # by HYBRID_SHARD at step STEPS + 1) one more step.
    one = W.resume(0, 1, root, "NO_SHARD", None)
    assert one["at_load"] < W.TOL and one["after_step"] < W.TOL, one
    model = make_model("lm", 5)
    sw.shard_model(model, sharding_strategy="FULL_SHARD", auto_wrap_policy=None)
    opt = W.make_opt(model)
    assert sw.load_checkpoint(os.path.join(root, "c4"), model, opt) is None
    ref, ref_opt = W.reference(W.STEPS + 1)
    assert W.worst_diff(model, opt, ref, ref_opt) < W.TOL
    replicated = make_model("lm", 6)
    sw.shard_model(replicated, auto_wrap_policy="transformer")
    sw.load_checkpoint(os.path.join(root, "c3n"), replicated)
    ref_at_save, _ = W.reference(W.STEPS)
    full = sw.full_state_dict(replicated)
    for name, p in ref_at_save.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=0, atol=W.TOL)
    W.train(model, opt, range(W.STEPS + 1, W.STEPS + 2), 0, 1)
    W.train(ref, ref_opt, range(W.STEPS + 1, W.STEPS + 2), 0, 1)
    assert W.worst_diff(model, opt, ref, ref_opt) < W.TOL


def test_errors_raise_on_every_rank_naming_the_cause(saved: tuple[str, list[dict]]) -> None:
    _, res = saved
    for rank, r in enumerate(res):
        assert "rank00001.safetensors is corrupted" in r["errors"]["corrupt"], (rank, r)
        # The first key of the MLP, its shape, and that the checkpoint lacks it.
        assert "fc1.weight (shape (7, 13)) is not in the checkpoint" in r["errors"]["arch"]
    assert "raised on rank 1" in res[0]["errors"]["corrupt"]


def test_live_export_loads_with_plain_safetensors(saved: tuple[str, list[dict]]) -> None:
    root, res = saved
    # TinyLM: one file, the tied head stored once (the model re-ties it).
    assert res[0]["lm_files"] == [os.path.join(root, "lm_export", "model.safetensors")]
    sd = load_file(res[0]["lm_files"][0])
    lm = make_model("lm", 9)
    missing, unexpected = lm.load_state_dict(sd, strict=False)
    assert missing == ["head.weight"] and unexpected == []
    with torch.no_grad():
        torch.testing.assert_close(lm(make_batch_x()), torch.from_numpy(res[0]["lm_out"]),
                                   rtol=0, atol=1e-6)
    # GPT past the size limit: shards + the Hugging Face index.
    files = res[0]["gpt_files"]
    assert len(files) > 1
    index = json.load(open(os.path.join(root, "gpt_export", "model.safetensors.index.json")))
    assert sorted(set(index["weight_map"].values())) == [os.path.basename(f) for f in files]
    sd = {}
    for f in files:
        sd.update(load_file(f))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in sd.values())
    gpt = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, d_model=16))
    gpt.load_state_dict(sd, strict=True)
    with torch.no_grad():
        out = gpt(torch.from_numpy(res[0]["gpt_idx"]))
    torch.testing.assert_close(out, torch.from_numpy(res[0]["gpt_out"]), rtol=0, atol=1e-6)


def make_batch_x() -> torch.Tensor:
    from tests.models import make_batch

    return make_batch("lm", 99, 4)[0]
