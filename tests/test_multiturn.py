"""Multi-turn episodes (issue 29): the masked data shape, the environment interface, token in /
token out, tool calls, tokenization drift, and faults."""

import math

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
    # the score pass gives log π on the model's tokens and exactly 0 on the observation; packed rows agree
    lp = learner.score(b)
    assert torch.all(lp[:, 6:9] == 0) and torch.all(lp[b.response_mask.bool()] < 0)
    learner.packing = True
    torch.testing.assert_close(learner.score(b), lp, rtol=0, atol=1e-5)


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


class Recording:
    """Wraps an engine; keeps every call's prompts and the completions it returned."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, params):
        out = self.engine.generate(prompts, params)
        self.calls.append(([list(p) for p in prompts], [list(c.token_ids) for c in out]))
        return out


def test_the_native_engines_turns_chain_token_in_token_out(echo):
    """The real engine (the random tiny model, every turn told "again"): each turn's prompt is the previous
    prompt + what the engine returned + the template's ids for the reply; the completion is exactly that."""
    from unison.rollout import make_engine
    from unison.tasks.env import EnvTask

    cfg = load_config(None, RUN)
    task = EnvTask(cfg.task)
    from unison.models import builtin_model_dir

    tok = load_tokenizer(builtin_model_dir("tiny"))
    task.prepare(tok)
    eng = Recording(make_engine("native", builtin_model_dir("tiny"), torch.float32))
    comps = generate(eng, task.episodes(task.train[:2]), SamplingParams(n=2, max_tokens=8, seed=3))
    assert len(eng.calls) == 3  # max_turns, all episodes live (the environment always asks again)
    again = list(tok("U:again\nA:", add_special_tokens=False)["input_ids"])
    for k, c in enumerate(comps):
        want = list(eng.calls[0][0][k])
        for turn, (prompts, outs) in enumerate(eng.calls):
            assert prompts[k] == want  # sent exactly the ids built so far
            want = want + outs[k] + (([] if outs[k][-1] == 2 else [2]) + again if turn < 2 else [])  # </s> closes
        assert c.prompt_ids + c.token_ids == want
        assert [x for x, m in zip(c.token_ids, c.mask) if m] == [t for _, outs in eng.calls for t in outs[k]]


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
                       ("[f(a=g())]", parse_pythonic), ("[f(a=1", parse_pythonic), ('<tool_call>{"arguments": {}}</tool_call>', parse_hermes)]:
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


def test_turn_and_token_budgets_truncate_the_episode(tiny_dir):
    cfg, task, tok = _calc_task(tiny_dir, "task.max_turns=1")
    c = generate(Scripted(tok, _calc_reply), task.episodes(task.train[:1]), SamplingParams(n=1, max_tokens=40))[0]
    assert (c.finish_reason, c.episode.end, c.episode.turns, c.episode.tool_calls) == ("length", "max_turns", 1, 1)
    assert make_reward(task, cfg.task).score_completions([c], task.train[:1], tok) == [0.0]  # task.truncated_reward
    assert c.mask == [1] * len(c.token_ids)  # nothing is appended after the last turn
    cfg, task, tok = _calc_task(tiny_dir, "task.max_episode_tokens=30")  # the call (22) fits, its result does not
    c = generate(Scripted(tok, _calc_reply), task.episodes(task.train[:1]), SamplingParams(n=1, max_tokens=40))[0]
    assert (c.finish_reason, c.episode.end) == ("length", "episode_tokens") and len(c.token_ids) <= 30
    # a turn cut at the per-turn budget still reaches the environment (here: a wrong answer, the episode ends)
    c = generate(Scripted(tok, lambda t: "9" * 50), task.episodes(task.train[:1]), SamplingParams(n=1, max_tokens=8))[0]
    assert (c.finish_reason, c.episode.end, c.episode.cut_turns, c.episode.reward) == ("stop", "done", 1, 0.0)
    assert c.token_ids == [tok.convert_tokens_to_ids("9")] * 8 and c.episode.messages[-1]["content"] == "9" * 8
    # a cut tool call is answered like any unreadable one, then the template's whole closing follows it
    cfg, task, tok = _calc_task(tiny_dir)
    c = generate(Scripted(tok, lambda t: _calc_reply(t) if "</s>T:" in t else '[calc(expression="1234567890'),
                 task.episodes(task.train[:1]), SamplingParams(n=1, max_tokens=12))[0]
    ep = c.episode
    assert (ep.cut_turns, ep.tool_errors, ep.turns) == (2, 1, 2) and ep.messages[2]["content"].startswith("error: ")
    obs = c.token_ids[12:ep.segments[1][1]]
    assert tok.decode(obs, skip_special_tokens=False).startswith("</s>T:error: ")  # closing + the tool's answer


