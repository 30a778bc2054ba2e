"""Math rewards as verl users expect them: GSM8K strict `####`, MATH `\\boxed{}` with LaTeX normalisation,
no "last number in the text" fallback, unknown keyword arguments an error, rewards picked by `data_source`."""

from __future__ import annotations

import dataclasses

import pytest

from agents.rewards import RewardArgumentError, get_reward, reward_for_source
from agents.rewards.gsm8k import gsm8k
from agents.rewards.latex import equivalent
from agents.rewards.math import math_answer, math_boxed

COUNTING = " ".join(str(i) for i in range(42, 100))  # "42 43 44 ... 99"


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "response, truth, expected",
    [("so she sold 72 clips.\n#### 72", "72", 1.0),
     ("#### 1,000", "#### 1000", 1.0),  # GSM8K's own solution as the reference
     ("#### $18.0", "18", 1.0),
     ("first #### 5 then #### 7", "7", 1.0),  # the last marker counts
     ("first #### 7 then #### 5", "7", 0.0),
     ("The answer is \\boxed{72}", "72", 0.0),  # strict: a boxed answer is not GSM8K's format
     ("the answer is 72", "72", 0.0),
     ("#### seventy-two", "72", 0.0)],
)
def test_gsm8k_is_strict(response, truth, expected):
    assert gsm8k(response, truth)[0] == expected


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "pred, ref",
    [("\\frac{1}{2}", "0.5"), ("\\dfrac{1}{2}", ".5"), ("1/2", "\\frac12"), ("-\\frac{3}{4}", "-0.75"),
     ("\\left( 1, \\frac{1}{2} \\right)", "(1,0.5)"), ("\\text{(B)}", "(B)"), ("5\\text{ cm}", "5"),
     ("90^\\circ", "90"), ("90^{\\circ}", "90.0"), ("\\$5", "5"), ("$x = 3$", "3"), ("7.00", "7"), ("1,000", "1000"),
     ("\\sqrt{2}", "\\sqrt{ 2 }")],
)
def test_equivalent_answers(pred, ref):
    assert equivalent(pred, ref) and equivalent(ref, pred)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("pred, ref", [("12", "13"), ("\\frac{1}{3}", "0.33"), ("(1,2)", "[1,2]"), ("(1,2)", "(1,2,3)"),
                                       ("", ""), ("2+3", "5"), ("1.05", "1")])
def test_different_answers(pred, ref):
    assert not equivalent(pred, ref)


@pytest.mark.timeout(10)
def test_math_scores_the_last_boxed_answer():
    assert math_boxed("so $x = \\boxed{\\frac{1}{2}}$.", "0.5") == (1.0, {"extracted": True})
    assert math_boxed("\\boxed{3} no wait \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}")[0] == 1.0
    assert math_boxed("\\boxed{\\frac{1}{2}} no wait \\boxed{3}", "\\frac{1}{2}")[0] == 0.0
    assert math_boxed("the answer is \\boxed 5$.", "5")[0] == 1.0
    assert math_boxed("hence \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)")[0] == 1.0
    assert math_boxed("x = 0.5", "\\boxed{\\frac{1}{2}}") == (0.0, {"extracted": False})  # nothing boxed
    assert math_boxed("\\boxed{0.5}", "The solution ... so \\boxed{\\frac12}")[0] == 1.0  # a full solution as reference


@pytest.mark.timeout(10)
def test_no_reward_falls_back_to_the_last_number():
    for fn in (math_answer, gsm8k, math_boxed):
        assert fn(COUNTING, "99")[:2] == (0.0, {"extracted": False, **({"exact": False} if fn is gsm8k else {})}), fn.__name__
        assert fn(COUNTING, "#### 99")[0] == 0.0
    assert math_answer("so #### 99", "99")[0] == 1.0 and math_answer("\\boxed{99}", "#### 99")[0] == 1.0


@pytest.mark.timeout(10)
def test_gsm8k_format_score_is_verls_and_exact_stays_the_accuracy():
    assert gsm8k("7 + 3 = 10\n#### 10", "#### 10") == (1.0, {"extracted": True, "exact": True})
    assert gsm8k("7 + 3 = 11\n#### 11", "#### 10", format_score=0.1) == (0.1, {"extracted": True, "exact": False})
    assert gsm8k("the answer is 10", "#### 10", format_score=0.1) == (0.0, {"extracted": False, "exact": False})
    assert gsm8k("#### 10", "10", format_score=0.1, score=2.0)[0] == 2.0


@pytest.mark.timeout(10)
def test_unknown_keyword_arguments_are_an_error_naming_the_reward():
    for name in ("gsm8k", "math", "math_answer"):
        with pytest.raises(TypeError, match=rf"reward {name!r}: .*'tolerance'"):
            get_reward(name, tolerance=0.1)
        with pytest.raises(TypeError, match="got an unexpected keyword argument"):
            get_reward(name)("#### 1", "1", tolerance=0.1)
    with pytest.raises(ValueError):  # a RewardArgumentError is a ValueError too: config checks turn it into a ConfigError
        get_reward("gsm8k", tolerance=0.1)
    assert issubclass(RewardArgumentError, TypeError)
    assert get_reward("reward_model", url="http://127.0.0.1:9/score").keywords == {"url": "http://127.0.0.1:9/score"}


@pytest.mark.timeout(30)
def test_make_agent_turns_a_bad_reward_kwarg_into_a_config_error():
    from asyncrl.config import AgentConfig, ConfigError
    from asyncrl.engines.base import SamplingParams
    from asyncrl.rollout.host_spec import make_agent

    agent = dataclasses.asdict(AgentConfig(reward_kwargs={"tolerance": 0.1}))
    with pytest.raises(ConfigError, match=r"^agent\.reward: reward 'gsm8k': .*'tolerance'"):
        make_agent(agent, "gsm8k", lambda s: [1], lambda ids: "", SamplingParams())


@pytest.mark.timeout(10)
def test_data_sources_map_to_rewards():
    assert {s: reward_for_source(s) for s in ("openai/gsm8k", "gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                                               "math", "nope")} == {
        "openai/gsm8k": "gsm8k", "gsm8k": "gsm8k", "lighteval/MATH": "math", "DigitalLearningGmbH/MATH-lighteval": "math",
        "math": "math", "nope": None}
    assert get_reward(reward_for_source("lighteval/MATH"))("\\boxed{\\frac{1}{2}}", "0.5")[0] == 1.0
