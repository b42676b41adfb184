"""lib.posttrain against written-out references: the masked SFT loss against
F.cross_entropy and a float64 mean, DPO's loss and gradient against the paper's formula
in float64, padding against unpadded rows, the example layout written out by hand and,
on SmolLM2's multi-turn chats, against transformers' assistant mask; the loops train what
they should and name bad arguments."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lib.config import GPTConfig
from lib.lora import ATTENTION, FFN, apply_lora
from lib.model import GPT
from lib.posttrain import (IGNORE, UpperBlocks, dpo, dpo_loss, finetune, kept_logits,
                           kept_logprobs, lower_states, pad_batch, reply, response_logprobs, sequence_logprobs, sft,
                           sft_example, sft_loss, token_kl)
from lib.tokenizers import BPETokenizer, ChatTokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% endif %}")


def tokenizer() -> ChatTokenizer:
    """Bytes as ids 0-255, ChatML's two special tokens as 256 and 257."""
    bpe = BPETokenizer({}, byte_ids=list(range(256)))
    return ChatTokenizer(bpe, {"<|im_start|>": 256, "<|im_end|>": 257}, CHATML, eos_id=257)


def model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig.tiny(vocab_size=258, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                            context_length=96)
    return GPT(config).eval()


def question(k: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"q{k}?"}]


def test_example_layout_written_out_by_hand():
    """Bytes are ids 0-255 here, so the whole conversation can be written out: every
    assistant message and its <|im_end|> (257) are learned, in both turns; the user turns,
    the headers and the "\\n" between turns are read only; the example stops at the last
    <|im_end|>."""
    tok = tokenizer()
    S, E = [256], [257]
    chat = [{"role": "user", "content": "q1?"}, {"role": "assistant", "content": "yes"},
            {"role": "user", "content": "q2?"}, {"role": "assistant", "content": " no"}]
    read = [S + list(b"user\nq1?") + E + list(b"\n") + S + list(b"assistant\n"),
            list(b"\n") + S + list(b"user\nq2?") + E + list(b"\n") + S + list(b"assistant\n")]
    learned = [list(b"yes") + E, list(b" no") + E]
    ids = read[0] + learned[0] + read[1] + learned[1]
    is_learned = ([False] * len(read[0]) + [True] * len(learned[0])
                  + [False] * len(read[1]) + [True] * len(learned[1]))
    inputs, targets = sft_example(tok, chat)
    assert inputs.tolist() == ids[:-1]
    assert targets.tolist() == [i if keep else IGNORE for i, keep in zip(ids[1:], is_learned[1:])]
    _, everything = sft_example(tok, chat, mask_prompt=False)
    assert everything.tolist() == ids[1:]
    same = sft_example(tok, chat[:-1], " no")  # the last answer given apart
    assert torch.equal(same[0], inputs) and torch.equal(same[1], targets)


# SmolLM2's template with each assistant message and its <|im_end|> in a {% generation %}
# block, the marks transformers' return_assistant_tokens_mask (and TRL's assistant-only
# loss) read. Written independently of lib; it renders what the file's template renders
# (the newline after a turn is an expression: trim_blocks drops one right after a block tag).
GENERATION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
    "<|im_end|>{% endgeneration %}{% else %}{{ message['content'] }}<|im_end|>{% endif %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hf_rust_smollm2(smollm2_file, hf_smollm2_tokenizer):
    """transformers' tokenizer class over Hugging Face's Rust pipeline of SmolLM2's
    tokenizer.json (digits split off first), with the file's bos and eos."""
    from transformers import PreTrainedTokenizerFast
    from test_smollm import rust_tokenizer

    special = hf_smollm2_tokenizer.special_tokens_map
    return PreTrainedTokenizerFast(tokenizer_object=rust_tokenizer(smollm2_file[0].metadata),
                                   bos_token=special["bos_token"], eos_token=special["eos_token"])


