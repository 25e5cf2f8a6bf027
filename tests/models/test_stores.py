"""Local model stores (Ollama, LM Studio, the Hugging Face cache): layouts built
here in a temporary folder, with tiny GGUFs written by the ``gguf`` writer."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from afm_core._errors import ModelLoadError
from afm_core._models.resolve import resolve_model
from afm_core._models.stores import find_in_stores, gguf_summary, local_models, ollama_model
from afm_core.testing import make_random_model

from . import tokenizer_ref as ref

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PARAMS = {"stop": ["<|im_start|>", "<|im_end|>"], "temperature": 0.7}
GO_TEMPLATE = "{{ range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    meta = {**ref.tiny_cases(json.loads(ref.DATA.read_text())["vocabs"])["bpe-qwen2"],
            "tokenizer.chat_template": TEMPLATE}
    return ref.write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", meta)


@pytest.fixture(autouse=True)
def stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty home: no store is found but the ones a test builds."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HOME", raising=False)
    (tmp_path / "home").mkdir()
    return tmp_path


def _blob(root: Path, data: bytes) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / digest.replace(":", "-")).write_bytes(data)
    return {"digest": digest, "size": len(data)}


def ollama_store(root: Path, gguf: Path, name: str = "tiny", tag: str = "0.5b",
                 namespace: str = "library", model_layer: bool = True) -> Path:
    layers = [{"mediaType": "application/vnd.ollama.image.template", **_blob(root, GO_TEMPLATE.encode())},
              {"mediaType": "application/vnd.ollama.image.params", **_blob(root, json.dumps(PARAMS).encode())},
              {"mediaType": "application/vnd.ollama.image.license", **_blob(root, b"Apache-2.0")}]
    if model_layer:
        layers.insert(0, {"mediaType": "application/vnd.ollama.image.model", **_blob(root, gguf.read_bytes())})
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers,
                                    "mediaType": "application/vnd.docker.distribution.manifest.v2+json"}))
    return manifest


def test_ollama_manifest_blob_params_and_template(stores: Path, tiny_gguf: Path) -> None:
    ollama_store(stores / "ollama", tiny_gguf)
    model = ollama_model("tiny:0.5b")
    assert model.name == "ollama:tiny:0.5b" and model.format == "gguf" and model.store == "ollama"
    assert model.path.read_bytes() == tiny_gguf.read_bytes() and model.path.name.startswith("sha256-")
    assert model.details == {"params": PARAMS, "template": GO_TEMPLATE}
    assert (model.architecture, model.quantization) == ("llama", "F32")
    for spec in ("ollama:tiny:0.5b", "tiny:0.5b", "ollama:library/tiny:0.5b",
                 "ollama:registry.ollama.ai/library/tiny:0.5b"):
        assert find_in_stores(spec) == model.path


def test_ollama_latest_and_namespaces(stores: Path, tiny_gguf: Path) -> None:
    ollama_store(stores / "ollama", tiny_gguf, tag="latest")
    ollama_store(stores / "ollama", tiny_gguf, name="mine", namespace="someone", tag="q4")
    assert find_in_stores("tiny") == find_in_stores("ollama:tiny") == ollama_model("tiny:latest").path
    assert ollama_model("someone/mine:q4").name == "ollama:someone/mine:q4"
    assert find_in_stores("unknown") is None  # a bare name Ollama lacks is no Ollama name


def test_ollama_errors(stores: Path, tiny_gguf: Path) -> None:
    root = stores / "ollama"
    ollama_store(root, tiny_gguf)
    with pytest.raises(ModelLoadError, match=r"Ollama model 'nope:1b' not found.*Ollama has: tiny:0.5b"):
        find_in_stores("nope:1b")
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model("ollama:nope", home=stores / "afm")
    ollama_store(root, tiny_gguf, name="adapter", model_layer=False)
    with pytest.raises(ModelLoadError, match="has no model layer"):
        ollama_model("adapter:0.5b")
    digest = json.loads((root / "manifests/registry.ollama.ai/library/tiny/0.5b").read_text())["layers"][0]["digest"]
    (root / "blobs" / digest.replace(":", "-")).unlink()
    with pytest.raises(ModelLoadError, match=r"model blob of Ollama model 'tiny:0.5b' is missing.*ollama pull"):
        ollama_model("tiny:0.5b")
    with pytest.raises(ModelLoadError, match="not an Ollama model name"):
        ollama_model("a/b/c/d:1")


def test_resolve_converts_an_ollama_model_once(stores: Path, tiny_gguf: Path) -> None:
    import mlx_lm

    ollama_store(stores / "ollama", tiny_gguf)
    said: list[str] = []
    out = resolve_model("ollama:tiny:0.5b", home=stores / "afm", progress=said.append)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert resolve_model("tiny:0.5b", home=stores / "afm", progress=said.append) == out
    assert sum("later starts reuse it" in s for s in said) == 1
    _, tokenizer = mlx_lm.load(str(out))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_lmstudio_folders(stores: Path, tiny_gguf: Path) -> None:
    root = stores / "home" / ".lmstudio" / "models"
    folder = root / "someone" / "Tiny-GGUF"
    folder.mkdir(parents=True)
    shutil.copy(tiny_gguf, folder / "tiny-Q4_K_M.gguf")
    (folder / "mmproj-tiny.gguf").write_bytes(b"GGUF")  # vision projectors are no models
    assert find_in_stores("lmstudio:someone/Tiny-GGUF") == folder / "tiny-Q4_K_M.gguf"
    assert find_in_stores("someone/Tiny-GGUF") == folder / "tiny-Q4_K_M.gguf"
    assert find_in_stores("someone/Tiny-GGUF/tiny-Q4_K_M.gguf") == folder / "tiny-Q4_K_M.gguf"
    shutil.copy(tiny_gguf, folder / "tiny-Q8_0.gguf")
    with pytest.raises(ModelLoadError, match="several GGUF files: name one of someone/Tiny-GGUF/tiny-Q4_K_M"):
        find_in_stores("lmstudio:someone/Tiny-GGUF")
    assert find_in_stores("lmstudio:someone/Tiny-GGUF/tiny-Q8_0.gguf") == folder / "tiny-Q8_0.gguf"
    with pytest.raises(ModelLoadError, match="LM Studio model 'someone/other' not found"):
        find_in_stores("lmstudio:someone/other")
    mlx_dir = make_random_model(root / "mlx-community" / "Tiny-4bit", vocab_size=256, num_layers=1)
    assert find_in_stores("lmstudio:mlx-community/Tiny-4bit") == mlx_dir
    names = {m.name for m in local_models()}
    assert names == {"lmstudio:someone/Tiny-GGUF/tiny-Q4_K_M.gguf", "lmstudio:someone/Tiny-GGUF/tiny-Q8_0.gguf",
                     "lmstudio:mlx-community/Tiny-4bit"}


def _hf_snapshot(hub: Path, repo: str, rev: str, src: Path) -> Path:
    repo_dir = hub / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / rev
    shutil.copytree(src, snap)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(rev)
    return snap


def test_hugging_face_cache_offline(stores: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = make_random_model(stores / "src", vocab_size=256, num_layers=1)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization": {"bits": 4, "group_size": 64}}))
    old = _hf_snapshot(stores / "hub", "mlx-community/Tiny-4bit", "a" * 40, src)
    new = stores / "hub" / "models--mlx-community--Tiny-4bit" / "snapshots" / ("b" * 40)
    shutil.copytree(src, new)
    assert find_in_stores("hf:mlx-community/Tiny-4bit") == old  # refs/main wins over the newer folder
    assert resolve_model("mlx-community/Tiny-4bit", home=stores / "afm") == old
    (stores / "hub" / "models--mlx-community--Tiny-4bit" / "refs" / "main").unlink()
    assert find_in_stores("hf:mlx-community/Tiny-4bit") == new
    [model] = local_models()
    assert (model.name, model.format, model.quantization, model.architecture) == \
        ("hf:mlx-community/Tiny-4bit", "mlx", "4-bit (group 64)", "qwen3")
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache"):
        find_in_stores("hf:mlx-community/Other")


def test_afm_models_lists_every_store(stores: Path, tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from afm_core._cli import main

    ollama_store(stores / "ollama", tiny_gguf)
    lms = stores / "home" / ".lmstudio" / "models" / "someone" / "Tiny-GGUF"
    lms.mkdir(parents=True)
    shutil.copy(tiny_gguf, lms / "tiny.gguf")
    _hf_snapshot(stores / "hub", "mlx-community/Tiny", "c" * 40, make_random_model(stores / "src", vocab_size=256,
                                                                                 num_layers=1))
    assert main(["models"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "FORMAT", "QUANTIZATION", "SIZE", "ARCHITECTURE"]
    assert [line.split()[:3] for line in out[1:]] == [
        ["ollama:tiny:0.5b", "gguf", "F32"], ["lmstudio:someone/Tiny-GGUF/tiny.gguf", "gguf", "F32"],
        ["hf:mlx-community/Tiny", "mlx", "float32"]]
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["size"] == tiny_gguf.stat().st_size and rows[0]["params"] == PARAMS
    assert main(["models", str(stores / "ollama"), "--json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["ollama:tiny:0.5b"]


def test_gguf_summary_reads_only_the_header(tiny_gguf: Path, tmp_path: Path) -> None:
    summary = gguf_summary(tiny_gguf)
    assert summary["general.architecture"] == "llama" and summary["chat_template"] is True
    assert gguf_summary(tmp_path / "missing.gguf") == {}
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 8)
    assert gguf_summary(tmp_path / "bad.gguf") == {}


async def test_store_models_served_by_their_names(stores: Path, tiny_gguf: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model NAME:TAG`` / ``--models-dir`` on a store: a request's ``model``
    picks the store model, which answers through the openai SDK."""
    import openai

    from afm_http._registry import model_spec, models_in_dir
    from afm_http.testing import running_models

    monkeypatch.setenv("AFM_HOME", str(stores / "afm"))
    ollama_store(stores / "ollama", tiny_gguf)
    ollama_store(stores / "ollama", tiny_gguf, name="other", tag="1b")
    specs = models_in_dir(stores / "ollama")
    size = len(tiny_gguf.read_bytes())  # noqa: ASYNC240 - a test's setup
    assert [(s.id, s.size) for s in specs] == [("other:1b", size), ("tiny:0.5b", size)]
    # the params layer becomes the model's sampling defaults (filled into requests' gaps)
    kept = (("temperature", 0.7), ("stop", ("<|im_start|>", "<|im_end|>")))
    assert [s.defaults for s in specs] == [kept, kept]
    assert model_spec("ollama:tiny:0.5b").defaults == kept == model_spec("tiny:0.5b").defaults
    assert model_spec(stores, named="tiny:0.5b").defaults == kept  # resolved, as one --model is
    assert model_spec(tiny_gguf).defaults == () == model_spec("nothing:here").defaults
    async with running_models(["ollama:tiny:0.5b", "other:1b"], warmup=False) as (url, _):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        listed = [m.id async for m in client.models.list()]
        assert listed == ["ollama:tiny:0.5b", "other:1b"]
        for name in listed:
            out = await client.chat.completions.create(model=name, max_tokens=3,
                                                       messages=[{"role": "user", "content": "hi"}])
            assert out.usage.prompt_tokens > 0 and out.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="tiny:9b", max_tokens=3,
                                                 messages=[{"role": "user", "content": "hi"}])
        await client.close()