# ----------------------------------------------------------------------- runs: faults and bad input
ENV = textwrap.dedent('''
    import os
    import signal
    from pathlib import Path


    def shout(word: str) -> str:
        """Upper-case a word.

        Args:
            word: the word to shout
        """
        if word == "boom":
            raise RuntimeError("the tool exploded")
        return word.upper()


    class EchoEnv:
        """Say the target word back; every other turn is told to try again (reward: length / 10)."""

        tools = [shout]

        def reset(self, item):
            if os.environ.get("ECHO_RAISE"):
                raise KeyError("the environment broke")
            if item.get("bad"):
                raise ValueError("this row has no target")
            self.target = item["target"]
            return [{"role": "user", "content": "say " + item["target"]}]

        def step(self, text):
            if os.environ.get("ECHO_RAISE"):
                raise KeyError("the environment broke")
            kill = os.environ.get("ECHO_KILL_AFTER")  # SIGKILL mid-episode once that checkpoint exists
            if kill and Path(kill).exists() and not Path(kill + ".killed").exists():
                Path(kill + ".killed").write_text("")
                os.kill(os.getpid(), signal.SIGKILL)
            if text.strip() == self.target:
                return [], 1.0, True
            return [{"role": "user", "content": "again"}], len(text) / 10, False
''')
RUN = ["task.name=env", "task.env=echo_env:EchoEnv", "task.path=data.jsonl", "task.eval_size=0", "task.max_turns=3",
       "task.max_episode_tokens=48", "task.truncated_reward=null", "rollout.n=2", "rollout.max_new_tokens=8",
       "train.prompts_per_step=2", "train.lr=1e-3", "log.console=false", "log.tensorboard=false"]


@pytest.fixture()
def echo(tmp_path, monkeypatch):
    (tmp_path / "echo_env.py").write_text(ENV)
    rows = [{"target": w} for w in ("ab", "cd", "ef", "gh", "ij", "kl", "mn", "op")]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.yaml").write_text("seed: 0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _train(out, *extra, steps=3, resume=False, log=lambda m: None):
    from unison.trainer import Trainer

    return Trainer(load_config(None, RUN + [f"train.steps={steps}", *extra]), out, resume=resume, log=log)


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/"))} for r in rows]


