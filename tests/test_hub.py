"""push / pull / verify, hub ids as sources, the model card and the content manifest.

Everything talks to the hub through huggingface_hub's real client; the other end is `hub_server`, a
local hub-protocol test server on 127.0.0.1 (plain LFS: HF_HUB_DISABLE_XET=1).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_server import HubTestServer

from quantkit.checkpoint import manifest as manifest_mod
from quantkit.checkpoint.manifest import MANIFEST_NAME, read_manifest
from quantkit.convert.pipeline import convert
from quantkit.hub.card import NOT_RECORDED, write_card
from quantkit.quant.recipe import load_recipe

TOKEN = "hf_quantkitTEST0secret0token0do0not0print"
REPO = Path(__file__).resolve().parent.parent


def _convert(src: Path, out: Path) -> Path:
    config = json.loads((src / "config.json").read_text())
    convert(src, out, load_recipe(None, config, {"max_shard_size": "120KB"}))
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory, ckpt_factory) -> Path:
    """A synthetic FP8 GLM-5 source with a README (front matter + text) and a LICENSE."""
    src = tmp_path_factory.mktemp("src") / "GLM-tiny"
    shutil.copytree(ckpt_factory("glm_moe_dsa", "fp8"), src)
    (src / "README.md").write_text("---\nlicense: mit\npipeline_tag: text-generation\n---\n\n# GLM tiny\n\n"
                                   "The original card text.\n", encoding="utf-8")
    (src / "LICENSE").write_text("MIT License\n\nPermission is hereby granted, free of charge...\n", encoding="utf-8")
    return src


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> Path:
    return _convert(source, tmp_path_factory.mktemp("conv") / "out")


@pytest.fixture
def out(converted, tmp_path) -> Path:
    """A private copy of the converted checkpoint (tests modify it)."""
    return Path(shutil.copytree(converted, tmp_path / "GLM-tiny-W4A16"))


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    with HubTestServer(tmp_path / "hub-store", TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("QUANTKIT_HUB_CACHE", str(tmp_path / "hub-cache"))
        monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)  # read at import time by the client
        monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
        monkeypatch.setattr(hf_constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf-home" / "stored_tokens"))
        yield server


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and not any(s.startswith(".") for s in p.relative_to(directory).parts)}


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("model-*.safetensors"))


# ---- manifest ---------------------------------------------------------------------------------------
def test_manifest_is_accepted_by_sha256sum_and_covers_every_file(converted):
    proc = subprocess.run(["sha256sum", "-c", MANIFEST_NAME], cwd=converted, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = read_manifest(converted)
    assert set(listed) == set(_files(converted)) - {MANIFEST_NAME}
    assert len(_shards(converted)) >= 3 and all(s.name in listed for s in _shards(converted))
    assert not list(converted.rglob("*.sha256")), "write-time digest sidecars must not be left in the output"


def test_shard_digests_come_from_the_bytes_as_written(source, tmp_path, monkeypatch):
    hashed: list[str] = []
    real = manifest_mod.sha256_file
    monkeypatch.setattr(manifest_mod, "sha256_file", lambda p, cb=None: hashed.append(Path(p).name) or real(p, cb))
    out = _convert(source, tmp_path / "o")
    assert hashed and not [h for h in hashed if h.endswith(".safetensors")], hashed  # no second read of a shard
    for shard in _shards(out):
        assert read_manifest(out)[shard.name] == hashlib.sha256(shard.read_bytes()).hexdigest()


def test_verify_lists_mismatches(cli, out):
    code, _, err = cli("verify", str(out), "--quiet")
    assert code == 0, err
    _flip_byte(_shards(out)[1])
    (out / "tokenizer_config.json").unlink()
    code, stdout, err = cli("verify", str(out), "--quiet")
    assert code == 2
    assert f"{_shards(out)[1].name}: sha256 mismatch" in stdout and "tokenizer_config.json: missing" in stdout
    assert err.strip().count("\n") == 0 and "Traceback" not in err


# ---- card -------------------------------------------------------------------------------------------
def test_card_parses_and_carries_the_required_fields(converted, source):
    from huggingface_hub import ModelCard

    card = ModelCard.load(converted / "README.md")
    data = card.data.to_dict()
    assert data["license"] == "mit" and data["pipeline_tag"] == "text-generation"
    assert data["library_name"] == "transformers"
    assert {"compressed-tensors", "int4", "w4a16", "glm_moe_dsa"} <= set(data["tags"])
    assert "base_model" not in data  # a local source: unknown, never a local path
    text = card.text
    record = json.loads((converted / "quantkit.json").read_text())
    for section in ("## Quantization scheme", "## What was quantized and what was kept", "## Sizes",
                    "## Serving plan per GPU", "## KV cache", "## Calibration", "## Provenance",
                    "## Original model card", "## License"):
        assert section in text
    assert "| group size | 32 |" in text and "| method | rtn |" in text
    assert record["source"]["fingerprint"] in text and "NVIDIA H200" in text
    # convert writes the engines' serving record: the card shows both verdicts and the launch lines
    assert NOT_RECORDED not in text and "### sglang 0.5.23" in text and "### vllm 0.33.0" in text
    assert record["serving"]["sglang"]["launch"][0] in text  # `<MODEL>` until push names the repo
    assert "#### Prefill/decode pair" in text and " ".join(record["serving"]["sglang"]["pd"]["decode"]["args"]) in text
    assert "The original card text." in text and "Permission is hereby granted" in text
    assert (converted / "README.source.md").read_bytes() == (source / "README.md").read_bytes()


def test_card_renders_the_serving_record_with_the_repo_id(out):
    record = json.loads((out / "quantkit.json").read_text())
    record["serving"] = {
        "sglang": {"version": "0.5.23", "verdict": "loads-with-warnings",
                   "args": ["--disable-shared-experts-fusion", "--kv-cache-dtype", "fp8_e4m3"],
                   "kv_cache": {"dtype": "fp8_e4m3", "scale": "1.0", "detail": "no checkpoint scales for DSA"},
                   "launch": ["python -m sglang.launch_server --model-path <MODEL> --disaggregation-mode prefill",
                              "python -m sglang.launch_server --model-path <MODEL> --disaggregation-mode decode"],
                   "notes": ["MTP draft layer kept"]},
        "vllm": {"version": "0.19.0", "verdict": "fails", "args": [], "kv_cache": {"dtype": "auto", "scale": "none",
                 "detail": "bf16"}, "launch": ["vllm serve <MODEL> --tensor-parallel-size 8"], "notes": []},
    }
    (out / "quantkit.json").write_text(json.dumps(record))
    first = write_card(out, repo_id="org/GLM-tiny-int4").read_bytes()
    assert write_card(out, repo_id="org/GLM-tiny-int4").read_bytes() == first  # deterministic
    text = first.decode()
    assert "--model-path org/GLM-tiny-int4 --disaggregation-mode prefill" in text
    assert "--model-path org/GLM-tiny-int4 --disaggregation-mode decode" in text
    assert "vllm serve org/GLM-tiny-int4" in text and "<MODEL>" not in text
    assert "Verdict: **loads-with-warnings**" in text and "Verdict: **fails**" in text
    assert "| sglang | fp8_e4m3 | 1.0 | no checkpoint scales for DSA |" in text and NOT_RECORDED not in text


def test_card_renders_a_served_evaluation(out):
    from quantkit.evaluate.stats import compare
    from quantkit.hub.refresh import record_eval as record

    comp = compare("accuracy", [1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], threshold=0.8).to_json()
    result = {"candidate": {"url": "http://int4", "model": "int4"}, "baseline": {"url": "http://fp8", "model": "fp8"},
              "threshold_points": 0.8, "limit": 4, "answers": "answers.jsonl", "verdict": comp["verdict"],
              "tasks": {"gsm8k": {"items": 4, "comparisons": [comp], "verdict": comp["verdict"], "seconds": 3.0}}}
    record(out, result)
    text = (out / "README.md").read_text()  # regenerated by record, SHA256SUMS re-hashed
    assert text == write_card(out).read_text()
    from quantkit.checkpoint.manifest import verify_manifest

    assert verify_manifest(out).ok
    assert "candidate `int4` vs baseline `fp8`" in text
    assert "| gsm8k | accuracy, % | 4 | 75.00 | 100.00 | -25.00 [" in text


# ---- push / pull ------------------------------------------------------------------------------------
def test_push_then_pull_roundtrip_is_byte_identical(cli, hub, out, tmp_path):
    from huggingface_hub import ModelCard, snapshot_download

    outputs = []
    code, stdout, err = cli("push", str(out), "org/GLM-tiny-int4", "--quiet")
    outputs += [stdout, err]
    assert code == 0, err
    assert len(hub.commits) == 1 and hub.commits[0]["ref"] == "main"
    local = _files(out)  # push regenerated the card with the repo id and updated SHA256SUMS
    assert "# org/GLM-tiny-int4" in local["README.md"].decode()
    remote = hub.head_files("org/GLM-tiny-int4")
    assert {p: hub.read(f) for p, f in remote.items() if p != ".gitattributes"} == local

    raw = Path(snapshot_download("org/GLM-tiny-int4", local_dir=tmp_path / "snap", endpoint=hub.url))
    assert _files(raw) == local
    code, stdout, err = cli("pull", "org/GLM-tiny-int4", str(tmp_path / "pulled"), "--quiet")
    outputs += [stdout, err]
    assert code == 0, err
    assert _files(tmp_path / "pulled") == local
    check = subprocess.run(["sha256sum", "-c", MANIFEST_NAME], cwd=tmp_path / "pulled", capture_output=True)
    assert check.returncode == 0
    assert ModelCard.load(tmp_path / "pulled" / "README.md").data.license == "mit"
    _shards(tmp_path / "pulled")[0].unlink()  # a rerun fetches only what is missing
    before = len(hub.requests)
    code, stdout, err = cli("pull", "org/GLM-tiny-int4", str(tmp_path / "pulled"), "--quiet")
    assert code == 0, err
    fetched = [p for m, p in hub.requests[before:] if m == "GET" and p.startswith("/lfs-objects/")]
    assert fetched == [f"/lfs-objects/{read_manifest(out)[_shards(out)[0].name]}"]
    assert _files(tmp_path / "pulled") == local

    code, stdout, err = cli("push", str(out), "org/GLM-tiny-int4", "--quiet")  # unchanged: nothing re-sent
    outputs += [stdout, err]
    assert code == 0, err
    assert len(hub.lfs_puts) == len(_shards(out))
    for text in outputs:
        assert TOKEN not in text
    for directory in (out, tmp_path / "pulled"):
        assert all(TOKEN.encode() not in data for data in _files(directory).values())


def test_push_to_a_branch_and_as_a_pull_request(cli, hub, out):
    code, _, err = cli("push", str(out), "org/m", "--revision", "int4-g32", "--quiet")
    assert code == 0, err
    code, _, err = cli("push", str(out), "org/m", "--create-pr", "--quiet")
    assert code == 0, err
    assert [c["ref"] for c in hub.commits] == ["int4-g32", "refs/pr/1"]
    assert set(hub.head_files("org/m", "main")) == {".gitattributes"}  # main untouched


def test_corrupted_or_missing_shard_is_refused_before_any_byte_is_sent(cli, hub, out):
    shard = _shards(out)[0]
    _flip_byte(shard)
    code, _, err = cli("push", str(out), "org/m", "--quiet")
    assert code == 2 and shard.name in err and "nothing was uploaded" in err
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert hub.requests == [] and hub.commits == []
    shard.unlink()
    code, _, err = cli("push", str(out), "org/m", "--quiet")
    assert code == 2 and f"{shard.name}: missing" in err and hub.requests == []


def test_token_handling(cli, hub, out, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN")
    code, stdout, err = cli("push", str(out), "org/m", "--quiet")
    assert code == 2 and "no Hugging Face token" in err and "hf auth login" in err and "Traceback" not in err
    assert hub.requests == []

    monkeypatch.setenv("HF_TOKEN", "hf_wrongTOKENvalue0000")
    code, stdout, err = cli("push", str(out), "org/m", "--quiet")
    assert code == 2 and "HTTP 401" in err and "hf_wrongTOKENvalue0000" not in stdout + err
    assert hub.commits == []

    monkeypatch.delenv("HF_TOKEN")  # the token `hf auth login` stores is used like huggingface_hub's CLI does
    token_file = tmp_path / "hf-home" / "token"
    token_file.parent.mkdir(parents=True, exist_ok=True)
    token_file.write_text(TOKEN)
    code, stdout, err = cli("push", str(out), "org/m", "--quiet")
    assert code == 0, err
    assert TOKEN not in stdout + err and len(hub.commits) == 1


def test_killed_upload_resumes(cli, hub, out):
    hub.hold_puts_after = 1  # the second shard's upload waits in the server until the client is killed
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "quantkit", "push", str(out), "org/m", "--quiet"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600  # only a guard against a hung push; the hold decides when the kill comes
    while not hub.holding.wait(timeout=0.1) and proc.poll() is None and time.monotonic() < deadline:
        pass  # (a push that ends by itself never reaches the held upload: the assertions below say so)
    proc.send_signal(signal.SIGKILL)
    printed = proc.communicate()[0].decode(errors="replace")
    first_run = list(hub.lfs_puts)
    hub.hold_puts_after = None
    hub.release.set()
    assert first_run, printed
    assert hub.commits == [], "killed before the commit"
    assert len(first_run) < len(_shards(out)), "the kill came too late to test a resume"

    code, stdout, err = cli("push", str(out), "org/m", "--quiet")
    assert code == 0, err
    resent = hub.lfs_puts[len(first_run):]
    assert not set(resent) & set(first_run), "objects the server already held were uploaded again"
    assert len(first_run) + len(resent) == len(_shards(out))
    remote = hub.head_files("org/m")
    assert {p: hub.read(f) for p, f in remote.items() if p != ".gitattributes"} == _files(out)
    assert TOKEN not in printed + stdout + err


def _tiny_safetensors() -> bytes:
    import torch
    from safetensors.torch import save

    return save({"w": torch.ones(4, 4)})


def test_pull_never_downloads_pickle_files(cli, hub, tmp_path):
    hub.seed("org/mixed", {"config.json": b"{}", "model.safetensors": _tiny_safetensors(),
                           "pytorch_model.bin": b"\x80\x04pickle", "training_args.pt": b"\x80\x04"})
    code, stdout, err = cli("pull", "org/mixed", str(tmp_path / "mixed"), "--quiet")
    assert code == 0, err
    assert sorted(_files(tmp_path / "mixed")) == ["config.json", "model.safetensors"]
    assert "refused 2 pickle file(s): pytorch_model.bin, training_args.pt" in err
    assert not [p for _, p in hub.requests if p.endswith((".bin", ".pt"))], "a pickle file was requested"

    hub.seed("org/pickle-only", {"config.json": b"{}", "pytorch_model.bin": b"\x80\x04pickle"})
    code, _, err = cli("pull", "org/pickle-only", str(tmp_path / "p"), "--quiet")
    assert code == 2 and "only pickle weights" in err and "Traceback" not in err


def test_pull_checks_every_file_against_the_hub(cli, hub, tmp_path):
    blob = _tiny_safetensors()
    hub.seed("org/bad", {"config.json": b"{}", "model.safetensors": blob})
    oid = hashlib.sha256(blob).hexdigest()
    hub.object_path(oid).write_bytes(blob[:-4] + b"XXXX")  # storage corrupted behind the hub's back
    code, _, err = cli("pull", "org/bad", str(tmp_path / "bad"), "--quiet")
    assert code == 2 and "model.safetensors" in err and "sha256" in err
    assert not (tmp_path / "bad" / "model.safetensors").exists()  # removed: a rerun fetches it again


def test_hub_ids_are_sources_for_inspect_plan_and_convert(cli, hub, source, tmp_path):
    from huggingface_hub import ModelCard

    commit = hub.seed("zai-org/GLM-tiny", _files(source))
    code, stdout, err = cli("inspect", "zai-org/GLM-tiny", "--json")
    assert code == 0, err
    info = json.loads(stdout)
    cache = Path(os.environ["QUANTKIT_HUB_CACHE"]) / "zai-org--GLM-tiny"
    assert Path(info["path"]) == cache and info["family"] == "glm_moe_dsa"
    code, stdout, err = cli("plan", "zai-org/GLM-tiny", "--json")
    assert code == 0, err and json.loads(stdout)["model"]
    code, _, err = cli("convert", "zai-org/GLM-tiny", str(tmp_path / "conv"), "--quiet")
    assert code == 0, err
    record = json.loads((tmp_path / "conv" / "quantkit.json").read_text())
    assert record["source"]["hub"]["repo_id"] == "zai-org/GLM-tiny" and record["source"]["hub"]["commit"] == commit
    data = ModelCard.load(tmp_path / "conv" / "README.md").data
    assert data.base_model == "zai-org/GLM-tiny" and data.base_model_relation == "quantized"
    code, _, err = cli("kv-scales", "zai-org/GLM-tiny")
    assert code == 2 and "--out" in err


def test_pull_never_writes_through_a_planted_link(cli, hub, tmp_path):
    """quantkit.core.paths: a link at the pull destination or at the hub cache folder of a source is refused, exit 2."""
    hub.seed("org/tiny", {"config.json": b"{}", "model.safetensors": _tiny_safetensors()})
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "dest").symlink_to(victim)
    code, _, err = cli("pull", "org/tiny", str(tmp_path / "dest"), "--quiet")
    assert code == 2 and f"{tmp_path / 'dest'}: is a symbolic link" in err and "Traceback" not in err, err
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    (cache / "org--tiny").symlink_to(victim)
    code, _, err = cli("inspect", "org/tiny")
    assert code == 2 and f"{cache / 'org--tiny'}: is a symbolic link" in err, err
    assert list(victim.iterdir()) == []


def test_pull_creates_missing_parents_of_dest(cli, hub, tmp_path):
    hub.seed("org/nested", {"config.json": b"{}", "model.safetensors": _tiny_safetensors()})
    dest = tmp_path / "models" / "org" / "nested"
    code, _, err = cli("pull", "org/nested", str(dest), "--quiet")
    assert code == 0, err
    assert sorted(_files(dest)) == ["config.json", "model.safetensors"]
