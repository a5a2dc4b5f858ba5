"""Security: the explorer stays on this machine and refuses other origins' button presses;
config files, checkpoints and exports never execute code or unpickle."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

import shardwise as sw
from shardwise.checkpoint import manifest as M
from shardwise.checkpoint.manifest import CheckpointError
from shardwise.commands import explore as explore_cmd
from shardwise.commands import export as export_cmd
from shardwise.explorer.server import create_app, cross_origin_refusal, is_loopback
from shardwise.train import options as O
from tests.e2e.replay_fixture import write_run
from tests.models import make_model

ROOT = Path(__file__).resolve().parents[2]
CONTROLS = ("reset", "train", "pause", "step", "config")
HOME = "http://127.0.0.1:8123"


# --- the explorer ------------------------------------------------------------------------


class FakeSession:
    """Just enough of explorer.session.Session for the routes; records button presses."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def state(self) -> dict[str, Any]:
        return {"calls": list(self.calls)}

    async def reset(self) -> None:
        self.calls.append("reset")

    async def train(self) -> None:
        self.calls.append("train")

    async def pause(self) -> None:
        self.calls.append("pause")

    async def train_step(self) -> None:
        self.calls.append("step")

    async def configure(self, body: dict) -> None:
        self.calls.append("config")


def client(loopback_only: bool = True, base: str = HOME) -> tuple[TestClient, FakeSession]:
    session = FakeSession()
    # No `with`: the lifespan (which would start worker processes) never runs.
    app = create_app(session=session, loopback_only=loopback_only)  # type: ignore[arg-type]
    return TestClient(app, base_url=base), session


@pytest.mark.parametrize("action", CONTROLS)
@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},
    {"Origin": "https://evil.example"},
    {"Origin": "null"},  # sandboxed iframe or a file:// page
    {"Origin": "http://127.0.0.1:9999"},  # another local web app: same site, other origin
    {"Origin": "http://127.0.0.1:8123.evil.example"},
    {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},
    {"Sec-Fetch-Site": "cross-site", "Origin": HOME},  # the browser's word wins
])
def test_controls_refuse_other_origins(action: str, headers: dict[str, str]) -> None:
    c, session = client()
    r = c.post(f"/api/{action}", json={}, headers=headers)
    assert r.status_code == 403, r.text
    assert "refused" in r.json()["error"]
    assert session.calls == []


@pytest.mark.parametrize("action", CONTROLS)
def test_controls_work_from_the_page_itself_and_from_curl(action: str) -> None:
    c, session = client()
    page = {"Origin": HOME, "Sec-Fetch-Site": "same-origin"}
    assert c.post(f"/api/{action}", json={}, headers=page).status_code == 200
    assert c.post(f"/api/{action}", json={}).status_code == 200  # no Origin: not a browser
    assert session.calls == [action, action]