def test_an_env_run_logs_its_episodes_turn_by_turn(echo):
    from unison.data_io import read_metrics

    _train(echo / "run", "log.rollouts=true", "mismatch.decompose_every=1").fit()
    rows = read_metrics(echo / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 1 <= r["rollout/turns_mean"] <= 3 and r["rollout/tool_errors"] >= 0
        assert r["mismatch/k3"] < 1e-9 and r["mismatch/retokenize_fraction"] >= 0
        assert r["response_length/max"] <= 3 * 8  # model tokens only
    logged = [json.loads(x) for x in (echo / "run" / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert len(logged) == 4
    for x in logged:
        assert [t["by"] for t in x["turns"]][0] == "model" and {t["by"] for t in x["turns"]} <= {"model", "env"}
        assert sum(len(t["token_ids"]) for t in x["turns"]) == len(x["token_ids"])
        assert x["messages"][0] == {"role": "user", "content": "say " + x["messages"][0]["content"][4:]}
    assert "## Episodes (step 3, turn by turn)" in (echo / "run" / "report.md").read_text()


@pytest.mark.parametrize("replay", [True, False])
def test_multi_turn_with_top_p_replays_the_support_of_every_model_turn(echo, replay):
    """Sampling-mask replay turn by turn: with replay the ledger's decode term and the whole mismatch stay at fp32
    rounding (before the support was carried through episodes, decode k3 was ~5e-3 on every step); without it
    the mismatch is exactly the truncation term, −log(kept mass) per token, and the decode term still rounding."""
    from unison.data_io import read_metrics

    _train(echo / "run", "rollout.top_p=0.7", "mismatch.decompose_every=1",
           f"rollout.replay_sampling_mask={str(replay).lower()}", steps=2).fit()
    for r in read_metrics(echo / "run" / "metrics.jsonl"):
        assert r["ledger/decode_k3"] < 1e-9 and r["ledger/engine_k3"] < 1e-9
        if replay:
            assert r["mismatch/k3"] < 1e-9 and "ledger/truncation_k1" not in r
        else:
            assert r["ledger/truncation_k1"] > 1e-3  # mean −log S over the model's tokens
            assert r["ledger/total_k1"] == pytest.approx(r["ledger/truncation_k1"], abs=1e-6)


def test_the_rollout_log_and_the_report_show_whose_tokens_each_turn_holds(tmp_path, tiny_dir):
    from unison.report import episodes_section
    from unison.runlog import RunLog

    cfg, task, tok = _calc_task(tiny_dir)
    comps = generate(Scripted(tok, _calc_reply), task.episodes(task.train[:1]), SamplingParams(n=1, max_tokens=40))
    RunLog(tmp_path, cfg, True).rollouts(7, comps, [1.0], tok)
    row = json.loads((tmp_path / "rollouts" / "step_000007.jsonl").read_text())
    item = task.train[0]
    assert [(t["by"], t["text"]) for t in row["turns"]] == [
        ("model", f'[calc(expression="{item.prompt}")]</s>'), ("env", f"T:{item.answer}\nA:"),
        ("model", f"{item.answer}</s>")]
    assert row["turns"][0]["logp_mu_sum"] == -0.5 * len(row["turns"][0]["token_ids"]) and "logp_mu_sum" not in row["turns"][1]
    assert (row["model_turns"], row["tool_calls"], row["ended"]) == (2, 1, "done")
    text = "\n".join(episodes_section(tmp_path, "arm"))
    assert f"[model] '[calc(expression=\"{item.prompt}\")]</s>'" in text and f"[env] 'T:{item.answer}\\nA:'" in text


def test_a_raising_environment_or_tool_scores_0_is_counted_and_stops_the_run(echo, monkeypatch):
    from unison import checkpoint as ckpt
    from unison.tasks.env import EnvTask

    cfg = load_config(None, RUN)
    task = EnvTask(cfg.task)
    tok = load_tokenizer(__import__("unison.models", fromlist=["x"]).builtin_model_dir("tiny"))
    task.prepare(tok)
    boom = generate(Scripted(tok, lambda t: '[shout(word="boom")]'), task.episodes(task.train[:1]),
                    SamplingParams(n=1, max_tokens=40))[0]
    assert boom.episode.error == "tool shout raised RuntimeError: the tool exploded" and boom.episode.tool_errors == 1
    reward = make_reward(task, cfg.task)
    assert reward.score_completions([boom], task.train[:1], tok) == [0.0] and (reward.calls, reward.errors) == (1, 1)
    logs = []
    t = _train(echo / "run", "checkpoint.every=1", "log.console=true", steps=5, log=logs.append)
    monkeypatch.setenv("ECHO_RAISE", "1")  # after start-up (whose reset calls would refuse the run at once)
    with pytest.raises(UnisonError, match=r"every episode of the environment \S*echo_env(\.py)?:EchoEnv failed for 3 "
                                          r"consecutive steps \(last: EchoEnv.reset raised KeyError: 'the environment "
                                          r"broke'\)"):
        t.fit()
    assert any(m.startswith("[train] WARNING step 1: 4 of 4 rewards raised") for m in logs), logs
    done = ckpt.complete(echo / "run" / "checkpoints")
    assert [p.name for p in done] == ["step_000001", "step_000002"] and ckpt.verify(done[-1]) is None
    rows = [json.loads(x) for x in (echo / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/env_errors"] for r in rows] == [4, 4] and [r["reward/mean"] for r in rows] == [0.0, 0.0]


def _cli(echo, capsys, *sets):
    from unison.cli import main

    code = main(["train", str(echo / "c.yaml"), "--out", str(echo / "out")] + [f"--set={s}" for s in RUN + list(sets)])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_bad_input_is_one_line_and_writes_nothing(echo, capsys, tiny_dir):
    from unison.models import save_model_dir, load_model

    smol_like = echo / "smol_like"  # the tiny model with SmolLM2's chat template, which ignores tools
    tok = load_tokenizer(tiny_dir)
    tok.chat_template = (TEMPLATES / "SmolLM2-135M-Instruct-gguf.jinja").read_text()
    save_model_dir(load_model(tiny_dir, torch.float32), tok, smol_like)
    (echo / "bad.jsonl").write_text('{"target": "ab"}\n{"bad": 1}\n')
    (echo / "noargs.py").write_text("class E:\n    def __init__(self, x):\n        pass\n    def reset(self, item):\n"
                                    "        return []\n    def step(self, t):\n        return [], 0, True\n")
    (echo / "nodoc.py").write_text("def f(x):\n    return x\nclass E:\n    tools = [f]\n    def reset(self, item):\n"
                                   "        return []\n    def step(self, t):\n        return [], 0, True\n")
    cases = [
        (["task.path=bad.jsonl"], r"environment \S*echo_env.py:EchoEnv: reset\(.*bad.jsonl:2\) raised ValueError: this row "
                                  r"has no target: fix the environment or the item"),
        ([f"model={smol_like}"], r"the chat template of model .*smol_like does not render tools, and the environment "
                                 r"has tools: set task.chat_template"),
        ([f"model={smol_like}", "task.chat_template=model"], r"does not render tools"),
        ([f"task.chat_template={TEMPLATES / 'Qwen-Qwen3-0.6B.jinja'}"], r"is not prefix-preserving"),
        (["task.chat_template=builtin:nope"], r"task.chat_template 'builtin:nope' is not a built-in template"),
        (["task.env=missing_mod:Env"], r"cannot import environment module 'missing_mod'"),
        (["task.env=echo_env:Nope"], r"environment '\S*echo_env.py:Nope': module '\S*echo_env.py' has no class 'Nope'"),
        (["task.env=noargs:E"], r"environment \S*noargs.py:E cannot be created with no arguments"),
        (["task.env=nodoc:E"], r"tool 'f': no JSON schema from its signature and docstring"),
        (["task.env=null"], r"task.name is 'env' but task.env is not set"),
        (["exact=true"], r"exact mode fixes one prompt width .* is multi-turn"),
        (["task.max_episode_tokens=2000"], r"with task.max_episode_tokens=2000 that exceeds the model's context"),
    ]
    for sets, match in cases:
        code, err = _cli(echo, capsys, *sets)
        assert code == 2 and len(err) == 1 and err[0].startswith("unison: error: "), (sets, err)
        assert __import__("re").search(match, err[0]), (sets, err[0])
        assert not (echo / "out").exists(), sets


def test_sigkill_mid_episode_then_resume_equals_the_uninterrupted_run(echo, tiny_dir):
    import os
    import subprocess
    import sys

    from unison.data_io import read_metrics

    sets = ["checkpoint.every=1"]
    _train(echo / "full", *sets, steps=3).fit()
    script = (f"import sys; sys.path.insert(0, {str(echo)!r})\nfrom unison.config import load_config\n"
              f"from unison.trainer import Trainer\nTrainer(load_config(None, {RUN + sets + ['train.steps=3']!r}), "
              f"{str(echo / 'part')!r}, log=lambda m: None).fit()\n")
    env = dict(os.environ, ECHO_KILL_AFTER=str(echo / "part" / "checkpoints" / "step_000001"))
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=echo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]  # killed by the environment, inside step 2's episodes
    assert len(read_metrics(echo / "part" / "metrics.jsonl")) == 1
    _train(echo / "part", *sets, steps=3, resume=True).fit()
    assert _comparable(read_metrics(echo / "part" / "metrics.jsonl")) == \
        _comparable(read_metrics(echo / "full" / "metrics.jsonl"))


# ----------------------------------------------------------------------- tokenization drift
def _bpe_model(path):
    """A random tiny Llama whose tokenizer merges "a"+"b" into "ab" (so "a","b" is a non-canonical split)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from unison.models import BOS, CHARSET, EOS, PAD, UNK

    specials = [PAD, BOS, EOS, UNK]
    vocab = {t: i for i, t in enumerate(specials + list(CHARSET) + ["ab"])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token=UNK))
    core.add_special_tokens(specials)
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(3)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


class Ids:
    """An engine that samples given ids, turn by turn (log μ −0.5 each)."""

    name, pad_id, eos_ids, dp_rank, dp_size = "ids", 0, [2], 0, 1

    def __init__(self, turns):
        self.turns = list(turns)

    def generate(self, prompts, params):
        ids = self.turns.pop(0)
        return [Completion(prompt_ids=list(p), token_ids=list(ids), logprobs=[-0.5] * len(ids), finish_reason="stop")
                for p in prompts]


def test_retokenize_drift_against_a_hand_computed_value(echo, tmp_path):
    from unison.retokenize import retokenize_metrics
    from unison.tasks.env import EnvTask

    model = _bpe_model(tmp_path / "bpe")
    tok = load_tokenizer(model)
    a, b, ab, x, y, eos = (tok.convert_tokens_to_ids(t) for t in ("a", "b", "ab", "x", "y", "</s>"))
    assert tok("ab", add_special_tokens=False)["input_ids"] == [ab]  # "a","b" is not how it tokenizes "ab"
    cfg = load_config(None, RUN)
    task = EnvTask(cfg.task)
    task.prepare(tok)
    item = next(it for it in task.train if it["target"] == "ab")
    # turn 1 "xy" (canonical, told "again"), turn 2 "ab" sampled as "a","b": the answer
    c = generate(Ids([[x, y, eos], [a, b, eos]]), task.episodes([item]), SamplingParams(n=1, max_tokens=8))[0]
    assert (c.episode.turns, c.episode.end, c.episode.reward) == (2, "done", 1.0)
    learner = Learner(model)
    got = retokenize_metrics(learner, [c], task.template, 0)
    # by hand: the re-rendered conversation, scored by the model itself
    text = task.template.text(c.episode.messages, False)
    assert text.endswith("A:xy</s>U:again\nA:ab</s>")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(learner.model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    lp = [0.0] + [float(lp[t - 1, ids[t]]) for t in range(1, len(ids))]
    n = len(ids)
    assert ids[n - 15:n - 12] == [x, y, eos] and ids[n - 2:] == [ab, eos]
    turn1 = [lp[n - 15], lp[n - 14], lp[n - 13]]  # x, y, </s> (then "U:again\nA:", 10 tokens)
    turn2 = lp[n - 2] + lp[n - 1] + 1.5  # "ab", "</s>" against the three sampled tokens' Σ log μ = −1.5
    k3 = lambda r: math.expm1(r) - r  # noqa: E731
    want = (sum(k3(v + 0.5) for v in turn1) + 3 * k3(turn2 / 3)) / 6
    assert got["mismatch/retokenize_fraction"] == 0.5 and got["mismatch/retokenize_token_fraction"] == 0.5
    assert got["mismatch/retokenize_k3"] == pytest.approx(want, rel=1e-5)
    # nothing to re-tokenize differently: 0 drift (the tiny model's character tokenizer)
    c2 = generate(Ids([[x, y, eos], [ab, eos]]), task.episodes([item]), SamplingParams(n=1, max_tokens=8))[0]
    got2 = retokenize_metrics(learner, [c2], task.template, 0)
    assert got2["mismatch/retokenize_fraction"] == 0.0 and got2["mismatch/retokenize_token_fraction"] == 0.0


def test_retokenize_finds_each_model_turn_where_the_template_put_it(tiny_dir):
    """A re-tokenizing loop's spans: the model's turns are known by their place in the conversation (an
    environment's own assistant message is not one of them: pairing by role shifted every later turn), and a
    template that trims the content puts it elsewhere than "generation prompt + content" (the span is found)."""
    from unison.batch import Completion
    from unison.chat import ChatTemplate
    from unison.retokenize import retokenized
    from unison.tasks.env import EpisodeRecord

    tok = load_tokenizer(tiny_dir)
    jinja = ("{% for m in messages %}{% if m['role'] == 'user' %}U:{{ m['content'] }}\n"
             "{% elif m['role'] == 'assistant' %}A:{{ m['content'] | trim }}</s>{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}A:{% endif %}")
    template = ChatTemplate(tok, jinja)
    ids = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tok.eos_token_id
    turn1, env, turn2 = ids("xy ") + [eos], ids("A:ok</s>U:again\nA:"), ids("z") + [eos]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "xy "},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "z"}]
    a, b = len(turn1), len(turn1) + len(env)
    rec = EpisodeRecord(messages=msgs, segments=[(0, a, "model"), (a, b, "env"), (b, b + len(turn2), "model")],
                        model_messages=[1, 4])
    c = Completion(prompt_ids=ids("U:hi\nA:"), token_ids=turn1 + env + turn2, logprobs=[-1.0] * (b + len(turn2)),
                   finish_reason="stop", mask=[1] * a + [0] * len(env) + [1] * len(turn2), episode=rec)
    y, where = retokenized(c, template)
    assert tok.decode(y, skip_special_tokens=False) == "U:hi\nA:xy</s>A:ok</s>U:again\nA:z</s>"
    spans = [tok.decode([y[j] for j in js], skip_special_tokens=False) for js in where]
    assert spans == ["xy</s>", "z</s>"]


# ----------------------------------------------------------------------- engines and modes
def _server_prompts_chain(tok, prompts, task):
    """Every second-turn request is a first-turn request + the ids the server sampled + the template's ids
    for the tool's result: token-id prompts, nothing re-rendered."""
    ids = lambda s: list(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    firsts = [p for p in prompts if tok.decode(p).count("A:") == 1]
    seconds = [p for p in prompts if tok.decode(p).count("A:") == 2]
    assert len(firsts) == len(seconds) == len(prompts) // 2
    for p in seconds:
        q = tok.decode(p).split("U:")[1].split("\n")[0]
        call = ids(f'[calc(expression="{q}")]') + [2]
        head = next(f for f in firsts if list(f) + call == p[:len(f) + len(call)])
        assert p == list(head) + call + ids(f"T:{__import__('unison.tasks.calculator', fromlist=['x']).calc(q)}\nA:")
    return len(seconds)


@pytest.mark.parametrize("k", [0, 1])
def test_episodes_through_a_vllm_server_send_token_id_prompts(tmp_path, tiny_dir, k):
    """vllm.mode server (a stub of vLLM's HTTP API that answers like a model that uses the tool), synchronous
    and one version ahead (the episodes then run on the generating thread, each at one version)."""
    from unison.data_io import read_metrics
    from unison.rollout.vllm_server import PROBE_TEXT
    from unison.trainer import Trainer
    from vllm_stub import StubServer

    tok = load_tokenizer(tiny_dir)
    script = lambda p: list(tok(_calc_reply(tok.decode(p)), add_special_tokens=False)["input_ids"]) + [2]  # noqa: E731
    with StubServer(str(tiny_dir), list(tok(PROBE_TEXT)["input_ids"]), len(tok), script=script) as stub:
        cfg = load_config(None, CALC + ["engine=vllm", "vllm.mode=server", f"vllm.url={stub.url}", "rollout.n=2",
                                        "rollout.max_new_tokens=32", "train.prompts_per_step=2", "train.steps=3",
                                        "log.console=false", "log.tensorboard=false", f"rollout.max_staleness={k}"])
        Trainer(cfg, tmp_path / "run", log=lambda m: None).fit()
        prompts = list(stub.prompts)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["reward/mean"] for r in rows] == [1.0, 1.0, 1.0]
    assert all(r["rollout/turns_mean"] == 2 and r["rollout/tool_calls_mean"] == 1 for r in rows)
    assert [r["staleness/max"] for r in rows] == ([0.0] * 3 if k == 0 else [0.0, 1.0, 1.0])
    # 3 steps × 2 prompts × 2 episodes; k = 1 generates no batch past the last step (issue 31, item 13)
    assert _server_prompts_chain(tok, prompts, None) == 3 * 2 * 2


def _async_run(echo, name):
    from unison.data_io import read_metrics

    _train(echo / name, "rollout.max_staleness=1", "rollout.worker_threads=1", "log.rollouts=true", steps=2).fit()
    return read_metrics(echo / name / "metrics.jsonl")


def test_episodes_run_in_the_async_worker_one_version_late(echo):
    """rollout.max_staleness 1, native engine: the worker process runs the environment beside its engine;
    each batch of episodes is sampled with one version, K behind the learner."""
    rows = _async_run(echo, "a")
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0] and [r["staleness/mean"] for r in rows] == [0.0, 1.0]
    assert all(r["rollout/turns_mean"] >= 1 and r["rollout/env_errors"] == 0 for r in rows)
    logged = [json.loads(x) for x in (echo / "a" / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    assert {x["version"] for x in logged} == {0} and all(x["turns"][0]["by"] == "model" for x in logged)


@pytest.mark.slow
def test_episodes_in_the_async_worker_are_deterministic_and_resume_with_batches_in_flight(echo):
    from unison.data_io import read_metrics

    assert _comparable(_async_run(echo, "a")) == _comparable(_async_run(echo, "b"))
    sets = ["rollout.max_staleness=1", "rollout.worker_threads=1", "checkpoint.every=2", "log.rollouts=true"]
    _train(echo / "full", *sets, steps=4).fit()
    _train(echo / "part", *sets, steps=2).fit()
    _train(echo / "part", *sets, steps=4, resume=True).fit()
    rows, full = read_metrics(echo / "part" / "metrics.jsonl"), read_metrics(echo / "full" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and _comparable(rows[:2]) == _comparable(full[:2])
    items = lambda run, k: sorted(x["messages"][0]["content"] for x in  # noqa: E731
                                  map(json.loads, (echo / run / "rollouts" / f"step_{k:06d}.jsonl").read_text().splitlines()))
    assert items("part", 3) == items("full", 3)  # the job in flight at the checkpoint: regenerated, same items
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0, 0.0, 1.0]


def test_dynamic_sampling_drops_uniform_groups_of_episodes(echo, monkeypatch):
    """DAPO's filter on episode groups: an environment that always pays the same drops every group."""
    (echo / "flat_env.py").write_text("class Flat:\n    def reset(self, item):\n        return [{'role': 'user', "
                                      "'content': 'hi'}]\n    def step(self, text):\n        return [], 0.5, True\n")
    m = _train(echo / "run", "task.env=flat_env:Flat", "train.drop_uniform_groups=true", "task.truncated_reward=0.5",
               steps=1).train_step()
    assert m["data/dropped_groups"] == 2 and m["reward/mean"] == 0.5 and m["reward/trained_mean"] != m["reward/trained_mean"]


@pytest.mark.distributed
def test_two_ranks_run_the_episodes_one_process_runs(echo):
    """torchrun + FSDP2 on 2 gloo ranks: each rank runs its share of the episodes; the gathered batch, its
    rewards and the update equal one process's (fp32 parameters), the drift pass included (a collective)."""
    import os
    import socket
    import subprocess
    import sys

    from unison.data_io import read_metrics

    cfg = echo / "env.yaml"
    cfg.write_text("task: {name: env, env: 'echo_env:EchoEnv', path: data.jsonl, eval_size: 0, max_turns: 3, "
                   "max_episode_tokens: 48, truncated_reward: null}\nrollout: {n: 2, max_new_tokens: 8}\n"
                   "train: {prompts_per_step: 2, lr: 1.0e-3, steps: 3, micro_batch_size: 2}\n"
                   "mismatch: {decompose_every: 1}\nlog: {console: false, tensorboard: false, rollouts: true}\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    one = subprocess.run([sys.executable, "-m", "unison", "train", str(cfg), "--out", str(echo / "one")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(port), "-m", "unison", "train", str(cfg), "--out", str(echo / "two"),
                          "--set=distributed.param_dtype=fp32", "--set=train.micro_batch_size=1"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = read_metrics(echo / "one/metrics.jsonl"), read_metrics(echo / "two/metrics.jsonl")
    tok = lambda run: [[json.loads(x)["token_ids"] for x in p.read_text().splitlines()]  # noqa: E731
                       for p in sorted((run / "rollouts").glob("*.jsonl"))]
    assert tok(echo / "one") == tok(echo / "two")  # the same episodes, every step
    for ra, rb in zip(a, b):
        for k in ("reward/mean", "rollout/turns_mean", "rollout/tool_calls_mean", "mismatch/retokenize_fraction"):
            assert ra[k] == rb[k], k
        assert rb["optim/grad_norm"] == pytest.approx(ra["optim/grad_norm"], rel=1e-5)
        assert rb["mismatch/retokenize_k3"] == pytest.approx(ra["mismatch/retokenize_k3"], rel=1e-4, abs=1e-9)


def test_the_tasks_page_multi_turn_example_runs_as_written(tmp_path):
    """examples/multi_turn from another directory, without PYTHONPATH: the environment and the data are
    found next to the config; docs/tasks.md shows these files whole."""
    import os
    import subprocess
    import sys

    from unison.data_io import read_metrics

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))  # this checkout's unison; examples/multi_turn is not on the path
    out = subprocess.run([sys.executable, "-m", "unison", "train", str(root / "examples/multi_turn/config.yaml"),
                          "--out", str(tmp_path / "mt"), "--set", "train.steps=1"], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = read_metrics(tmp_path / "mt" / "metrics.jsonl")
    assert len(rows) == 1 and all(r["rollout/env_errors"] == 0 for r in rows)
    assert "[train] episodes of " in out.stderr and "tools word_length (calls read as pythonic)" in out.stderr
    page = (root / "docs/tasks.md").read_text()
    for f in ("env.py", "config.yaml"):  # the page's example is these files, verbatim
        assert (root / "examples/multi_turn" / f).read_text().strip() in page, f


def test_probe_task_reports_the_drift_of_a_re_tokenizing_loop(tmp_path, capsys):
    from unison.cli import main

    out = tmp_path / "p"
    assert main(["probe", "--task", "calculator", "--precision", "fp32", "--n", "2", "--max-new-tokens", "12",
                 "--out", str(out)]) == 0
    (r,) = json.loads((out / "probe.json").read_text())["results"]
    assert r["task"] == "calculator" and r["mismatch/k3"] < 1e-9 and r["rollout/turns_mean"] >= 1
    for k in ("mismatch/retokenize_fraction", "mismatch/retokenize_k3", "mismatch/retokenize_token_fraction"):
        assert 0 <= r[k] < float("inf"), k
    assert "retok." in capsys.readouterr().out  # the drift columns in the table
    for args, match in [(["--task", "arithmetic"], "--task 'arithmetic' is not a multi-turn task"),
                        (["--task", "calculator", "--exact"], "--task runs episodes: drop --exact")]:
        assert main(["probe", *args, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and match in err[0] and not (tmp_path / "bad").exists()