def test_every_assistant_turn_is_learned_as_transformers_marks_it(smollm2, hf_rust_smollm2):
    """SFT on a multi-turn conversation, against transformers' assistant mask (from the
    {% generation %} blocks, mapped to tokens through the Rust tokenizer's offsets): the
    same ids, and a target is learned exactly where transformers marks it. The answers
    start with whitespace and hold digits after blank lines, where tokenising prompt and
    answer apart would differ."""
    _, ours = smollm2
    chat = [{"role": "user", "content": "Two steps?"},
            {"role": "assistant", "content": "  1. Mix.\n\n2. Bake."},
            {"role": "user", "content": "And then?"},
            {"role": "assistant", "content": "\n\n3. Serve, at 20:30."}]
    for messages in (chat, [{"role": "system", "content": "Be brief."}] + chat[:2]):
        theirs = hf_rust_smollm2.apply_chat_template(
            messages, chat_template=GENERATION_TEMPLATE, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True)
        ids, mask = theirs["input_ids"], theirs["assistant_masks"]
        assert ours.apply_chat_template(messages, False) == hf_rust_smollm2.apply_chat_template(
            messages, chat_template=GENERATION_TEMPLATE, tokenize=False)
        end = max(t for t, m in enumerate(mask) if m) + 1  # after the last <|im_end|>
        assert ids[end - 1] == ours.end_of_turn_id and sum(mask) < end
        inputs, targets = sft_example(ours, messages)
        assert inputs.tolist() == ids[:end - 1]
        assert targets.tolist() == [i if m else IGNORE for i, m in zip(ids[1:end], mask[1:end])]
    apart = ours.encode_chat(chat[:1]) + ours.encode(chat[1]["content"])
    assert apart != ids[:len(apart)]  # tokenising the first answer apart differs


def test_sft_loss_equals_cross_entropy_and_float64_masked_mean():
    """The loss sft trains on (sft_loss) against torch's kernel with ignore_index and a
    float64 mean written out over the kept targets only."""
    tok = tokenizer()
    examples = [sft_example(tok, question(k), "ok" * (k + 1)) for k in range(3)]
    inputs, targets = pad_batch(examples)
    m = model()
    ours, values = sft_loss(m, examples)
    logits, _ = m(inputs)
    torch.testing.assert_close(ours, F.cross_entropy(
        logits.transpose(1, 2), targets, ignore_index=IGNORE))
    keep = targets != IGNORE
    assert 0 < keep.sum() < keep.numel() and values == {}  # some targets are left out
    logp = logits.double().log_softmax(-1)
    nll = -logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(ours.double(), nll[keep].sum() / keep.sum())
    assert not torch.isclose(ours.double(), nll.mean())  # the unmasked mean differs


def test_finetune_records_the_loss_and_values_of_every_step():
    """The shared loop with a loss of its own: one row per step, the batches drawn by
    the seeded generator without replacement."""
    data = list(range(6))
    weight = torch.nn.Parameter(torch.tensor(3.0))
    holder = torch.nn.Module()
    holder.weight = weight
    seen = []

    def loss_fn(module, batch):
        seen.append(batch)
        return (module.weight - 1.0) ** 2, {"size": len(batch)}

    log = finetune(holder, data, loss_fn, steps=5, lr=0.1, batch_size=4, seed=7)
    generator = torch.Generator().manual_seed(7)
    expected = [torch.randperm(6, generator=generator)[:4].tolist() for _ in range(5)]
    assert seen == expected and all(len(set(b)) == 4 for b in seen)
    assert [row["size"] for row in log] == [4.0] * 5 and log[0]["loss"] == 4.0
    assert log[-1]["loss"] < log[0]["loss"] and not holder.training


