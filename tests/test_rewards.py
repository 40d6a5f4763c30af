"""GRPO's rewards (`evaluation.rewards`): the built-in ones, a user's function named as a
module or a file, and a reward that fails or returns what is not one number a completion,
named with the function and the example in one line."""

import numpy as np
import pytest

from mtrain.data.prompts import PromptRecord
from mtrain.errors import ConfigError
from mtrain.evaluation import rewards


def record(**fields):
    return PromptRecord(where="prompts.jsonl:7", record=fields, prompt="q")


def test_the_built_in_rewards():
    gsm = rewards.answer_after()
    assert rewards.answer_after(marker="")({"answer": "God"}, [" God.", "Moses"]) == [1.0, 0.0]
    assert gsm({"answer": "1,234"}, ["so #### 1234.", "#### 1234 and more", "1234", "## 1234",
                                     "#### 12 #### 1,234"]) == [1.0, 0.0, 0.0, 0.0, 1.0]
    ends = rewards.matches(pattern=r"light\W*$")
    assert ends({}, ["let there be light.", "light of day", ""]) == [1.0, 0.0, 0.0]
    whole = rewards.matches(pattern=r"<think>.*</think>.*", whole=True)
    assert whole({}, ["<think>a\nb</think> 4", "4 <think></think>"]) == [1.0, 0.0]
    total, per = rewards.score([ends, lambda r, c: [0.5] * len(c)], [1.0, 2.0],
                               [record(), record()], [["light", "dark"], ["x", "light!"]])
    np.testing.assert_array_equal(total, [2.0, 1.0, 1.0, 2.0])
    assert per.shape == (2, 4) and rewards.name_of(ends) == "matches"


def broken(record, completions):
    raise ZeroDivisionError("division by zero")


@pytest.mark.parametrize("function, message", [
    (broken, r"reward broken raised ZeroDivisionError on prompts.jsonl:7: division by zero"),
    (lambda r, c: [1.0], r"returned 1 values for prompts.jsonl:7; it must return one number "
                         r"per completion \(2\)"),
    (lambda r, c: ["yes", "no"], r"returned 'yes' for prompts.jsonl:7"),
    (lambda r, c: [float("nan"), 0.0], r"returned nan for prompts.jsonl:7"),
    (lambda r, c: 1.0, r"returned float for prompts.jsonl:7"),
    (rewards.answer_after(), r"reward answer_after raised KeyError on prompts.jsonl:7: "
                             r"\"the record has no 'answer' field\""),
])
def test_a_reward_that_fails_names_itself_and_the_example(function, message):
    with pytest.raises(rewards.RewardError, match=message) as e:
        rewards.score([function], [1.0], [record(question="q")], [["a", "b"]])
    assert "\n" not in str(e.value)


def test_rewards_are_named_as_functions_or_files(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def short(record, completions):\n    return [float(len(c) < 5) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    by_module = rewards.resolve("my_rewards.short")
    by_file = rewards.resolve(f"{tmp_path / 'my_rewards.py'}:short")
    assert by_module({}, ["abc", "abcdef"]) == by_file({}, ["abc", "abcdef"]) == [1.0, 0.0]
    for name, why in (("my_rewards.long", "AttributeError"), ("nowhere.f", "ModuleNotFound"),
                      ("short", "module.function"), ("/no/such.py:f", "FileNotFound")):
        with pytest.raises(ConfigError, match=f"grpo.rewards: cannot load '{name}': .*{why}"):
            rewards.resolve(name)
