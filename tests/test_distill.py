"""On-policy distillation (issue 40, item 1): the reverse-KL advantage on hand numbers, the loss on per-token
advantages, the teacher's tokenizer check, and a run whose teacher is its own start."""

from __future__ import annotations

import math

import pytest
import torch

from unison.algorithms.distill import reverse_kl_advantages, reverse_kl_metrics
from unison.algorithms.losses import ppo_clip
from unison.config import load_config
from unison.data_io import read_metrics
from unison.errors import UnisonError
from unison.sides import Side

# two rows of 5 positions. Row 0: 2 prompt tokens, 2 sampled tokens, 1 pad. Row 1: 1 prompt token, a sampled
# token, a tool token (the environment's: not the model's), 2 sampled tokens.
MASK = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 0, 1, 1]], dtype=torch.float32)
OLD = torch.tensor([[-9.0, -9.0, -1.0, -2.0, -9.0], [-9.0, -0.5, -9.0, -3.0, -0.25]])   # log π_old
MU = torch.tensor([[-9.0, -9.0, -1.25, -2.0, -9.0], [-9.0, -0.5, -9.0, -2.5, -0.25]])   # log μ (the sampler)
TEACHER = torch.tensor([[0.0, 0.0, -1.5, -1.0, 0.0], [0.0, -0.5, -7.0, -1.0, -2.25]])   # log π_teacher


def test_the_reverse_kl_advantage_on_a_hand_computed_two_row_batch():
    adv = reverse_kl_advantages(OLD, TEACHER, MASK, coef=0.5)
    # −0.5·(s − q) on the model's tokens: row 0: −0.5·(−1+1.5) = −0.25, −0.5·(−2+1) = 0.5;
    # row 1: −0.5·(−0.5+0.5) = 0, the tool token 0, −0.5·(−3+1) = 1, −0.5·(−0.25+2.25) = −1
    assert adv.tolist() == [[0.0, 0.0, -0.25, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0, -1.0]]
    with_task = reverse_kl_advantages(OLD, TEACHER, MASK, coef=0.5, task_advantages=torch.tensor([1.0, -0.5]))
    assert with_task.tolist() == [[0.0, 0.0, 0.75, 1.5, 0.0], [0.0, -0.5, 0.0, 0.5, -1.5]]
    # the student term from μ instead: row 0's first token −0.5·(−1.25+1.5) = −0.125; row 1's third 0.75
    from_mu = reverse_kl_advantages(MU, TEACHER, MASK, coef=0.5)
    assert from_mu.tolist() == [[0.0, 0.0, -0.125, 0.5, 0.0], [0.0, 0.0, 0.0, 0.75, -1.0]]


def test_the_distill_metrics_report_the_signal_from_pi_old_and_from_mu():
    m = reverse_kl_metrics(OLD, MU, TEACHER, MASK)
    # s − q over the 5 model tokens: 0.5, −1, 0, −2, 2 → mean −0.1; with μ: 0.25, −1, 0, −1.5, 2 → −0.05
    assert m["distill/reverse_kl_pi"] == pytest.approx(-0.1)
    assert m["distill/reverse_kl_mu"] == pytest.approx(-0.05)
    # mean |log μ − log π_old| = (0.25 + 0.5)/5 = 0.15 over mean |log μ − q| = 4.75/5 = 0.95
    assert m["distill/mismatch_share"] == pytest.approx(0.15 / 0.95)


def test_ppo_clip_takes_per_token_advantages():
    adv = reverse_kl_advantages(OLD, TEACHER, MASK, coef=0.5)
    logp = OLD.clone().requires_grad_(True)
    per_token, _ = ppo_clip(logp, OLD, MU, adv, torch.ones_like(OLD), MASK)
    # at r = 1 the PPO term is −A_t on each token: the per-token advantages, negated
    assert per_token.detach().tolist() == (-adv).tolist()
    per_token.sum().backward()
    assert logp.grad.tolist() == (-adv).tolist()  # d(−r·A)/d log π = −A at r = 1


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line():
    from unison.models import build_char_tokenizer
    from unison.teacher import check_tokenizer

    a, b = build_char_tokenizer(), build_char_tokenizer(len(build_char_tokenizer()) + 16)
    check_tokenizer(a, build_char_tokenizer(), "t", "s")  # the same vocabulary passes
    with pytest.raises(UnisonError) as e:
        check_tokenizer(b, a, "/teachers/big", "builtin:tiny")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("distill.teacher '/teachers/big' has another tokenizer than the student")