def test_padding_changes_no_real_position():
    tok = tokenizer()
    short, long = (sft_example(tok, question(k), "a" * n) for k, n in ((1, 2), (22, 9)))
    m = model()
    together = response_logprobs(m, [short, long])
    alone = torch.cat([response_logprobs(m, [e]) for e in (short, long)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    logits, _ = m(short[0][None])
    logp = logits.double().log_softmax(-1)[0]
    keep = short[1] != IGNORE
    written = logp[keep].gather(-1, short[1][keep][:, None]).sum()
    torch.testing.assert_close(together[0].double(), written, atol=1e-5, rtol=1e-5)


def test_dpo_loss_and_gradient_equal_the_paper_formula_in_float64():
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-10 * torch.rand(5, generator=g, dtype=torch.float64)
                      for _ in range(4))
    pc.requires_grad_(True)
    pr.requires_grad_(True)
    beta = 0.3
    loss, r_c, r_r = dpo_loss(pc, pr, rc, rr, beta)
    margin = beta * ((pc - rc) - (pr - rr))
    formula = torch.log(1 + torch.exp(-margin)).mean()  # -log sigmoid, written out
    torch.testing.assert_close(loss, formula, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(r_c - r_r, margin.detach(), rtol=1e-12, atol=1e-12)
    (grad_chosen,) = torch.autograd.grad(loss, pc)
    # d/d log pi(y_w) of -log sigma(m) = -beta * sigma(-m) / B
    expected = -beta * torch.sigmoid(-margin.detach()) / 5
    torch.testing.assert_close(grad_chosen, expected, rtol=1e-12, atol=1e-12)
    same = torch.tensor([-3.0, -7.0])
    assert math.isclose(dpo_loss(same, same, same, same, 0.1)[0].item(), math.log(2),
                        rel_tol=1e-6)


def test_sequence_logprobs_ignores_ignored_targets():
    logits = torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(3))
    targets = torch.tensor([[1, IGNORE, 3, IGNORE], [IGNORE, IGNORE, 0, 6]])
    logp = logits.double().log_softmax(-1)
    expected = torch.stack([logp[0, 0, 1] + logp[0, 2, 3], logp[1, 2, 0] + logp[1, 3, 6]])
    torch.testing.assert_close(sequence_logprobs(logits, targets).double(), expected,
                               atol=1e-5, rtol=1e-5)


def test_sft_teaches_the_response_and_stops():
    tok = tokenizer()
    examples = [sft_example(tok, question(k), "ok!") for k in range(8)]
    m = model()  # every weight trains: a frozen random head is too small for confidence
    before = response_logprobs(m, examples).mean()
    losses = sft(m, examples, steps=30, lr=1e-2, batch_size=4)
    assert len(losses) == 30 and losses[-1] < losses[0] / 2
    assert response_logprobs(m, examples).mean() > before + 5.0
    assert not m.training
    assert reply(m, tok, question(3), max_new_tokens=8) == "ok!"  # and stops at <|im_end|>


def test_sft_moves_only_the_adapters():
    tok = tokenizer()
    examples = [sft_example(tok, question(k), "ok!") for k in range(8)]
    m = model()
    frozen = {n: p.detach().clone() for n, p in m.named_parameters()}
    apply_lora(m, ATTENTION, r=4, alpha=8.0)
    sft(m, examples, steps=3, lr=1e-2, batch_size=4)
    for name, p in m.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, frozen[name.replace(".base.", ".")])
    assert all(p.abs().max() > 0 for n, p in m.named_parameters() if n.endswith("lora_B"))


def test_dpo_raises_the_chosen_response_over_the_rejected():
    tok = tokenizer()
    pairs = [(sft_example(tok, question(k), "yes"), sft_example(tok, question(k), "no!"))
             for k in range(8)]
    m = model()
    ref = torch.stack([response_logprobs(m, [c for c, _ in pairs]),
                       response_logprobs(m, [r for _, r in pairs])], dim=1)
    apply_lora(m, ATTENTION, r=4, alpha=8.0)
    log = dpo(m, pairs, ref, steps=25, lr=1e-2, beta=0.5, batch_size=4)
    assert math.isclose(log[0]["loss"], math.log(2), rel_tol=1e-5)  # policy = reference
    assert log[-1]["loss"] < 0.35 and log[-1]["accuracy"] == 1.0
    after = torch.stack([response_logprobs(m, [c for c, _ in pairs]),
                         response_logprobs(m, [r for _, r in pairs])], dim=1)
    assert ((after[:, 0] - ref[:, 0]) > (after[:, 1] - ref[:, 1])).all()


