"""The official tinker-cookbook (0.6.1, pinned in scripts/setup.sh) against a
real twinkle-server: each recipe runs unmodified from the installed package, in a subprocess
on the cookbook venv's python (.cookbook-venv, made by scripts/setup.sh), driven through its
own config objects by e2e_support/cookbook_driver.py with only the base_url, API key, model
name, local data and short settings changed. Offline: the tokenizer is the tiny model's,
the data are made here. Each test asserts its loss (or reward) moved the right way and prints
the figures.

The tiny model is served under the name MODEL_NAME, a model the cookbook knows, so the
cookbook picks the Qwen3 instruct renderer (no <think> block), whose chat tokens
(<|im_start|>, <|im_end|>) the tiny model's tokenizer has.

TWINKLE_COOKBOOK_LONG=1 adds the long run: math_rl (arithmetic env, default loss) for 100
steps against configs/default.yaml's settings.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e_support import configs, paths
from e2e_support.server import ServerProcess, launch, stop_all
from e2e_support.training import KEYS, auth_overrides
from e2e_support.waiting import scaled

COOKBOOK_PYTHON = paths.REPO_ROOT / ".cookbook-venv" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "e2e_support" / "cookbook_driver.py"
MODEL_NAME = "Qwen/Qwen3-4B-Instruct-2507"
RENDERER = "qwen3_instruct"
LONG = os.environ.get("TWINKLE_COOKBOOK_LONG") == "1"
RECIPE_TIMEOUT_S = 900.0


RL_LOOP_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
RL_LOOP_PREFIX = [  # recipes/rl_loop.py's few-shot turn, verbatim
    {"role": "user", "content": "How many r's are in strawberry?" + RL_LOOP_SUFFIX},
    {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t "
     "3) r 4) a 5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}"},
]
ARITHMETIC_PREFIX = [{"role": "user", "content": "What is 4 + 5?"},  # the arithmetic env's
                     {"role": "assistant", "content": "9"}]


def arithmetic_conversations(n: int, seed: int = 0, high: int = 4,
                             rl_loop_form: bool = True) -> list[dict[str, Any]]:
    """Sums of small numbers as chats, alternating between the arithmetic env's prompt (its
    few-shot turn) and rl_loop's (its few-shot turn and suffix); the answer is \\boxed{sum}
    in both: rl_loop grades only that form, and its last integer is what the env checks."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        x, y = rng.randint(0, high), rng.randint(0, high)
        if rl_loop_form and i % 2:
            turns = [*RL_LOOP_PREFIX, {"role": "user", "content": f"What is {x} + {y}?{RL_LOOP_SUFFIX}"},
                     {"role": "assistant", "content": f"\\boxed{{{x + y}}}"}]
        else:
            turns = [*ARITHMETIC_PREFIX, {"role": "user", "content": f"What is {x} + {y}?"},
                     {"role": "assistant", "content": f"\\boxed{{{x + y}}}"}]
        rows.append({"messages": turns})
    return rows


def gsm8k_rows(n: int, seed: int = 2, high: int = 4) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        x, y = rng.randint(0, high), rng.randint(0, high)
        rows.append({"question": f"What is {x} + {y}?", "answer": f"{x} + {y} = {x + y}\n#### {x + y}"})
    return rows