@pytest.mark.parametrize("anchor", ["recompute", "bypass"])  # bypass: π_old is μ for the loss, not for the teacher
def test_a_teacher_that_is_the_student_gives_zero_signal_from_pi_old_and_the_mismatch_from_mu(tmp_path, anchor):
    # student and teacher: the same weights. From π_old the reverse KL is exactly 0 at step 1 (the teacher scores
    # in fp32 as the learner does); from a bf16 sampler's μ it is the mismatch alone — the signal the usual
    # recipe would train on
    from unison.trainer import Trainer

    cfg = load_config(None, ["task.digits=1", "task.train_size=16", "task.eval_size=2", "rollout.n=2",
                             "rollout.max_new_tokens=4", "train.steps=2", "train.prompts_per_step=4",
                             "algo=opd", "distill.teacher=builtin:tiny", "rollout_precision=bf16",
                             f"policy.anchor={anchor}", "mismatch.decompose_every=1",
                             "log.tensorboard=false", "log.console=false", "checkpoint.every=0"])
    lines = []
    Trainer(cfg, tmp_path / "r", log=lines.append).fit()
    assert any("distilling from builtin:tiny" in x for x in lines)
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    first = rows[0]
    assert first["distill/reverse_kl_pi"] == 0.0
    assert abs(first["distill/reverse_kl_mu"]) > 1e-6 and first["distill/mismatch_share"] == 1.0
    # the ledger's teacher term: the teacher's engine (fp32 prefill) against its fp32 scoring path — one model
    assert all(0.0 <= r["ledger/teacher_k3"] < 1e-9 for r in rows)
    assert all(math.isfinite(r["policy/loss"]) for r in rows)


