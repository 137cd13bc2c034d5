"""Multi-turn episodes (issue 29): the masked data shape, the environment interface, token in /
token out, tool calls, tokenization drift, and faults."""

import pytest
import torch

from unison.algorithms.anchors import OldLogp
from unison.algorithms.corrections import CORRECTIONS
from unison.algorithms.losses import AGGREGATIONS, LOSSES, aggregate
from unison.batch import Completion, collate
from unison.config import load_config
from unison.learner import Learner
from unison.mismatch import mismatch_metrics

# ----------------------------------------------------------------------- the data shape
# prompt | model turn 1 (EOS = 2) | environment reply | model turn 2
PROMPT, TURN1, OBS, TURN2 = [4, 40, 41], [50, 51, 2], [60, 61, 62], [52, 2]
MASK = [1] * len(TURN1) + [0] * len(OBS) + [1] * len(TURN2)


def _two_turn(obs=OBS, lp_obs=0.0):
    ids = TURN1 + obs + TURN2
    lps = [-1.0, -2.0, -0.5] + [lp_obs] * len(obs) + [-1.5, -0.2]
    return Completion(prompt_ids=list(PROMPT), token_ids=ids, logprobs=lps, finish_reason="stop", mask=list(MASK))


def test_collate_puts_exactly_the_models_tokens_in_the_response_mask():
    single = Completion(prompt_ids=[4, 40], token_ids=[50, 2], logprobs=[-1.0, -0.1], finish_reason="stop")
    b = collate([_two_turn(lp_obs=-9.0), single], pad_id=0)
    assert b.tokens[0].tolist() == PROMPT + TURN1 + OBS + TURN2  # the ids sampled, turn by turn
    assert b.response_mask[0].tolist() == [0, 0, 0] + MASK
    assert b.response_mask[1].tolist() == [0, 0, 1, 1] + [0] * 7
    assert b.logp_mu[0, 6:9].tolist() == [0.0, 0.0, 0.0]  # nothing claims a log μ for an observation
    assert b.attention_mask[0].sum() == 11  # the observation is context for turn 2
    assert b.response_lens.tolist() == [5, 2] and b.num_response_tokens == 7
    with pytest.raises(ValueError, match="mask"):
        Completion(prompt_ids=[1], token_ids=[2, 3], logprobs=[0.0, 0.0], finish_reason="stop", mask=[1])


def test_metrics_corrections_and_losses_ignore_the_observation_tokens():
    """Junk log-probs on the observation positions change nothing: no metric, correction, loss or
    normaliser sees them (and the model's tokens do move them: the check can fail)."""
    b = collate([_two_turn(), _two_turn()], pad_id=0)
    m = b.response_mask
    torch.manual_seed(0)
    old = b.logp_mu + 0.1 * torch.randn(b.logp_mu.shape)
    junk_old, junk_mu = old.clone(), b.logp_mu.clone()
    obs = torch.zeros_like(m, dtype=torch.bool)
    obs[:, 6:9] = True
    junk_old[obs], junk_mu[obs] = 7.0, -30.0
    assert mismatch_metrics(old, b.logp_mu, m) == mismatch_metrics(junk_old, junk_mu, m)
    moved = old.clone()
    moved[:, 3] += 0.5  # a model token
    assert mismatch_metrics(moved, b.logp_mu, m)["mismatch/k3"] != mismatch_metrics(old, b.logp_mu, m)["mismatch/k3"]
    for name, fn in CORRECTIONS.items():
        w1, c1 = fn(old, b.logp_mu, m)
        w2, c2 = fn(junk_old, junk_mu, m)
        assert torch.equal(w1 * m, w2 * m) and c1 == c2, name
    adv = torch.tensor([1.0, -0.5])
    for name, fn in LOSSES.items():
        for agg in AGGREGATIONS:
            logp = old.clone().requires_grad_(True)
            per_tok, _ = fn(logp, old, b.logp_mu, adv, torch.ones_like(m), m)
            loss = aggregate(per_tok, agg, m, int(m.sum()), 2, 8)
            loss.backward()
            assert torch.all(logp.grad[obs] == 0), (name, agg)  # observation tokens get no gradient
            assert logp.grad[m.bool()].abs().sum() > 0, (name, agg)
    # token_mean normalises by the model's 10 tokens, not the 16 of the response spans
    per_tok = torch.where(m.bool(), torch.ones_like(m), torch.zeros_like(m))
    assert float(aggregate(per_tok, "token_mean", m, int(m.sum()), 2, 8)) == 1.0


