"""ChatRendererForModel: the renderer a model directory gets, from its chat template (a file or
tokenizer_config.json's field), else its config.json model_type, else the configured fallback,
else a clear refusal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_model import CHAT_TEMPLATE as TINY_CHATML  # noqa: E402

TEMPLATES = {name: (HERE / "templates" / f"{name}.jinja").read_text() for name in ("qwen3", "qwen3_5", "llama3")}
TEMPLATES["chatml"] = TINY_CHATML


def _model(root: Path, name: str, *, model_type: str | None = None, template: str | None = None,
           in_config: bool = False) -> Path:
    d = root / name
    d.mkdir()
    if model_type is not None:
        (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    if template is not None and in_config:
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    elif template is not None:
        (d / "chat_template.jinja").write_text(template)
    return d


def _pick(tools, model_dir: Path, fallback: str = "") -> dict:
    return tools["qwen3"].run([{"pick": str(model_dir), "fallback": fallback}])[0]


@pytest.mark.parametrize("in_config", [False, True])
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_template_decides(name: str, in_config: bool, tmp_path: Path, tools) -> None:
    # The template wins over a model_type that says otherwise (the tiny model is a "qwen3" with
    # a plain ChatML template).
    d = _model(tmp_path, "m", model_type="qwen3", template=TEMPLATES[name], in_config=in_config)
    assert _pick(tools, d) == {"renderer": name}


@pytest.mark.parametrize(("model_type", "name"), [("qwen3", "qwen3"), ("qwen3_5", "qwen3_5"), ("llama", "llama3")])
def test_model_type_without_template(model_type: str, name: str, tmp_path: Path, tools) -> None:
    assert _pick(tools, _model(tmp_path, "m", model_type=model_type)) == {"renderer": name}


def test_unknown_is_refused_unless_a_fallback_is_configured(tmp_path: Path, tools) -> None:
    unknown = _model(tmp_path, "a", model_type="mistral")
    answer = _pick(tools, unknown)
    assert "mistral" in answer["error"] and "FAILED_PRECONDITION" in answer["error"]
    assert _pick(tools, unknown, fallback="chatml") == {"renderer": "chatml"}
    odd = _model(tmp_path, "b", model_type="qwen3", template="{{ messages }}")
    assert "unrecognized chat template" in _pick(tools, odd)["error"]
    assert "known: qwen3, qwen3_5, llama3, chatml" in _pick(tools, odd, fallback="vicuna")["error"]


def test_the_tiny_model_gets_chatml(tools) -> None:
    tiny = REPO / "models" / "tiny-qwen3"
    assert tiny.is_dir(), "models/tiny-qwen3 is made by scripts/setup.sh"
    assert _pick(tools, tiny) == {"renderer": "chatml"}