def test_the_teacher_term_sees_a_generation_path_that_is_not_the_scoring_path(tiny_dir):
    """The ledger's teacher term on a batch: 0 while the teacher's engine holds its weights, > 0 once the engine's
    copy is perturbed (a served teacher that scores with other weights than it generates with)."""
    from unison.batch import collate
    from unison.models import load_tokenizer
    from unison.rollout import SamplingParams, generate, make_engine
    from unison.teacher import Teacher

    cfg = load_config(None, ["distill.teacher=builtin:tiny"])
    teacher = Teacher.from_config(cfg, load_tokenizer(tiny_dir))
    eng = make_engine("native", tiny_dir, torch.float32, max_len=64)
    batch = collate(generate(eng, [eng.tokenizer.encode("3+4=")], SamplingParams(n=3, max_tokens=8, seed=0)),
                    eng.pad_id)
    scored = teacher.scorer.score(batch)
    same = teacher.path_term(batch, scored)
    assert set(same) == {"ledger/teacher_k1", "ledger/teacher_k3"} and same["ledger/teacher_k3"] < 1e-9
    with torch.no_grad():
        w = teacher._engine.model.model.layers[1].mlp.down_proj.weight
        w.add_(0.05 * w.abs().mean() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    assert teacher.path_term(batch, scored)["ledger/teacher_k3"] > 1e-7


# ------------------------------------------------------------------ a teacher served by vLLM (the HTTP stub)
def _served_teacher(tiny_dir, drop: float = 0.0):
    """A stub vLLM server answering prompt log-probs with the tiny model's own (its HF forward, fp32), minus ``drop``
    nats on every token (a served path that loses part of the model, e.g. an adapter's output layer)."""
    from unison.models import load_model, load_tokenizer
    from unison.rollout.vllm_server import PROBE_TEXT
    from vllm_stub import StubServer

    model = load_model(tiny_dir)

    def prompt_logprobs(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        return (lp - drop).tolist()

    tok = load_tokenizer(tiny_dir)
    return StubServer(str(tiny_dir), list(tok(PROBE_TEXT)["input_ids"]), len(tok), prompt_logprobs_fn=prompt_logprobs)


@pytest.mark.parametrize("drop", [0.0, 6.6])
def test_a_served_teacher_scores_with_its_prompt_log_probs_and_the_ledger_compares_the_paths(tiny_dir, drop):
    """distill.teacher_url: the advantages use the server's prompt log-probs. Served by the same weights they equal
    the local scoring pass to fp32 rounding (teacher term ~0); a server that drops 6.6 nats a token (the LoRA
    lm_head users saw vanish from prompt_logprobs) moves every advantage by coef × 6.6 and the ledger's teacher
    term shows it: k1 = mean(log p_engine − log π_teacher) = 6.6."""
    from unison.batch import collate
    from unison.models import load_tokenizer
    from unison.rollout import SamplingParams, generate, make_engine
    from unison.teacher import Teacher

    eng = make_engine("native", tiny_dir, torch.float32, max_len=64)
    batch = collate(generate(eng, [eng.tokenizer.encode("3+4="), eng.tokenizer.encode("12+5=")],
                             SamplingParams(n=3, max_tokens=8, seed=1)), eng.pad_id)
    with _served_teacher(tiny_dir, drop) as stub:
        cfg = load_config(None, ["distill.teacher=builtin:tiny", f"distill.teacher_url={stub.url}"])
        teacher = Teacher.from_config(cfg, load_tokenizer(tiny_dir))
        served = teacher.score(batch)
        assert stub.prompt_logprob_requests == batch.size  # one request per row, sent side by side
        local = teacher.scorer.score(batch)
        mask = batch.response_mask.bool()
        assert (served[~mask] == 0).all()
        assert torch.allclose(served[mask], local[mask] - drop, atol=1e-4)
        term = teacher.path_term(batch, served)
        assert term["ledger/teacher_k1"] == pytest.approx(drop, abs=1e-4)
        assert (term["ledger/teacher_k3"] > 1.0) == (drop > 0)
        batch.advantages = torch.zeros(batch.size)
        adv, m = teacher.advantages(batch, teacher.scorer, local)  # the student is the teacher's own copy here
        assert torch.allclose(adv[mask], torch.full_like(adv[mask], -drop), atol=1e-4)  # −coef·(log π − log π_T)


def test_a_served_teacher_needs_temperature_1_and_a_local_copy(tmp_path, capsys):
    from unison.cli import main

    for sets, msg in ((["distill.teacher_url=http://127.0.0.1:9"], "distill.teacher is not"),
                      (["distill.teacher=builtin:tiny", "distill.teacher_url=http://127.0.0.1:9",
                        "rollout.temperature=0.7"], "set rollout.temperature=1")):
        out = tmp_path / "run"
        args = ["train", "configs/tiny-fp32.yaml", "--out", str(out), "--set", "algo=opd"]
        for kv in sets:
            args += ["--set", kv]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err
        assert not out.exists()


def test_under_top_p_the_teacher_scores_its_full_distribution_not_the_students_support(tmp_path):
    # issue 51, item 2: the teacher's scorer replayed the student's sampling mask, so log π_T was renormalised over
    # the teacher's top-c of the student's support size (0 where the student kept one token)
    from unison.batch import collate
    from unison.policy import Scorer
    from unison.rollout import SamplingParams, make_engine
    from unison.teacher import Teacher

    cfg = load_config(None, ["algo=opd", "distill.teacher=builtin:tiny", "rollout.top_p=0.7"])
    from unison.models import load_tokenizer, resolve_model_dir

    d = resolve_model_dir("builtin:tiny")
    teacher = Teacher.from_config(cfg, load_tokenizer(d))
    eng = make_engine("native", d, torch.float32)
    ids = [eng.tokenizer(t)["input_ids"] for t in ("12+35=", "7+8=")]
    b = collate(eng.generate(ids, SamplingParams(n=4, max_tokens=12, top_p=0.7, seed=3)), eng.pad_id)
    assert "support" in b.extras  # top-p: the engine recorded each token's support
    full = Scorer(d, Side(support_replay=False)).score(b)
    replayed = Scorer(d, Side(support_replay=True)).score(b)
    assert float((full - replayed).abs().max()) > 0.1  # the two differ here, or the test could not fail
    assert torch.equal(teacher.score(b), full)


# ------------------------------------------------------------------ distill.estimator: full (issue 52, item 4)
def test_the_full_reverse_kl_and_its_gradient_on_a_hand_computed_case():
    # one position, a 3-token vocabulary: z = h·Wᵀ = [0, ln 2, 0] → π = [1/4, 1/2, 1/4]; the teacher q = [1/2, 1/4, 1/4].
    # KL(π ‖ q) = 1/4·ln(1/2) + 1/2·ln 2 + 0 = ln2 / 4. ∂KL/∂z_j = π_j (log π_j − log q_j − KL):
    # [1/4·(−ln2 − ln2/4), 1/2·(ln2 − ln2/4), 1/4·(−ln2/4)] = ln2·[−5/16, 3/8, −1/16]; with h = 1, ∂KL/∂W = that
    # column and ∂KL/∂h = Σ_j ∂KL/∂z_j · W_j = 3/8·ln²2
    from unison.logprobs import _HeadKL

    ln2 = math.log(2.0)
    h = torch.tensor([[1.0]], requires_grad=True)
    w = torch.tensor([[0.0], [ln2], [0.0]], requires_grad=True)
    logq = torch.tensor([[0.5, 0.25, 0.25]]).log()
    logp, ent, kl = _HeadKL.apply(h, w, None, torch.tensor([1]), 1.0, True, logq)
    assert kl.item() == pytest.approx(ln2 / 4, rel=1e-6)
    assert logp.item() == pytest.approx(math.log(0.5), rel=1e-6)
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) * 2 + 0.5 * math.log(0.5)), rel=1e-6)
    kl.sum().backward()
    assert w.grad.view(-1).tolist() == pytest.approx([-5 / 16 * ln2, 3 / 8 * ln2, -1 / 16 * ln2], rel=1e-5)
    assert h.grad.item() == pytest.approx(3 / 8 * ln2 ** 2, rel=1e-5)
    # the target's log-prob: ∂log π(1)/∂z = onehot(1) − π = [−1/4, 1/2, −1/4]
    h.grad, w.grad = None, None
    logp, _, _ = _HeadKL.apply(h, w, None, torch.tensor([1]), 1.0, False, logq)
    logp.sum().backward()
    assert w.grad.view(-1).tolist() == pytest.approx([-0.25, 0.5, -0.25], rel=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_full_reverse_kl_equals_autograd_of_the_kl(temperature):
    # 5 positions, d 8, a 50-token vocabulary, a bias: values and gradients of log π(target) and KL, both at once,
    # against autograd through log_softmax; the unfused path (the one autocast, transforms and GPUs take) too
    from unison.logprobs import _head_logp_kl, _HeadKL

    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 8, generator=g, requires_grad=True)
    head = torch.nn.Linear(8, 50)
    logq = torch.log_softmax(torch.randn(5, 50, generator=g), -1)
    tg = torch.randint(0, 50, (5,), generator=g)
    a_lp, a_kl = torch.randn(5, generator=g), torch.randn(5, generator=g)  # upstream gradients of both outputs

    def reference():
        lp_all = torch.log_softmax(head(h) / temperature, -1)
        kl = (lp_all.exp() * (lp_all - logq)).sum(-1)
        return lp_all.gather(-1, tg[:, None]).squeeze(-1), kl

    outs = {}
    for name, fn in (("autograd", reference),
                     ("fused", lambda: _HeadKL.apply(h, head.weight, head.bias, tg, temperature, False, logq)[::2]),
                     ("unfused", lambda: _head_logp_kl(h, tg, head, temperature, None, False, None, h,
                                                       type("T", (), {"log_probs": lambda s, x, t: logq})(),
                                                       fused=False)[::2])):
        for p in (h, head.weight, head.bias):
            p.grad = None
        lp, kl = fn()
        ((lp * a_lp).sum() + (kl * a_kl).sum()).backward()
        outs[name] = [lp.detach(), kl.detach(), h.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    for name in ("fused", "unfused"):
        for got, want in zip(outs[name], outs["autograd"]):
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), name
    assert float(outs["autograd"][1].min()) > 0  # the KL of two different distributions


