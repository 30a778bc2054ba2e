"""ToolAgent with a real chat template: tool turns rendered by `apply_chat_template`, generated ids kept exactly.

A tiny byte-level BPE tokenizer is trained here and saved with `PreTrainedTokenizerFast.save_pretrained`
(a ChatML template, as Qwen's), then loaded back with `AutoTokenizer`; a fake server answers with fixed
token ids, so the test knows every id the policy "generated".
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncrl.engines.sample import Sample
from agents.tool_agent import ToolAgent
from asyncrl.engines.base import GenerateOutput, SamplingParams
from tests.unit.agents.scripted import tool_call

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CALL = "Let me compute. " + tool_call("calculator", expression="6*7")
FINAL = "The answer is 42."


def save_tokenizer(folder: Path, template: str | None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [CALL, FINAL, "user assistant tool system Q: 6*7? 42 expression calculator name arguments"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tok")
    chat = AutoTokenizer.from_pretrained(save_tokenizer(root / "chatml", CHATML))
    plain = AutoTokenizer.from_pretrained(save_tokenizer(root / "plain", None))
    assert chat.chat_template and not plain.chat_template
    return chat, plain


class FixedIdsLLM:
    """Answers the i-th call with `outputs[i]` (token ids, finish reason); log-prob of token j of call i: -(i+1)/100 - j/1e4."""

    def __init__(self, outputs: list[tuple[list[int], str]]) -> None:
        self.outputs, self.contexts = outputs, []

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None) -> GenerateOutput:
        i = len(self.contexts)
        self.contexts.append(list(prompt_ids))
        ids, finish = self.outputs[i]
        return GenerateOutput(request_id=f"r{i}", token_ids=list(ids), logprobs=[-(i + 1) / 100 - j / 1e4 for j in range(len(ids))],
                              versions=[i + 3] * len(ids), finish_reason=finish)


def agent_for(tok, **kw) -> ToolAgent:
    return ToolAgent(encode=lambda s: tok(s, add_special_tokens=False)["input_ids"],
                     decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                     reward_fn=lambda text, answer: float(answer in text), sampling=SamplingParams(max_tokens=200),
                     tools=["calculator"], tokenizer=tok, **kw)


def sample_for(tok) -> Sample:
    prompt = tok.apply_chat_template([{"role": "user", "content": "Q: 6*7?"}], tokenize=False, add_generation_prompt=True)
    return Sample(uid="s0", group_id="g", index_in_group=0, group_size=1, prompt_ids=ids(tok, prompt), answer="42")


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("closed", [True, False], ids=["turn_ends_with_im_end", "turn_cut_after_the_call"])
def test_tool_turn_is_rendered_by_the_template_and_generated_ids_stay_exact(tokenizers, closed):
    tok, _ = tokenizers
    end = tok.convert_tokens_to_ids("<|im_end|>")
    t1 = ids(tok, CALL) + ([end] if closed else [])
    t2 = ids(tok, FINAL) + [end]
    llm = FixedIdsLLM([(t1, "stop" if closed else "length"), (t2, "stop")])
    sample = sample_for(tok)
    traj = asyncio.run(agent_for(tok).run(sample, llm))

    assert traj.response_ids[: len(t1)] == t1 and traj.response_ids[-len(t2):] == t2  # the policy's ids, untouched
    tool = traj.response_ids[len(t1): -len(t2)]
    assert tok.decode(tool, skip_special_tokens=False) == ("" if closed else "<|im_end|>") + "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert traj.loss_mask == [1] * len(t1) + [0] * len(tool) + [1] * len(t2)
    assert traj.token_versions == [3] * len(t1) + [-1] * len(tool) + [4] * len(t2)
    assert traj.behavior_logprobs == pytest.approx([-0.01 - j / 1e4 for j in range(len(t1))] + [0.0] * len(tool)
                                                   + [-0.02 - j / 1e4 for j in range(len(t2))])
    # the second turn's context is exactly what the template renders for the conversation so far
    conversation = [{"role": "user", "content": "Q: 6*7?"}, {"role": "assistant", "content": CALL},
                    {"role": "tool", "content": "42"}]
    want = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert tok.decode(llm.contexts[1], skip_special_tokens=False) == want
    assert llm.contexts[1] == sample.prompt_ids + t1 + tool
    assert traj.reward == 1.0 and traj.meta["tool_tokens"] == len(tool) and traj.meta["stop"] == "done"


@pytest.mark.timeout(30)
def test_two_calls_in_one_turn_are_two_tool_messages(tokenizers):
    tok, _ = tokenizers
    end = tok.convert_tokens_to_ids("<|im_end|>")
    two = CALL + tool_call("calculator", expression="1+1")
    llm = FixedIdsLLM([(ids(tok, two) + [end], "stop"), (ids(tok, FINAL) + [end], "stop")])
    traj = asyncio.run(agent_for(tok).run(sample_for(tok), llm))
    n1 = len(ids(tok, two)) + 1
    tool = traj.response_ids[n1: n1 + traj.meta["tool_tokens"]]
    assert tok.decode(tool, skip_special_tokens=False) == \
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.timeout(30)
def test_without_a_template_the_hard_coded_markup_is_the_fallback(tokenizers):
    chat, plain = tokenizers
    for tok, agent in ((plain, agent_for(plain)), (chat, agent_for(chat, chat_template=False))):
        t1, t2 = ids(tok, CALL), ids(tok, FINAL)
        llm = FixedIdsLLM([(t1, "stop"), (t2, "stop")])
        traj = asyncio.run(agent.run(sample_for(chat), llm))
        assert traj.response_ids == t1 + ids(tok, "\n<tool_response>\n42\n</tool_response>\n") + t2
        assert "<|im_start|>" not in tok.decode(traj.response_ids, skip_special_tokens=False)


@pytest.mark.timeout(30)
def test_a_template_that_cannot_render_tool_messages_fails_at_construction(tokenizers):
    tok, _ = tokenizers
    strict = tok.__class__.from_pretrained(tok.name_or_path)
    strict.chat_template = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                            "{{ raise_exception('only user and assistant roles') }}{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match=r"agent\.kwargs\.chat_template: .*cannot render a tool turn.*only user and assistant"):
        agent_for(strict)
