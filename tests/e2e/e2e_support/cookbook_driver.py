"""Run one official tinker-cookbook recipe, unmodified, against a twinkle-server.

Runs in the cookbook venv (.cookbook-venv, scripts/requirements-cookbook.txt), not the main
one: `.cookbook-venv/bin/python cookbook_driver.py SPEC.json`. The spec (written by
tests/e2e/test_cookbook.py) names the recipe, the server's base_url, the served model name,
the local tokenizer folder, local data files and the short settings. Only these change; the
recipe's code runs as installed, through its own config objects and entry points.

Nothing reaches the Hugging Face hub:
- the tokenizer is registered under the model name with the cookbook's own
  `tokenizer_utils.register_tokenizer`, loading the tiny model's local files;
- `datasets.load_dataset` is replaced, before any recipe module is imported, by a lookup of
  the hub names the recipes use in local JSONL files (an unknown name is an error, never a
  download).
Each recipe writes its metrics to <log_path>/metrics.jsonl (the cookbook's ml_log); the
evaluator case writes <log_path>/result.json itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from functools import cache
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import datasets  # noqa: E402

Spec = dict[str, Any]


def install_local_datasets(files: dict[str, dict[str, str]]) -> None:
    """datasets.load_dataset(name, [config], split=..., streaming=...) reads files[name]
    ({split: jsonl path}); the key "name:config" wins over "name" when a config is given."""

    def load_dataset(path: str, name: str | None = None, *args: Any, split: str | None = None,
                     streaming: bool = False, **kwargs: Any) -> Any:
        if args:
            name = name or args[0]
        key = f"{path}:{name}" if name and f"{path}:{name}" in files else path
        if key not in files:
            raise RuntimeError(f"cookbook_driver: no local data for load_dataset({path!r}, {name!r})")
        splits = datasets.DatasetDict(
            {s: datasets.Dataset.from_json(f) for s, f in files[key].items()})
        result: Any = splits[split] if split is not None else splits
        if streaming:
            result = result.to_iterable_dataset()
        return result

    datasets.load_dataset = load_dataset  # type: ignore[assignment]


def register_local_tokenizer(model_name: str, tokenizer_dir: str) -> None:
    from tinker_cookbook import tokenizer_utils

    @cache
    def factory() -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_dir)

    tokenizer_utils.register_tokenizer(model_name, factory)


def run(spec: Spec) -> None:
    recipe: str = spec["recipe"]
    common = {"base_url": spec["base_url"], "model_name": spec["model_name"],
              "log_path": spec["log_path"]}
    settings: dict[str, Any] = spec.get("settings", {})
    if recipe == "sl_loop":
        from tinker_cookbook.recipes import sl_loop

        sl_loop.main(sl_loop.Config(**common, **settings))
    elif recipe == "rl_loop":
        from tinker_cookbook.recipes import rl_loop

        rl_loop.main(rl_loop.Config(**common, **settings))
    elif recipe == "chat_sl":
        from tinker_cookbook.recipes.chat_sl import train as chat_sl

        chat_sl.cli_main(chat_sl.CLIConfig(**common, **settings))
    elif recipe == "math_rl":
        from tinker_cookbook.recipes.math_rl import train as math_rl

        asyncio.run(math_rl.cli_main(math_rl.CLIConfig(**common, **settings)))
    elif recipe == "dpo":
        from tinker_cookbook.recipes.preference.dpo import train as dpo

        dpo.cli_main(dpo.CLIConfig(**common, **settings))
    elif recipe == "on_policy_distillation":
        from tinker_cookbook.recipes.distillation import on_policy_distillation as opd

        asyncio.run(opd.cli_main(opd.CLIConfig(**common, **settings)))
    elif recipe == "off_policy_distillation":
        run_off_policy(spec, settings)
    elif recipe == "decision_eval":
        asyncio.run(run_decision_eval(spec, settings))
    else:
        raise SystemExit(f"unknown recipe {recipe!r}")


def run_off_policy(spec: Spec, settings: dict[str, Any]) -> None:
    """distillation.train_off_policy (top-k soft targets from a teacher) on a local JSONL
    conversation file, through its Config, as its module docstring shows."""
    from tinker_cookbook.distillation import train_off_policy
    from tinker_cookbook.distillation.datasets import TeacherConfig
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    builder = FromConversationFileBuilder(
        file_path=spec["conversations"],
        common_config=ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=spec["model_name"], renderer_name=spec["renderer_name"],
            max_length=None, batch_size=settings.pop("batch_size")))
    teacher = TeacherConfig(base_model=spec["model_name"],
                            load_checkpoint_path=settings.pop("teacher_checkpoint"))
    config = train_off_policy.Config(
        dataset_configs=[train_off_policy.DatasetWithTeacher(dataset_builder=builder,
                                                             teacher_config=teacher)],
        model_name=spec["model_name"], recipe_name="recipe_distillation_off_policy",
        renderer_name=spec["renderer_name"], log_path=spec["log_path"],
        base_url=spec["base_url"], **settings)
    asyncio.run(train_off_policy.main(config))


async def run_decision_eval(spec: Spec, settings: dict[str, Any]) -> None:
    """recipes.decisions: sample_decision (one target_prompt_logprobs request per decision)
    before and after cross_entropy training on the correct choices (decision_choice_datums)."""
    import tinker
    from tinker_cookbook import model_info, renderers
    from tinker_cookbook.recipes.decisions.decision import (
        Decision,
        DecisionRenderer,
        sample_decision,
    )
    from tinker_cookbook.recipes.decisions.train import decision_choice_datums
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    model_name = spec["model_name"]
    renderer = renderers.get_renderer(model_info.get_recommended_renderer_name(model_name),
                                      get_tokenizer(model_name))
    decision_renderer = DecisionRenderer(renderer)
    examples = [(Decision(text=d["text"], choices=[tuple(c) for c in d["choices"]]), d["answer"])
                for d in settings["decisions"]]
    service = tinker.ServiceClient(base_url=spec["base_url"])
    training = await service.create_lora_training_client_async(base_model=model_name,
                                                               rank=settings["lora_rank"])

    async def target_probs() -> list[float]:
        sampler = await training.save_weights_and_get_sampling_client_async()
        results = await asyncio.gather(
            *(sample_decision(sampler, decision_renderer.render(d)) for d, _ in examples))
        return [r[answer] for r, (_, answer) in zip(results, examples, strict=True)]

    before = await target_probs()
    datums = decision_choice_datums(decision_renderer, examples)
    losses = []
    for _ in range(settings["steps"]):
        fwd = await training.forward_backward_async(datums, loss_fn="cross_entropy")
        opt = await training.optim_step_async(tinker.AdamParams(learning_rate=settings["learning_rate"]))
        losses.append((await fwd.result_async()).metrics["loss:sum"])
        await opt.result_async()
    after = await target_probs()
    Path(spec["log_path"]).mkdir(parents=True, exist_ok=True)
    (Path(spec["log_path"]) / "result.json").write_text(
        json.dumps({"before": before, "after": after, "losses": losses}))


def main() -> int:
    spec: Spec = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    install_local_datasets(spec.get("datasets", {}))
    register_local_tokenizer(spec["model_name"], spec["tokenizer_dir"])
    run(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