def _opd(tmp_path, name, *sets, steps=2):
    from unison.trainer import Trainer

    cfg = load_config(None, ["task.digits=1", "task.train_size=16", "task.eval_size=2", "rollout.n=2",
                             "rollout.max_new_tokens=4", f"train.steps={steps}", "train.prompts_per_step=4",
                             "algo=opd", "distill.teacher=builtin:tiny", "log.tensorboard=false",
                             "log.console=false", "checkpoint.every=0", *sets])
    Trainer(cfg, tmp_path / name, log=lambda m: None).fit()
    return read_metrics(tmp_path / name / "metrics.jsonl")


def test_the_full_estimator_trains_toward_the_teacher_and_is_zero_against_itself(tmp_path):
    # a teacher that is the student: the exact reverse KL is 0 at step 1 (fp32 both), and the update is 0
    rows = _opd(tmp_path, "self", "distill.estimator=full", "train.logprob_chunk=3")  # several chunks per row
    assert abs(rows[0]["distill/reverse_kl_full"]) < 1e-6 and abs(rows[0]["distill/reverse_kl_pi"]) < 1e-6
    # a teacher elsewhere (the tiny model's weights perturbed): the loss is the KL, its gradient moves the student
    # toward the teacher — over a few steps at a large LR the exact KL falls
    from unison.models import load_model, load_tokenizer, resolve_model_dir, save_model_dir

    d = resolve_model_dir("builtin:tiny")
    m = load_model(d)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
    save_model_dir(m, load_tokenizer(d), tmp_path / "teacher")
    rows = _opd(tmp_path, "far", "distill.estimator=full", f"distill.teacher={tmp_path / 'teacher'}",
                "train.lr=3e-3", steps=6)
    kls = [r["distill/reverse_kl_full"] for r in rows]
    assert kls[0] > 0.05 and kls[-1] < 0.8 * kls[0], kls
    assert all(r["optim/grad_norm"] > 0 for r in rows)


def test_the_full_estimator_refuses_what_cannot_give_it_logits(tmp_path, capsys):
    from unison.cli import main

    (tmp_path / "c.yaml").write_text("seed: 0\n")
    for extra, why in ((["distill.teacher_url=http://127.0.0.1:9"], "a served teacher"),
                       (["train.packing=true"], "train.packing=false")):
        args = ["train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run")] + [
            f"--set={s}" for s in ["algo=opd", "distill.teacher=builtin:tiny", "distill.estimator=full", *extra]]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "distill.estimator=full cannot run here" in err and why in err and "distill.estimator=sampled" in err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