@pytest.mark.parametrize("kwargs, match", [
    ({"steps": 0}, "steps must be a positive int"),
    ({"lr": 0.0}, "lr must be a number > 0"),
    ({"batch_size": 9}, r"batch_size must be an int in \[1, 8\]"),
    ({"examples": []}, "data must be a non-empty list"),
])
def test_sft_names_bad_arguments(kwargs, match):
    tok = tokenizer()
    m = model()
    apply_lora(m, ATTENTION, r=2, alpha=4.0)
    args = {"examples": [sft_example(tok, question(k), "x") for k in range(8)],
            "steps": 1, "lr": 1e-3, "batch_size": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        sft(m, **args)


def test_dpo_and_examples_name_bad_arguments():
    tok = tokenizer()
    pair = (sft_example(tok, question(1), "a"), sft_example(tok, question(1), "b"))
    m = model().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        dpo(m, [pair], torch.zeros(1, 2), steps=1, lr=1e-3, beta=0.1, batch_size=1)
    apply_lora(m, ATTENTION, r=2, alpha=4.0)
    with pytest.raises(ValueError, match=r"ref_logps must be a \(1, 2\) tensor"):
        dpo(m, [pair], torch.zeros(2), steps=1, lr=1e-3, beta=0.1, batch_size=1)
    with pytest.raises(ValueError, match="beta must be a number > 0"):
        dpo(m, [pair], torch.zeros(1, 2), steps=1, lr=1e-3, beta=0.0, batch_size=1)
    with pytest.raises(ValueError, match="response must be None or a non-empty str"):
        sft_example(tok, question(1), "")
    with pytest.raises(ValueError, match="messages must hold an assistant message"):
        sft_example(tok, question(1))
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    no_end = ChatTokenizer(tok.bpe, tok.special, plain)  # no end-of-turn token at all
    with pytest.raises(ValueError, match="with the end-of-turn token"):
        sft_example(no_end, question(1), "a")


def test_token_kl_equals_torch_kl_div_on_the_kept_positions():
    g = torch.Generator().manual_seed(4)
    logits, ref = torch.randn(2, 5, 9, generator=g), torch.randn(2, 5, 9, generator=g)
    targets = torch.tensor([[IGNORE, 2, 3, IGNORE, IGNORE], [1, IGNORE, 4, 4, 0]])
    keep = targets != IGNORE
    theirs = F.kl_div(ref.log_softmax(-1)[keep], logits.log_softmax(-1)[keep],
                      log_target=True, reduction="none").sum(-1).mean()  # KL(p || p_ref)
    torch.testing.assert_close(token_kl(logits, ref, targets), theirs)
    assert token_kl(ref, ref, targets).abs() < 1e-6


def lora_model(seed: int, b_seed: int):
    """``model(seed)`` frozen, with rank-2 LoRA on block 1's q and v whose B is random
    (``b_seed``), so that the adapters change the output and receive gradients."""
    whole = model(seed)
    whole.requires_grad_(False)
    apply_lora(whole, ["blocks.1.attn.q_proj", "blocks.1.attn.v_proj"], r=2, alpha=4.0)
    with torch.no_grad():
        for name, p in whole.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(generator=torch.Generator().manual_seed(b_seed))
    return whole


def test_upper_blocks_on_cached_states_equal_the_whole_model_and_its_gradients():
    tok = tokenizer()
    examples = [sft_example(tok, question(k), "a" * (k + 1)) for k in range(4)]
    whole = lora_model(0, b_seed=5)
    x, y = pad_batch(examples)
    upper = UpperBlocks(whole, 1)
    hx, hy = pad_batch(lower_states(whole, 1, examples))
    assert torch.equal(hy, y) and hx.shape == (*x.shape, 32)
    full_logits, _ = whole(x)
    upper_logits, _ = upper(hx)
    real = torch.arange(x.shape[1]) < torch.tensor([len(i) for i, _ in examples])[:, None]
    torch.testing.assert_close(upper_logits[real], full_logits[real], atol=1e-5, rtol=1e-5)
    grads = []
    for logits in (full_logits, upper_logits):
        loss = F.cross_entropy(logits.transpose(1, 2), y, ignore_index=IGNORE)
        params = [p for p in whole.parameters() if p.requires_grad]
        grads.append(torch.autograd.grad(loss, params))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert {id(p) for p in upper.parameters()} <= {id(p) for p in whole.parameters()}
    with pytest.raises(ValueError, match=r"start must be an int in \[0, 2\]"):
        UpperBlocks(whole, 3)


def test_head_on_kept_positions_equals_the_full_head_values_and_gradients():
    """kept_logits / kept_logprobs run the vocabulary head on the response positions only:
    values and LoRA gradients equal those of the whole model's full (B, T, V) logits, for
    the whole GPT and for UpperBlocks on cached states."""
    tok = tokenizer()
    examples = [sft_example(tok, question(k), "ab" * (k + 1)) for k in range(4)]
    whole = lora_model(1, b_seed=6)
    params = [p for p in whole.parameters() if p.requires_grad]
    x, y = pad_batch(examples)
    keep = y != IGNORE
    assert 0 < keep.sum() < keep.numel() // 2  # most positions are prompt or padding
    full_logits, _ = whole(x)
    full = sequence_logprobs(full_logits, y)
    full_grads = torch.autograd.grad(full.sum(), params)
    full_ce = F.cross_entropy(full_logits.transpose(1, 2), y, ignore_index=IGNORE)
    for net, inputs in ((whole, x), (UpperBlocks(whole, 1),
                                     pad_batch(lower_states(whole, 1, examples))[0])):
        logits = kept_logits(net, inputs, y)
        assert logits.shape == (keep.sum(), 258)
        torch.testing.assert_close(logits, full_logits[keep], atol=1e-5, rtol=1e-5)
        ours = kept_logprobs(net, inputs, y)
        torch.testing.assert_close(ours, full, atol=1e-5, rtol=1e-5)
        for a, b in zip(torch.autograd.grad(ours.sum(), params), full_grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        if net is whole:
            torch.testing.assert_close(sft_loss(net, examples)[0], full_ce)