def test_the_learners_update_takes_the_gradient_of_the_models_tokens_only(tiny_dir):
    """A hand-built two-turn batch through Learner.train: the gradient equals the one computed by
    hand from the model's tokens alone (an on-policy PPO step: −A ∇ mean log π over model tokens),
    and differs from the one that would also score the observation."""
    cfg = load_config(None, ["train.grad_clip=1e9", "train.micro_batch_tokens=4", "algo=grpo",
                             "policy.loss_agg=token_mean", "train.grad_noise=false"])
    learner = Learner.from_config(cfg, tiny_dir)
    b = collate([_two_turn(), _two_turn(obs=[63, 64, 65])], pad_id=0)
    b.advantages = torch.tensor([1.0, -2.0])
    grads = {}

    def capture():
        grads.update({n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None})

    learner.opt.step = capture
    ref_model = learner.model
    before = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    learner.train(b, OldLogp("fused"), torch.ones_like(b.response_mask), lr=1e-3)
    assert all(torch.equal(before[n], p) for n, p in ref_model.named_parameters())  # the step was captured

    def hand(mask):
        ref_model.zero_grad(set_to_none=True)
        logits = ref_model(input_ids=b.tokens, attention_mask=b.attention_mask).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, b.tokens[:, 1:, None]).squeeze(-1)
        lp = torch.nn.functional.pad(lp, (1, 0))
        loss = -(lp * b.advantages[:, None] * mask).sum() / mask.sum()
        loss.backward()
        return {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None}

    want = hand(b.response_mask)
    for n, g in grads.items():
        torch.testing.assert_close(g, want[n], rtol=1e-3, atol=1e-6)
    with_obs = hand(b.attention_mask.float() * (torch.arange(b.tokens.shape[1]) >= 3))
    assert any((with_obs[n] - g).abs().max() > 1e-5 for n, g in grads.items())
    # the score pass gives log π on the model's tokens and exactly 0 on the observation
    lp = learner.score(b)
    assert torch.all(lp[:, 6:9] == 0) and torch.all(lp[b.response_mask.bool()] < 0)


# ----------------------------------------------------------------------- episodes, token in / token out
import json  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

from unison.chat import ChatTemplate, ToolCall, ToolCallError, parse_hermes, parse_llama3_json, parse_pythonic  # noqa: E402
from unison.errors import UnisonError  # noqa: E402
from unison.models import load_tokenizer  # noqa: E402
from unison.rollout import SamplingParams, generate  # noqa: E402
from unison.tasks import make_reward, make_task  # noqa: E402

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
CALC = ["task.name=calculator", "task.train_size=24", "task.eval_size=4", "task.operators=[\"*\"]"]