def test_dns_rebinding_and_non_json_posts_are_refused() -> None:
    c, session = client()
    # A name that resolves to 127.0.0.1 only through the attacker's DNS: Host betrays it.
    r = c.post("/api/reset", json={}, headers={"Host": "evil.example:8123",
                                                "Origin": "http://evil.example:8123"})
    assert r.status_code == 421
    r = c.post("/api/reset", content=b"a=1", headers={
        "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415
    assert session.calls == []
    for host in ("localhost:8123", "[::1]:8123", "127.0.0.2:8123"):
        assert c.get("/api/info", headers={"Host": host}).status_code == 200, host


def test_reads_grant_no_cors_and_no_preflight() -> None:
    c, _ = client()
    r = c.get("/api/state", headers={"Origin": "http://evil.example"})
    # Allowed to run, but without CORS headers the other page's script cannot read it.
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = c.options("/api/reset", headers={"Origin": "http://evil.example",
                                         "Access-Control-Request-Method": "POST",
                                         "Access-Control-Request-Headers": "content-type"})
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers


def test_origin_check_also_guards_a_server_bound_beyond_loopback() -> None:
    c, session = client(loopback_only=False, base="http://192.168.1.5:8123")
    assert c.post("/api/reset", json={}, headers={"Origin": "http://evil.example"}
                  ).status_code == 403
    assert c.post("/api/reset", json={}, headers={"Origin": "http://192.168.1.5:8123"}
                  ).status_code == 200
    assert session.calls == ["reset"]


def test_cross_origin_refusal_is_a_pure_decision() -> None:
    from starlette.datastructures import Headers

    def h(**kw: str) -> Headers:
        return Headers({k.replace("_", "-"): v for k, v in kw.items()})

    assert cross_origin_refusal("GET", h(origin="http://evil.example")) is None
    assert cross_origin_refusal("POST", h(host="a:1", origin="http://A:1")) is None
    assert cross_origin_refusal("POST", h(host="a:1", sec_fetch_site="none")) is None
    assert cross_origin_refusal("DELETE", h(host="a:1", origin="http://b:1")) is not None
    assert cross_origin_refusal("POST", h(host="a:1", origin="ftp://a:1")) is not None


def test_loopback_names_and_the_exposure_warning() -> None:
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        assert is_loopback(host) and explore_cmd.exposure_warning(host) is None, host
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com"):
        assert not is_loopback(host)
        warning = explore_cmd.exposure_warning(host)
        assert warning is not None and repr(host) in warning and "127.0.0.1" in warning
    assert explore_cmd._parser().parse_args([]).host == "127.0.0.1"


def _first_url_and_stderr(args: list[str]) -> tuple[str, str]:
    """Run `shardwise explore ARGS` until it prints its URL; stop it; (url, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "shardwise.cli", "explore", "--no-browser",
                             "--port", "0", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        url = proc.stdout.readline().strip()  # type: ignore[union-attr]
        if url:  # served once: the SIGINT then meets a running server, not its start-up
            local = url.replace("0.0.0.0", "127.0.0.1")
            with urllib.request.urlopen(local + "api/info", timeout=30) as r:
                assert json.load(r) == {"mode": "replay"}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
    return url, "".join(err)


def test_cli_binds_loopback_by_default_and_warns_for_other_hosts(tmp_path: Path) -> None:
    run = str(write_run(tmp_path / "run"))
    url, err = _first_url_and_stderr(["--replay", run])
    assert url.startswith("http://127.0.0.1:") and "shardwise.explore:" not in err, err
    url, err = _first_url_and_stderr(["--replay", run, "--host", "0.0.0.0"])
    assert url.startswith("http://0.0.0.0:"), (url, err)
    assert "WARNING shardwise.explore: --host='0.0.0.0' serves" in err and "no login" in err
    assert "Traceback" not in err, err


# --- config files ------------------------------------------------------------------------


def test_config_files_are_data_never_code(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the payload would create ./pwned
    marker = tmp_path / "pwned"
    payload = "__import__('os').system('touch pwned')"
    f = tmp_path / "run.toml"
    f.write_text(f'name = "{payload}"\n[log]\nsample_prompt = "{payload}"\n')
    cfg = O.build(O.read_toml(f))
    assert cfg.name == payload and cfg.log.sample_prompt == payload  # just strings
    f.write_text(f'[train]\nsteps = "{payload}"\n')
    with pytest.raises(ValueError, match="is not a valid int"):
        O.build(O.read_toml(f))
    for text in (f'exec = "{payload}"\n', f'[model]\n__class__ = "{payload}"\n'):
        f.write_text(text)
        with pytest.raises(ValueError, match="unknown option"):
            O.build(O.read_toml(f))
    f.write_text(f"name = {payload}\n")  # not even TOML
    with pytest.raises(ValueError, match="not valid TOML"):
        O.read_toml(f)
    assert not marker.exists()


# Calls that run code or unpickle, by module (None: the builtin of that name).
_FORBIDDEN_CALLS = {
    (None, "eval"), (None, "exec"), (None, "compile"), (None, "__import__"),
    ("torch", "load"), ("pickle", "load"), ("pickle", "loads"), ("marshal", "loads"),
    ("yaml", "load"), ("yaml", "unsafe_load"), ("np", "load"), ("numpy", "load"),
    ("dill", "loads"), ("cloudpickle", "loads"), ("shelve", "open"),
}
_FORBIDDEN_IMPORTS = {"pickle", "marshal", "shelve", "dill", "cloudpickle", "yaml", "runpy"}
# cli.py imports `shardwise.commands.<name>` for a name it first checked is a known command.
_ALLOWED = {("cli.py", "importlib.import_module")}


def test_library_source_has_no_code_execution_or_unpickling() -> None:
    src = ROOT / "src" / "shardwise"
    found: list[str] = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name):
                    key: tuple[str | None, str] = (None, f.id)
                elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                    key = (f.value.id, f.attr)
                else:
                    continue
                name = ".".join(k for k in key if k)
                if key in _FORBIDDEN_CALLS or name == "importlib.import_module":
                    if (rel, name) not in _ALLOWED:
                        found.append(f"{rel}:{node.lineno}: {name}()")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) \
                    else [node.module or ""]
                found += [f"{rel}:{node.lineno}: import {m}" for m in mods
                          if m.split(".")[0] in _FORBIDDEN_IMPORTS]
    assert found == []


# --- checkpoints and exports -------------------------------------------------------------


class _Payload:
    """Unpickling this creates `marker`: proof that something unpickled the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _torch_save_payload(path: Path, marker: Path) -> None:
    torch.save({"embed.weight": _Payload(marker)}, str(path))


def _pickle_payload(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(_Payload(marker)))


def test_payloads_are_live(tmp_path: Path) -> None:
    # Without this the tests below could pass because the payload does nothing.
    for make in (_torch_save_payload, _pickle_payload):
        marker = tmp_path / f"live_{make.__name__}"
        make(tmp_path / "p", marker)
        if make is _torch_save_payload:
            torch.load(str(tmp_path / "p"), weights_only=False)
        else:
            pickle.loads((tmp_path / "p").read_bytes())
        assert marker.exists()


def _forge_manifest(ckpt: Path, change: Any) -> None:
    """Edit manifest.json and re-seal its checksum, as an attacker could (it is not a MAC)."""
    path = ckpt / M.MANIFEST
    body = json.loads(path.read_text())
    body.pop("sha256")
    change(body)
    body["sha256"] = M._digest(body)
    path.write_text(json.dumps(body))


def _reseal_file(name: str, size: int, digest: str) -> Any:
    def change(body: dict) -> None:
        body["files"][name] = {**body["files"][name], "bytes": size, "sha256": digest}
    return change


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = make_model("lm", 0)
    sw.shard_model(model, auto_wrap_policy=None)
    opt = torch.optim.AdamW(model.parameters())
    path = tmp_path_factory.mktemp("ckpt") / "ckpt"
    sw.save_checkpoint(path, model, opt, step=1, extra={"k": 1})
    return path


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def _refused_everywhere(ckpt: Path, tmp_path: Path, match: str,
                        capsys: pytest.CaptureFixture) -> None:
    """load_checkpoint (verified and not) and `shardwise export` all refuse `ckpt`."""
    for verify in (True, False):
        model = make_model("lm", 1)
        sw.shard_model(model, auto_wrap_policy=None)
        before = {k: v.clone() for k, v in sw.full_state_dict(model).items()}
        with pytest.raises(CheckpointError, match=match):
            sw.load_checkpoint(ckpt, model, torch.optim.AdamW(model.parameters()),
                               verify=verify)
        after = sw.full_state_dict(model)
        assert all(torch.equal(before[k], after[k]) for k in before)
    for flags in ([], ["--no-verify"]):
        capsys.readouterr()
        assert export_cmd.main([str(ckpt), str(tmp_path / "out"), *flags]) == 2
        assert "shardwise export: error:" in capsys.readouterr().err


@pytest.mark.parametrize("make", [_torch_save_payload, _pickle_payload])
@pytest.mark.parametrize("reseal", [False, True])
def test_pickled_shard_file_is_refused_and_never_unpickled(
        saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture, make: Any,
        reseal: bool) -> None:
    ckpt = _copy(saved, tmp_path)
    marker = tmp_path / "pwned"
    shard = ckpt / "rank00000.safetensors"
    make(shard, marker)
    if reseal:  # manifest updated to match: only the format check stands in the way
        from shardwise.checkpoint.safetensors_io import sha256_file

        _forge_manifest(ckpt, _reseal_file(shard.name, *sha256_file(str(shard))))
        match = "not a readable safetensors file"
    else:
        match = "corrupted|truncated|too long"
    _refused_everywhere(ckpt, tmp_path, match, capsys)
    assert not marker.exists()


def _bad_dtype(body: dict) -> None:
    next(iter(body["tensors"].values()))["dtype"] = "object"


def _path_escape(body: dict) -> None:
    body["files"]["../rank00000.safetensors"] = body["files"].pop("rank00000.safetensors")


def _not_a_dict(body: dict) -> None:
    body["tensors"] = ["__import__('os')"]


@pytest.mark.parametrize("damage", ["pickle", "torch_save", "bad_dtype", "path_escape",
                                    "not_a_dict", "python_literal"])
def test_manifest_with_unexpected_content_is_refused(
        saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture, damage: str) -> None:
    ckpt = _copy(saved, tmp_path)
    marker = tmp_path / "pwned"
    manifest = ckpt / M.MANIFEST
    if damage == "pickle":
        _pickle_payload(manifest, marker)
    elif damage == "torch_save":
        _torch_save_payload(manifest, marker)
    elif damage == "python_literal":
        manifest.write_text(f"{{'format': {M.FORMAT!r}, 'x': __import__('os')}}")
    else:
        _forge_manifest(ckpt, {"bad_dtype": _bad_dtype, "path_escape": _path_escape,
                               "not_a_dict": _not_a_dict}[damage])
    _refused_everywhere(ckpt, tmp_path, "manifest.json", capsys)
    assert not marker.exists()