def hh_rows(n: int, seed: int = 3) -> list[dict[str, Any]]:
    """hh-rlhf's format: the chosen reply is the correct sum, the rejected one a wrong sum."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        x, y = rng.randint(0, 4), rng.randint(0, 4)
        prompt = f"\n\nHuman: What is {x} + {y}?\n\nAssistant:"
        rows.append({"chosen": f"{prompt} The answer is {x + y}.",
                     "rejected": f"{prompt} The answer is {x + y + 3}."})
    return rows


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def cookbook_server(server_bin: Path, tiny_model: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    if not COOKBOOK_PYTHON.is_file():
        pytest.fail(f"{COOKBOOK_PYTHON} is missing: run scripts/setup.sh (it makes the cookbook venv)",
                    pytrace=False)
    workdir = tmp_path_factory.mktemp("cookbook-server")
    overrides = auth_overrides(storage={"data_dir": str(workdir / "data")},
                               model={"path": str(tiny_model), "name": MODEL_NAME},
                               limits={"max_lora_rank": 128})
    if LONG:  # configs/default.yaml as it ships, on free ports, with a test tenant
        base = yaml.safe_load((paths.REPO_ROOT / "configs" / "default.yaml").read_text(encoding="utf-8"))
        overrides["server"] = {"grpc_port": 0, "http_port": 0}
    else:
        base = configs.base_config(tiny_model)
    config = configs.merged(base, overrides)
    config_path = configs.write_config(workdir / "twinkle.yaml", config)
    server = launch(server_bin, config_path, config, workdir)
    try:
        server.wait_ports(scaled(120.0))
        server.wait_health("SERVING", scaled(120.0))
        yield server
    finally:
        stop_all([server])


class Runner:
    def __init__(self, server: ServerProcess, model: Path, root: Path) -> None:
        self.server, self.model, self.root = server, model, root

    def run(self, recipe: str, settings: dict[str, Any], name: str | None = None,
            **extra: Any) -> Path:
        """Run a recipe; returns its log_path. Fails with the recipe's output on error."""
        name = name or recipe
        log_path = self.root / name
        spec = {"recipe": recipe, "base_url": f"http://{self.server.host}:{self.server.http_port}",
                "model_name": MODEL_NAME, "renderer_name": RENDERER,
                "tokenizer_dir": str(self.model), "log_path": str(log_path),
                "settings": settings, **extra}
        spec_path = self.root / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        env = dict(os.environ, TINKER_API_KEY=KEYS["alice"], HF_HUB_OFFLINE="1",
                   HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   HF_HOME=str(self.root / "hf-home"), PYTHONPATH="")
        result = subprocess.run([str(COOKBOOK_PYTHON), str(DRIVER), str(spec_path)],
                                capture_output=True, text=True, timeout=scaled(RECIPE_TIMEOUT_S),
                                env=env, cwd=self.root, check=False)
        assert result.returncode == 0, (f"{name} failed ({result.returncode}):\n"
                                        f"{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
        return log_path


def metrics(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line]


def series(rows: list[dict[str, Any]], key: str) -> list[float]:
    values = [float(r[key]) for r in rows if key in r]
    assert values, f"no {key!r} in metrics: {sorted({k for r in rows for k in r})}"
    return values


def checkpoint(log_path: Path, key: str, name: str = "final") -> str:
    rows = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    return next(r[key] for r in rows if r.get("name") == name and key in r)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def runner(cookbook_server: ServerProcess, tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Runner:
    return Runner(cookbook_server, tiny_model, tmp_path_factory.mktemp("cookbook-runs"))


@pytest.fixture(scope="module")
def sl_loop_run(runner: Runner) -> Path:
    """recipes/sl_loop.py on local "no_robots" rows (arithmetic chats). Its checkpoints are the
    warm starts and teachers of the other recipes: the random tiny model never earns a reward,
    and a teacher must differ from the student."""
    data = runner.root / "data"
    train = write_jsonl(data / "no_robots-train.jsonl", arithmetic_conversations(512))
    test = write_jsonl(data / "no_robots-test.jsonl", arithmetic_conversations(8, seed=1))
    return runner.run("sl_loop", {"batch_size": 16, "learning_rate": 1e-2, "save_every": 4,
                                  "max_steps": 24},
                      datasets={"HuggingFaceH4/no_robots": {"train": train, "test": test}})


def test_sl_loop(sl_loop_run: Path) -> None:
    nll = series(metrics(sl_loop_run), "train_mean_nll")
    print(f"sl_loop train_mean_nll: {[round(v, 4) for v in nll]}")
    assert len(nll) == 24
    assert mean(nll[-3:]) < mean(nll[:3]) - 1.0


def loss_fn_of(log_path: Path) -> str:
    """The loss the recipe trained with, from the config.json it writes (its default here)."""
    return str(json.loads((log_path / "config.json").read_text())["loss_fn"])


def test_rl_loop_default_loss(runner: Runner, sl_loop_run: Path) -> None:
    """recipes/rl_loop.py with its default loss (stable_reinforce in 0.6.1: sampling records
    stability info, datums carry provenance) on local "gsm8k" rows, resumed the recipe's own
    way (checkpoints.jsonl in its log_path) from sl_loop's final state."""
    log_path = runner.root / "rl_loop"
    log_path.mkdir(parents=True)
    row = next(json.loads(line) for line in (sl_loop_run / "checkpoints.jsonl").read_text().splitlines()
               if json.loads(line)["name"] == "final")
    (log_path / "checkpoints.jsonl").write_text(json.dumps(row) + "\n")
    steps, start = 8, int(row["batch"])  # rl_loop resumes at the checkpoint's batch
    train = write_jsonl(runner.root / "data" / "gsm8k-train.jsonl", gsm8k_rows(8 * (start + steps)))
    runner.run("rl_loop", {"batch_size": 8, "group_size": 8, "learning_rate": 1e-3,
                           "max_tokens": 16, "save_every": 0, "max_steps": start + steps},
               datasets={"openai/gsm8k:main": {"train": train}})
    reward = series(metrics(log_path), "reward/total")
    loss_fn = loss_fn_of(log_path)
    print(f"rl_loop ({loss_fn}) reward/total per step: {[round(v, 3) for v in reward]}")
    assert loss_fn == "stable_reinforce"
    assert len(reward) == steps
    if max(reward) < 0.05:
        pytest.xfail("the tiny model, warm-started by 24 sl_loop steps, almost never writes the right "
                     "\\boxed{sum} for a gsm8k-form question (mean reward < 0.05 at every step), so "
                     "nearly every advantage is 0 and rl_loop skips its steps: no signal to move "
                     "(docs/tinker_compat.md: a 96-step warm start on rl_loop's own form did not help)")
    assert mean(reward[-3:]) > mean(reward[:3])


def test_math_rl_arithmetic_default_loss(runner: Runner, sl_loop_run: Path) -> None:
    steps = 100 if LONG else 8
    log = runner.run("math_rl", {
        "env": "arithmetic", "load_checkpoint_path": checkpoint(sl_loop_run, "state_path", "000004"),
        "group_size": 4, "groups_per_batch": 16, "learning_rate": 3e-3, "max_tokens": 16,
        "max_steps": steps, "eval_every": 0, "save_every": 0,
        "behavior_if_log_dir_exists": "delete"})
    reward = series(metrics(log), "env/all/reward/total")
    loss_fn = loss_fn_of(log)
    print(f"math_rl ({loss_fn}) reward/total per step: {[round(v, 3) for v in reward]}")
    assert loss_fn == "stable_reinforce"
    assert len(reward) == steps
    k = max(2, steps // 5)
    assert mean(reward[-k:]) > mean(reward[:k])


def test_chat_sl(runner: Runner) -> None:
    """recipes/chat_sl/train.py with its own JSONL conversation-file dataset option."""
    data = write_jsonl(runner.root / "data" / "chat.jsonl", arithmetic_conversations(128, seed=4, rl_loop_form=False))
    log = runner.run("chat_sl", {"dataset": data, "batch_size": 16, "learning_rate": 1e-2,
                                 "save_every": 0, "eval_every": 0, "max_steps": 8,
                                 "behavior_if_log_dir_exists": "delete"})
    nll = series(metrics(log), "train_mean_nll")
    print(f"chat_sl train_mean_nll: {[round(v, 4) for v in nll]}")
    assert mean(nll[-2:]) < mean(nll[:2])


def test_dpo(runner: Runner) -> None:
    """recipes/preference/dpo/train.py on local "hh-rlhf" pairs (forward_backward_custom)."""
    data = runner.root / "data"
    train = write_jsonl(data / "hh-train.jsonl", hh_rows(64))
    test = write_jsonl(data / "hh-test.jsonl", hh_rows(8, seed=5))
    log = runner.run("dpo", {"dataset": "hhh", "batch_size": 8, "learning_rate": 1e-2,
                             "max_steps": 8, "behavior_if_log_dir_exists": "delete"},
                     datasets={"Anthropic/hh-rlhf": {"train": train, "test": test}})
    loss = series(metrics(log), "dpo_loss")
    print(f"dpo dpo_loss: {[round(v, 4) for v in loss]}")
    assert mean(loss[-2:]) < mean(loss[:2])


def test_on_policy_distillation_default_rank(runner: Runner, sl_loop_run: Path) -> None:
    """recipes/distillation/on_policy_distillation.py, lora_rank left at its default (128),
    teacher = sl_loop's final sampler checkpoint, prompts from local "tulu3" rows."""
    data = write_jsonl(runner.root / "data" / "tulu3.jsonl", arithmetic_conversations(64, seed=6, rl_loop_form=False))
    log = runner.run("on_policy_distillation", {
        "dataset": "tulu3", "teacher_model": MODEL_NAME,
        "teacher_checkpoint": checkpoint(sl_loop_run, "sampler_path"),
        "group_size": 4, "groups_per_batch": 8, "learning_rate": 1e-2, "max_tokens": 16,
        "max_steps": 6, "eval_every": 0, "save_every": 0,
        "behavior_if_log_dir_exists": "delete"},
        datasets={"allenai/tulu-3-sft-mixture": {"train": data}})
    rows = metrics(log)
    kl = series(rows, "teacher_kl")
    print(f"on_policy_distillation teacher_kl: {[round(v, 4) for v in kl]}")
    assert mean(kl[-2:]) < mean(kl[:2])


def test_off_policy_topk_distillation(runner: Runner, sl_loop_run: Path) -> None:
    """distillation/train_off_policy.py: top-20 soft targets from the teacher (2-D
    target_tokens/weights cross_entropy), on a local conversation file."""
    data = write_jsonl(runner.root / "data" / "off_policy.jsonl", arithmetic_conversations(64, seed=7, rl_loop_form=False))
    log = runner.run("off_policy_distillation", {
        "batch_size": 8, "learning_rate": 1e-2, "max_steps": 6, "save_every": 0, "eval_every": 0,
        "teacher_checkpoint": checkpoint(sl_loop_run, "sampler_path")}, conversations=data)
    rows = metrics(log)
    key = next(k for k in ("train/loss:mean", "train/loss:sum") if any(k in r for r in rows))
    loss = series(rows, key)
    print(f"off_policy top-k distillation {key}: {[round(v, 4) for v in loss]}")
    assert mean(loss[-2:]) < mean(loss[:2])


def test_decision_evaluator_target_prompt_logprobs(runner: Runner) -> None:
    """recipes/decisions: sample_decision scores every choice with one target_prompt_logprobs
    request; training on the right choices must raise their probability."""
    decisions = [{"text": f"What is {x} + {y}?",
                  "choices": [["right", str(x + y)], ["wrong", str(x + y + 2)], ["other", "no idea"]],
                  "answer": "right"} for x, y in [(1, 2), (3, 1), (2, 2), (0, 4)]]
    log = runner.run("decision_eval", {"decisions": decisions, "lora_rank": 32,
                                       "learning_rate": 1e-2, "steps": 6}, name="decisions")
    result = json.loads((log / "result.json").read_text())
    print(f"decisions: P(right) before {[round(p, 3) for p in result['before']]}, "
          f"after {[round(p, 3) for p in result['after']]}, CE loss {[round(v, 3) for v in result['losses']]}")
    assert mean(result["after"]) > mean(result["before"])
    assert result["losses"][-1] < result["losses"][0]