class Scripted:
    """A rollout engine that answers from a script ``reply(prompt_text) -> text`` (EOS appended, log μ
    −0.5 per token) and records every prompt it was given, call by call."""

    name, pad_id, eos_ids, dp_rank, dp_size = "scripted", 0, [2], 0, 1

    def __init__(self, tok, reply):
        self.tok, self.reply, self.calls = tok, reply, []

    def generate(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        out = []
        for i, p in enumerate(prompts):
            ids = list(self.tok(self.reply(self.tok.decode(p)), add_special_tokens=False)["input_ids"]) + [2]
            fin = "stop" if len(ids) <= params.max_tokens else "length"
            ids = ids[:params.max_tokens]
            out.append(Completion(prompt_ids=list(p), token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=fin,
                                  prompt_index=i // params.n, sample_index=i % params.n))
        return out


def _calc_reply(text):
    """Call calc on the question, then answer with what it returned."""
    if "</s>T:" in text:
        return text.split("</s>T:")[-1].split("\n")[0]
    return f'[calc(expression="{text.split("U:")[-1].splitlines()[0]}")]'


def _calc_task(tiny_dir, *extra):
    cfg = load_config(None, CALC + list(extra))
    task = make_task(cfg.task)
    tok = load_tokenizer(tiny_dir)
    task.prepare(tok, "builtin:tiny")
    return cfg, task, tok


def test_an_episode_appends_the_sampled_ids_and_the_templates_ids_for_the_new_messages_only(tiny_dir):
    cfg, task, tok = _calc_task(tiny_dir)
    eng = Scripted(tok, _calc_reply)
    items = task.train[:3]
    comps = generate(eng, task.episodes(items), SamplingParams(n=2, max_tokens=40, seed=1))
    assert len(eng.calls) == 2 and [len(c) for c in eng.calls] == [6, 6]  # one generate call per turn, batched
    ids = lambda s: list(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    for k, c in enumerate(comps):
        item = items[c.prompt_index]
        first = ids(f"S:tools calc(expression)\nU:{item.prompt}\nA:")
        call = ids(f'[calc(expression="{item.prompt}")]') + [2]
        obs = ids(f"T:{item.answer}\nA:")  # after </s> (the model's EOS is the template's closing): tool result
        answer = ids(item.answer) + [2]
        assert c.prompt_ids == first == eng.calls[0][k]
        assert eng.calls[1][k] == first + call + obs  # turn 2's prompt: turn 1's ids + sampled + appended
        assert c.token_ids == call + obs + answer  # the learner trains on exactly these, turn by turn
        assert c.mask == [1] * len(call) + [0] * len(obs) + [1] * len(answer)
        assert c.logprobs == [-0.5] * len(call) + [0.0] * len(obs) + [-0.5] * len(answer)
        ep = c.episode
        assert (ep.turns, ep.tool_calls, ep.tool_errors, ep.end, ep.reward) == (2, 1, 0, "done", 1.0)
        assert ep.segments == [(0, len(call), "model"), (len(call), len(call) + len(obs), "env"),
                               (len(call) + len(obs), len(c.token_ids), "model")]
        assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "assistant"]
    assert [(c.prompt_index, c.sample_index) for c in comps] == [(j, s) for j in range(3) for s in range(2)]
    reward = make_reward(task, cfg.task)
    assert reward.score_completions(comps, items, tok) == [1.0] * 6 and reward.calls == 6
    b = collate(comps, 0)
    assert b.group_ids.tolist() == [0, 0, 1, 1, 2, 2]  # n episodes per item: a GRPO group


def test_each_turn_is_seeded_per_episode_whatever_the_batch(tiny_dir):
    """Episode j's turns use the same seeds alone or among others (the engines' batch invariance)."""
    cfg, task, tok = _calc_task(tiny_dir)
    from unison.rollout import make_engine

    eng = make_engine("native", tiny_dir, torch.float32)
    p = SamplingParams(n=2, max_tokens=12, seed=5, prompt_seeds=(11, 12))
    both = generate(eng, task.episodes(task.train[:2]), p)
    alone = generate(eng, task.episodes(task.train[1:2]), SamplingParams(n=2, max_tokens=12, seed=5, prompt_seeds=(12,)))
    assert [c.token_ids for c in both[2:]] == [c.token_ids for c in alone]
    assert both[0].token_ids != both[1].token_ids  # the group's samples differ


@pytest.mark.parametrize("reply,error", [
    ('[nope(expression="1")]', "unknown tool 'nope'; the tools are calc"),
    ('[calc(expr="12")]', "calc: missing a required argument: 'expression'"),
    ('[calc(expression="12"]', "the tool call is not valid"),
])
def test_a_tool_call_the_model_got_wrong_is_answered_and_counted(tiny_dir, reply, error):
    cfg, task, tok = _calc_task(tiny_dir, "task.max_turns=2")
    c = generate(Scripted(tok, lambda t: reply if "</s>T:" not in t else "7"), task.episodes(task.train[:1]),
                 SamplingParams(n=1, max_tokens=40))[0]
    ep = c.episode
    assert ep.messages[2]["role"] == "tool" and ep.messages[2]["content"].startswith("error: ")
    assert error in ep.messages[2]["content"], ep.messages[2]
    assert (ep.tool_calls, ep.tool_errors, ep.error, ep.turns, ep.reward) == (1, 1, None, 2, 0.0)


def test_the_parsers_read_every_supported_template_back(tiny_dir):
    """Each real template renders a call; the format unison detects reads exactly that call back."""
    tok = load_tokenizer(tiny_dir)
    from unison.chat import BUILTIN_TEMPLATES, _PROBE_TOOL

    want = {"Qwen-Qwen3-0.6B.jinja": "hermes", "vllm-tool_chat_template_hermes.jinja": "hermes",
            "meta-llama-Llama-3.2-3B-Instruct.jinja": "llama3_json",
            "vllm-tool_chat_template_llama4_pythonic.jinja": "pythonic", "SmolLM2-135M-Instruct-gguf.jinja": None}
    for name, fmt in want.items():
        t = ChatTemplate(tok, (TEMPLATES / name).read_text(), [_PROBE_TOOL])
        assert t.detect_format() == fmt, name
    for name, fmt in [("tiny", "pythonic"), ("chatml-tools", "hermes")]:
        t = ChatTemplate(tok, BUILTIN_TEMPLATES[name], [_PROBE_TOOL]).prepare()
        assert t.format == fmt
        calls = [ToolCall("calc", {"expression": "12*34"}), ToolCall("probe_tool", {"text": "a \"quoted\" word"})]
        assert t.parse(t.call_text(calls)) == calls  # several calls in one turn, quotes escaped
    # the formats as models write them, by hand
    assert parse_hermes('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>') == [ToolCall("f", {"a": 1})]
    assert parse_hermes('<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": "x"}}]</tool_call>') \
        == [ToolCall("f", {}), ToolCall("g", {"b": "x"})]  # SmolLM2's list
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>') == [ToolCall("f", {"a": 2})]
    assert parse_llama3_json('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}') \
        == [ToolCall("f", {"a": 1}), ToolCall("g", {})]
    assert parse_pythonic('[f(a=1, b="x"), g()]') == [ToolCall("f", {"a": 1, "b": "x"}), ToolCall("g", {})]
    for text in ("The answer is 42.", "[1, 2]", "{not a call", "4"):  # answers, not calls
        assert parse_hermes(text) is None and parse_pythonic(text) is None
    assert parse_llama3_json("The answer is 42.") is None
    for bad, parse in [("<tool_call>{oops}</tool_call>", parse_hermes), ("<tool_call>{}", parse_hermes),
                       ('{"name": "f", "parameters": {}} trailing', parse_llama3_json), ("[f(1)]", parse_pythonic),
                       ("[f(a=g())]", parse_pythonic), ('<tool_call>{"arguments": {}}</tool_call>', parse_hermes)]:
        with pytest.raises(ToolCallError):
            parse(bad)


def test_the_prefix_preserving_check_on_a_template_that_is_and_one_that_is_not(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    from unison.chat import BUILTIN_TEMPLATES, _PROBE_TOOL

    for name in ("meta-llama-Llama-3.2-3B-Instruct.jinja", "vllm-tool_chat_template_hermes.jinja"):
        ChatTemplate(tok, (TEMPLATES / name).read_text(), [_PROBE_TOOL], name).prepare()
    ChatTemplate(tok, (TEMPLATES / "SmolLM2-135M-Instruct-gguf.jinja").read_text(), None).prepare()
    for t in BUILTIN_TEMPLATES.values():
        ChatTemplate(tok, t, [_PROBE_TOOL]).prepare()
    qwen3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    for tools in ([_PROBE_TOOL], None):  # drops the <think> of earlier turns: refused, with or without tools
        with pytest.raises(UnisonError, match=r"chat template of model Qwen3 is not prefix-preserving.*"
                                              r"set task.chat_template"):
            ChatTemplate(tok, qwen3, tools, "Qwen3").prepare()
    # the same template without the rewrite passes: the check tests what it claims
    keeps = qwen3.replace("{%- if '</think>' in message.content %}", "{%- if false %}").replace(
        "{%- if loop.last or (not loop.last and reasoning_content) %}", "{%- if false %}")
    ChatTemplate(tok, keeps, [_PROBE_TOOL], "Qwen3-kept").prepare()
