"""GRPOAdvantage against a direct numpy computation; rewards; CompletionRewardMetric."""

from __future__ import annotations

import json
import re
import statistics

import numpy as np
import pytest

from twinkle.advantage import GRPOAdvantage
from twinkle.data_format import Message, Trajectory
from twinkle.metric import CompletionRewardMetric
from twinkle.preprocessor import CountdownProcessor, GSM8KProcessor, SelfCognitionProcessor
from twinkle.reward import FormatReward, GSM8KAccuracyReward, GSM8KFormatReward
from twinkle.reward.base import Reward


def reference_group(rewards, g):
    out = []
    for k in range(0, len(rewards), g):
        group = np.asarray(rewards[k:k + g], dtype=np.float32)
        out.extend((group - group.mean()) / (np.std(group, ddof=1) + 1e-8))
    return np.asarray(out, dtype=np.float32)


@pytest.mark.parametrize("g", [2, 4, 8])
def test_group_scale_matches_numpy(g):
    rng = np.random.default_rng(g)
    rewards = rng.integers(0, 3, size=6 * g).astype(float).tolist()
    got = GRPOAdvantage()(rewards, num_generations=g, scale="group")
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, reference_group(rewards, g), rtol=1e-6, atol=1e-6)
    assert isinstance(got.tolist(), list)


def test_zero_variance_groups_give_zero_and_batch_and_none_scales():
    rewards = [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    group = GRPOAdvantage()(rewards, num_generations=4)
    assert group[:4].tolist() == [0.0] * 4
    values = np.asarray(rewards, dtype=np.float32).reshape(-1, 4)
    centered = (values - values.mean(axis=1, keepdims=True)).reshape(-1)
    np.testing.assert_allclose(GRPOAdvantage()(rewards, num_generations=4, scale="none"), centered, atol=1e-7)
    batch_std = statistics.stdev(rewards)
    np.testing.assert_allclose(GRPOAdvantage()(rewards, num_generations=4, scale="batch"),
                               centered / (batch_std + 1e-8), rtol=1e-6)


def test_single_generation_and_multi_reward_and_errors():
    r = [0.5, 1.5, 2.5]
    np.testing.assert_allclose(GRPOAdvantage()(r, num_generations=1), r)
    np.testing.assert_allclose(GRPOAdvantage()(r, num_generations=1, scale="none"), [-1.0, 0.0, 1.0])
    np.testing.assert_allclose(GRPOAdvantage()(r, num_generations=1, scale="batch"), [-1.0, 0.0, 1.0], rtol=1e-6)
    matrix = [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]]
    weighted = GRPOAdvantage()(matrix, num_generations=2, reward_weights=[2.0, 1.0])
    np.testing.assert_allclose(weighted, reference_group([2.0, 0.0, 3.0, 1.0], 2), rtol=1e-6)
    with pytest.raises(ValueError, match="groups"):
        GRPOAdvantage()([1.0, 2.0, 3.0], num_generations=2)
    with pytest.raises(ValueError, match="scale"):
        GRPOAdvantage()([1.0, 2.0], num_generations=2, scale="bogus")


def completion(text, **user):
    t = Trajectory(messages=[Message(role="user", content="q"), Message(role="assistant", content=text)])
    if user:
        t["user_data"] = [(k, v) for k, v in user.items()]
    return t


def test_gsm8k_rewards():
    trajectories = [
        completion("<think>2+2</think>\n#### 4", ground_truth="4"),
        completion("so \\boxed{1,234}", ground_truth="1234"),
        completion("\\boxed{\\frac{1}{2}} hmm", ground_truth="\\frac{1}{2}"),
        completion("#### 5", ground_truth="4"),
        completion("no answer", ground_truth="4"),
        completion("#### 4"),
        completion("#### 3.50", ground_truth="3.5"),
    ]
    assert GSM8KAccuracyReward()(trajectories) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert GSM8KFormatReward()(trajectories, []) == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    # user_data after a JSON round trip (pairs become lists) and as dicts.
    round_tripped = json.loads(json.dumps(trajectories[0]))
    as_dict = {**trajectories[0], "user_data": [{"ground_truth": "4"}]}
    assert GSM8KAccuracyReward()([round_tripped, as_dict]) == [1.0, 1.0]


def test_format_reward_and_a_user_reward_from_the_guide():
    good = completion("<think>\nthinking\n</think> <answer>1 + 2 = 3</answer>")
    assert FormatReward()([good, completion("<answer>3</answer>"), Trajectory(messages=[])], []) == [1.0, 0.0, 0.0]

    class CountDownAccuracy(Reward):
        def __call__(self, trajectories, ground_truths):
            out = []
            for t in trajectories:
                text = t["messages"][-1]["content"]
                data = t.get("user_data", [{}])[0]
                eq = re.search(r"<answer>(.*?)</answer>", text).group(1).split("=")[0]
                out.append(1.0 if eval(eq, {"__builtins__": None}, {}) == data["target"] else 0.0)
            return out

    row = CountdownProcessor()({"nums": [1, 2], "target": 3})
    row["messages"].append(Message(role="assistant", content="<think>x</think><answer>1 + 2 = 3</answer>"))
    assert CountDownAccuracy()([row], []) == [1.0]


def test_preprocessors():
    row = SelfCognitionProcessor("Twinkle", "MS")({"query": "who is {{NAME}}", "response": "{{NAME}} by {{AUTHOR}}"})
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
    assert row["messages"][2]["content"] == "Twinkle by MS"
    g = GSM8KProcessor()({"question": "2+2?", "answer": "it is 4\n#### 1,004"})
    assert g["user_data"] == [("ground_truth", "1004")] and g["messages"][-1]["role"] == "user"
    c = CountdownProcessor()({"nums": [3, 5], "target": 8})
    assert c["user_data"] == [{"target": 8, "nums": [3, 5]}] and "[3, 5]" in c["messages"][1]["content"]


def test_completion_reward_metric():
    m = CompletionRewardMetric()
    m.accumulate(None, None, completion_lengths=[3, 5], rewards={"total": [1.0, 0.0], "format": [1.0, 1.0]})
    m.accumulate(completion_lengths=[4], rewards={"total": [1.0]}, generate_time=2.0)
    out = m.calculate()
    assert out["train/total_reward"] == pytest.approx(2 / 3)
    assert out["train/total_reward_std"] == pytest.approx(statistics.stdev([1.0, 0.0, 1.0]))
    assert out["train/format_reward_std"] == 0.0
    assert out["train/completion_length"] == 4.0
    assert out["profiling/Time taken: generate"] == 2.0
    m.reset()
    assert m.calculate() == {}
