"""Post-training: from a model that continues text to one that answers.

A chat model reads a conversation in the format it was tuned on (ChatML for SmolLM2:
``<|im_start|>role\\ncontent<|im_end|>\\n`` per message) and ends its answer with
``<|im_end|>``. Two steps teach that behaviour on top of a pretrained model:

- **Supervised fine-tuning (SFT):** next-token cross-entropy on example answers, with the
  other tokens left out of the loss (their targets are :data:`IGNORE`), so the model
  learns to write answers, not to predict questions. :func:`sft_example` builds one
  example (every assistant turn of a conversation learned), :func:`sft_loss` is the loss
  and :func:`sft` trains with it.
- **Direct preference optimisation** (DPO, Rafailov et al. 2023): from pairs of a
  preferred and a rejected answer to the same prompt, raise the log-probability ratio
  ``log pi(y) / pi_ref(y)`` of the preferred answer against that of the rejected one.
  :func:`dpo_loss` is the loss and :func:`dpo` trains with it; the reference model's
  log-probabilities are computed once (:func:`response_logprobs`), before training.

Both train with one loop, :func:`finetune` (a loss function of the model and a batch is
all that differs): AdamW on whatever parameters of the model require gradients (LoRA
adapters, see :mod:`lib.lora`), on right-padded batches: with causal attention a padded
position comes after every real one and changes none of them, and its target is
:data:`IGNORE`. Reinforcement learning (:func:`grpo`, below) has a loop of its own: it
samples the replies it learns from, then takes ``updates`` optimizer steps on each batch
of samples (one by default).
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lib.checks import check_int, check_number, check_type, eval_mode, model_device
from lib.model import completions
from lib.tokenizers import ChatTokenizer

__all__ = ["IGNORE", "sft_example", "pad_batch", "sequence_logprobs", "kept_logits",
           "kept_logprobs",
           "response_logprobs", "token_kl", "UpperBlocks", "lower_states",
           "dpo_loss", "finetune", "sft_loss", "sft", "dpo", "reply"]

IGNORE = -100  # a target left out of the loss, as F.cross_entropy's ignore_index
Example = tuple[torch.Tensor, torch.Tensor]  # (inputs (T,), targets (T,))
# A loss for finetune: (model, batch) -> (the scalar to minimise, values to record).
LossFn = Callable[[nn.Module, list], tuple[torch.Tensor, dict]]


def sft_example(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, str]],
                response: str | None = None, mask_prompt: bool = True) -> Example:
    """``(inputs, targets)`` for one conversation: ``messages`` (with ``response`` as one
    more assistant message when it is given), rendered by the chat template and tokenised
    once, up to the end-of-turn token of the last assistant message.

    ``targets`` is ``inputs`` shifted by one. With ``mask_prompt`` every target outside
    the assistant turns is :data:`IGNORE`: each assistant message's tokens and its
    end-of-turn token are learned, in every turn of a multi-turn conversation (TRL's
    ``assistant_only_loss``), the rest only read (see
    :meth:`lib.tokenizers.ChatTokenizer.encode_with_assistant_mask`).
    """
    check_type("tokenizer", tokenizer, ChatTokenizer)
    if response is not None:
        if not isinstance(response, str) or not response:
            raise ValueError(f"response must be None or a non-empty str, got {response!r}")
        messages = [*messages, {"role": "assistant", "content": response}]
    ids, mask = tokenizer.encode_with_assistant_mask(messages)
    if not any(mask):
        raise ValueError("messages must hold an assistant message (or give a response)")
    end = len(mask) - mask[::-1].index(True)  # just after the last assistant token
    ids, learned = torch.tensor(ids[:end]), torch.tensor(mask[1:end])
    inputs, targets = ids[:-1], ids[1:].clone()
    if mask_prompt:
        targets[~learned] = IGNORE
    return inputs, targets


def pad_batch(examples: Sequence[Example], device: torch.device | str | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack examples of different lengths into ``(B, T)`` inputs (``(B, T, C)`` when the
    inputs are hidden states) and ``(B, T)`` targets, padded on the right (inputs with 0,
    targets with :data:`IGNORE`), both on ``device`` (None: where the inputs are)."""
    T = max(len(x) for x, _ in examples)
    first = examples[0][0]
    inputs = first.new_zeros((len(examples), T, *first.shape[1:]))
    targets = torch.full((len(examples), T), IGNORE, dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        inputs[row, :len(x)], targets[row, :len(y)] = x, y
    return inputs.to(device or first.device), targets.to(device or first.device)


class UpperBlocks(nn.Module):
    """The blocks of a GPT from block ``start`` on, its final norm and its head.

    When the blocks below ``start`` are frozen and have no adapters, their output for a
    given example never changes during fine-tuning: :func:`lower_states` computes it
    once, and training runs this module on it. ``forward(h)`` takes those hidden states
    ``(B, T, C)`` and returns ``(logits, None)``, as the whole model returns for the ids.
    The modules are the model's own (adapters included), not copies.
    """

    def __init__(self, model: nn.Module, start: int) -> None:
        super().__init__()
        check_int("start", start, minimum=0, maximum=len(model.blocks))
        self.blocks = model.blocks[start:]
        self.norm_f, self.lm_head = model.norm_f, model.lm_head

    def forward(self, h: torch.Tensor, keep: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, None]:
        """With ``keep`` ``(B, T)`` (bool), the logits ``(N, V)`` of the N kept
        positions only, in row-major order: the head runs on those alone."""
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.norm_f(h if keep is None else h[keep])), None


@torch.no_grad()
def lower_states(model: nn.Module, start: int, examples: Sequence[Example],
                 batch_size: int = 16) -> list[Example]:
    """Each example with its input ids replaced by the hidden states ``(T, C)`` after the
    first ``start`` blocks of ``model`` (eval mode): the inputs of :class:`UpperBlocks`."""
    check_int("start", start, minimum=0, maximum=len(model.blocks))
    out = []
    with eval_mode(model):
        for i in range(0, len(examples), batch_size):
            chunk = examples[i:i + batch_size]
            h = model.embed(pad_batch(chunk, model_device(model))[0])  # (B, T, C)
            for block in model.blocks[:start]:
                h = block(h)
            out += [(h[row, :len(x)].clone(), y) for row, (x, y) in enumerate(chunk)]
    return out


def sequence_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``(B, T, V)`` logits, ``(B, T)`` targets -> ``(B,)``: the sum of
    ``log p(target)`` over the targets that are not :data:`IGNORE`."""
    keep = targets != IGNORE
    logp = logits.float().log_softmax(-1)  # (B, T, V)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
    return (picked * keep).sum(-1)


def kept_logits(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
                ) -> torch.Tensor:
    """The logits ``(N, V)`` at the N positions whose target is not :data:`IGNORE`
    (row-major order), the vocabulary head run at those positions only: the rows of
    ``model(inputs)[0][targets != IGNORE]``, without the prompt positions' head."""
    keep = targets != IGNORE
    if isinstance(model, UpperBlocks):
        return model(inputs, keep)[0]
    h = model.embed(inputs)  # (B, T, C)
    for block in model.blocks:
        h = block(h)
    return model.lm_head(model.norm_f(h[keep]))  # (N, C) -> (N, V)


def kept_logprobs(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
                  ) -> torch.Tensor:
    """``(B,)``: :func:`sequence_logprobs` of ``model(inputs)``, from :func:`kept_logits`."""
    keep = targets != IGNORE
    logp = kept_logits(model, inputs, targets).float().log_softmax(-1)  # (N, V)
    picked = logp.gather(-1, targets[keep].unsqueeze(-1)).squeeze(-1)  # (N,)
    out = picked.new_zeros(keep.shape)  # (B, T), 0 where the target is IGNORE
    out[keep] = picked
    return out.sum(-1)


@torch.no_grad()
def response_logprobs(model: nn.Module, examples: Sequence[Example],
                      batch_size: int = 16) -> torch.Tensor:
    """``(N,)``: for each example, the model's log-probability of its response (the
    sum over the targets that are not :data:`IGNORE`), in eval mode."""
    out = []
    with eval_mode(model):
        for i in range(0, len(examples), batch_size):
            inputs, targets = pad_batch(examples[i:i + batch_size], model_device(model))
            out.append(kept_logprobs(model, inputs, targets))
    return torch.cat(out)


def token_kl(logits: torch.Tensor, ref_logits: torch.Tensor,
             targets: torch.Tensor) -> torch.Tensor:
    """Mean over the positions whose target is not :data:`IGNORE` of
    ``KL(p || p_ref) = sum_v p(v) (log p(v) - log p_ref(v))``, the divergence of the
    model's next-token distribution from the reference's, over the whole vocabulary."""
    logp = logits.float().log_softmax(-1)  # (B, T, V)
    logq = ref_logits.float().log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)  # (B, T)
    return kl[targets != IGNORE].mean()


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's loss from the log-probabilities ``(B,)`` of the chosen and rejected
    responses under the policy and the reference:

        r = beta * (log pi(y) - log pi_ref(y))          (the implicit reward)
        loss = mean(-log sigmoid(r_chosen - r_rejected))

    Returns ``(loss, r_chosen, r_rejected)``, the rewards detached (for logging)."""
    r_chosen = beta * (chosen - ref_chosen)
    r_rejected = beta * (rejected - ref_rejected)
    loss = -F.logsigmoid(r_chosen - r_rejected).mean()
    return loss, r_chosen.detach(), r_rejected.detach()


def finetune(model: nn.Module, data: Sequence, loss_fn: LossFn, steps: int, lr: float,
             batch_size: int = 8, seed: int = 0) -> list[dict[str, float]]:
    """The fine-tuning loop that SFT and DPO share: ``steps`` AdamW steps on the model's
    trainable parameters (those with ``requires_grad``, e.g. LoRA adapters).

    Each step draws ``batch_size`` items of ``data`` without replacement (a generator
    seeded with ``seed``) and calls ``loss_fn(model, batch)``, which returns the scalar
    loss to minimise and a dict of values to record. Returns one dict per step: the
    ``loss`` and those values, as floats. The model trains in train mode and is left in
    eval mode.
    """
    check_type("model", model, nn.Module, "torch.nn.Module")
    if not isinstance(data, Sequence) or len(data) == 0:
        raise ValueError(f"data must be a non-empty list, got {type(data).__name__}")
    check_int("steps", steps)
    check_number("lr", lr, low=0, low_open=True)
    check_int("batch_size", batch_size, maximum=len(data))
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters (apply_lora adds some)")
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    log = []
    model.train()
    for _ in range(steps):
        pick = torch.randperm(len(data), generator=generator)[:batch_size]
        loss, values = loss_fn(model, [data[i] for i in pick])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        log.append({"loss": loss.item(), **{k: float(v) for k, v in values.items()}})
    model.eval()
    return log


def sft_loss(model: nn.Module, batch: Sequence[Example]) -> tuple[torch.Tensor, dict]:
    """SFT's loss on a batch of examples: the mean cross-entropy over the targets that
    are not :data:`IGNORE` (the response tokens)."""
    inputs, targets = pad_batch(batch, model_device(model))
    logits = kept_logits(model, inputs, targets)  # (N, V), response positions only
    loss = F.cross_entropy(logits.float(), targets[targets != IGNORE])  # in float32
    return loss, {}


def sft(model: nn.Module, examples: Sequence[Example], steps: int, lr: float,
        batch_size: int = 8, seed: int = 0) -> list[float]:
    """Supervised fine-tuning: :func:`finetune` with :func:`sft_loss` on ``examples``
    (from :func:`sft_example`). Returns the loss of every step; the model is left in
    eval mode."""
    log = finetune(model, examples, sft_loss, steps, lr, batch_size, seed)
    return [row["loss"] for row in log]


def dpo(model: nn.Module, pairs: Sequence[tuple[Example, Example]],
        ref_logps: torch.Tensor, steps: int, lr: float, beta: float,
        batch_size: int = 8, seed: int = 0) -> list[dict[str, float]]:
    """DPO: :func:`finetune` with :func:`dpo_loss` over ``pairs`` of (chosen, rejected)
    examples. ``ref_logps`` ``(N, 2)`` holds the reference model's log-probabilities of
    each pair's chosen and rejected response (computed once). Returns, per step, the
    loss, the mean reward margin and the reward accuracy; the model is left in eval
    mode."""
    check_number("beta", beta, low=0, low_open=True)
    if not isinstance(ref_logps, torch.Tensor) or ref_logps.shape != (len(pairs), 2):
        raise ValueError(f"ref_logps must be a ({len(pairs)}, 2) tensor, one row per "
                         f"pair, got {getattr(ref_logps, 'shape', ref_logps)!r}")

    def loss_fn(model: nn.Module, batch: list) -> tuple[torch.Tensor, dict]:
        chosen_rejected = [c for (c, _), _ in batch] + [r for (_, r), _ in batch]
        # chosen rows first, then rejected
        inputs, targets = pad_batch(chosen_rejected, model_device(model))
        chosen, rejected = kept_logprobs(model, inputs, targets).chunk(2)
        ref = torch.stack([ref for _, ref in batch]).to(inputs.device)  # (B, 2)
        loss, r_chosen, r_rejected = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1],
                                              beta)
        margin = r_chosen - r_rejected
        return loss, {"margin": margin.mean(), "accuracy": (margin > 0).float().mean()}

    return finetune(model, list(zip(pairs, ref_logps)), loss_fn, steps, lr, batch_size,
                    seed)


def reply(model: nn.Module, tokenizer, messages: Sequence[Mapping[str, str]],
          max_new_tokens: int = 32) -> str:
    """The model's greedy answer to ``messages`` (chat-formatted by ``tokenizer``):
    generation stops at the end-of-turn token (left out) or after ``max_new_tokens``."""
    prompt, end = tokenizer.encode_chat(messages), tokenizer.end_of_turn_id
    prompt_ids = torch.tensor([prompt], device=model_device(model))  # where the model is
    out = model.generate(prompt_ids, max_new_tokens, temperature=0.0, stop_id=end)
    answer = completions(out, len(prompt), end)[0]
    return tokenizer.decode(answer[:-1] if answer[-1:] == [end] else answer)


# ------------------------------------------------------------------------------------
# Reinforcement learning with verifiable rewards (appendix F, issue 31): from REINFORCE
# to GRPO. A policy samples several responses per prompt (:func:`rollout`), a program
# scores each one, the scores become advantages relative to the prompt's group
# (:func:`group_advantages`), and a clipped, token-level surrogate (:func:`policy_loss`)
# with an optional KL penalty to a reference model (:func:`kl_estimate`) turns them into
# a gradient. :func:`grpo` is the loop.
# ------------------------------------------------------------------------------------

from lib.checks import check_choice  # noqa: E402  (kept in this block to merge cleanly)
from lib.model import left_pad  # noqa: E402

__all__ += ["group_advantages", "token_logprobs", "kl_estimate", "policy_loss",
            "rollout", "grpo"]

ADVANTAGE_SCALES = ("group", "batch", "none")
KL_KINDS = ("k1", "k2", "k3")
AGGREGATES = ("sequence", "token", "constant")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group",
                     eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantages ``(N,)`` from the rewards ``(N,)`` of ``N / group_size``
    groups, each group the ``group_size`` consecutive responses to one prompt:

        A_i = (r_i - mean(group)) / (std + eps)

    ``scale`` picks the ``std``: ``"group"`` the group's (DeepSeekMath's GRPO),
    ``"batch"`` that of all ``N`` rewards, ``"none"`` divides by nothing (``A_i = r_i -
    mean(group)``, Dr. GRPO, Liu et al. 2025, arXiv:2503.20783: a group whose rewards
    barely differ would otherwise weigh as much as one whose rewards differ a lot). The
    std is the sample one (divisor ``n - 1``), as TRL's ``nanstd``; ``eps`` keeps a
    group of equal rewards (std 0, advantages 0: no signal) finite."""
    check_int("group_size", group_size, minimum=2)
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or (
            len(rewards) % group_size):
        raise ValueError(f"rewards must be a 1-D tensor whose length group_size "
                         f"({group_size}) divides, got "
                         f"{getattr(rewards, 'shape', rewards)}")
    check_choice("scale", scale, ADVANTAGE_SCALES)
    check_number("eps", eps, low=0)
    groups = rewards.view(-1, group_size)  # (prompts, group_size)
    centred = (groups - groups.mean(1, keepdim=True)).flatten()
    if scale == "none":
        return centred
    if scale == "batch":
        return centred / (rewards.std() + eps)
    return centred / (groups.std(1).repeat_interleave(group_size) + eps)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``(B, T, V)`` logits, ``(B, T)`` targets -> ``(B, T)``: ``log p(target)`` in
    float32 at each position, 0 where the target is :data:`IGNORE` (summed over a row,
    :func:`sequence_logprobs`)."""
    logp = logits.float().log_softmax(-1)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked * (targets != IGNORE)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                kind: str = "k3") -> torch.Tensor:
    """Per-sample estimates of ``KL(pi || pi_ref)`` from the log-probabilities, under
    the policy ``pi`` and the reference, of tokens drawn from ``pi`` (Schulman,
    "Approximating KL divergence", 2020). With ``log_r = ref_logprobs - logprobs``:

        k1 = -log_r                  unbiased, can be negative
        k2 = log_r ** 2 / 2          biased, >= 0
        k3 = exp(log_r) - 1 - log_r  unbiased, >= 0 (GRPO's, TRL's)

    Near the reference k2 and k3 have a lower variance than k1; far from it k3's can be
    higher. Same shape as the inputs; average over samples for the estimate. As a loss
    term (samples held fixed, on-policy), for one token, the mean gradient of k3 is that
    of ``KL(pi_ref || pi)``, that of k1 is zero (Tang & Munos 2025) and that of k2 is
    that of ``KL(pi || pi_ref)`` (Liu et al. 2025, arXiv:2510.01555). Summed over a
    sequence's tokens the mean gradient is that of neither sequence-level KL (Tang &
    Munos 2025)."""
    check_choice("kind", kind, KL_KINDS)
    log_r = ref_logprobs - logprobs
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return log_r ** 2 / 2
    return log_r.exp() - 1 - log_r


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, clip: float = 0.2,
                clip_high: float | None = None, aggregate: str = "sequence",
                max_length: int | None = None, ref_logprobs: torch.Tensor | None = None,
                beta: float = 0.0) -> torch.Tensor:
    """The clipped surrogate loss of PPO as GRPO applies it, per token. ``logprobs``
    ``(B, T)`` (with gradient), ``old_logprobs`` ``(B, T)`` (of the policy that sampled
    the responses, no gradient), ``advantages`` ``(B,)`` (one per response, e.g.
    :func:`group_advantages`), ``mask`` ``(B, T)`` (1 on response tokens). Per token,
    with ``ratio = exp(logprobs - old_logprobs)``:

        loss_t = -min(ratio * A, clip(ratio, 1 - clip, 1 + clip_high) * A)
                 + beta * k3(logprobs, ref_logprobs)     (with ref_logprobs given)

    ``clip_high`` defaults to ``clip`` (DAPO raises it: "clip-higher"). ``aggregate``
    says how the masked tokens' losses become one number, which is where the methods
    differ:

    - ``"sequence"``: mean over each response's tokens, then over responses (GRPO;
      TRL's ``"grpo"``): a token of a long response weighs less than a short one's.
    - ``"token"``: sum over all tokens / their number (DAPO; TRL's ``"dapo"``,
      ``"bnpo"``): every token weighs the same.
    - ``"constant"``: sum over all tokens / (B * ``max_length``), Dr. GRPO's (TRL's
      ``"dr_grpo"``) when ``max_length`` is the maximum response length (default T).

    With one update per batch ``old_logprobs`` equals ``logprobs`` in value: the ratio
    is 1 and the gradient REINFORCE's, ``-A * grad log pi`` per token."""
    shape = tuple(getattr(logprobs, "shape", ()))
    for name, t, want in (("logprobs", logprobs, shape[:2]), ("mask", mask, shape),
                          ("old_logprobs", old_logprobs, shape),
                          ("advantages", advantages, shape[:1])):
        if not isinstance(t, torch.Tensor) or len(shape) != 2 or t.shape != want:
            raise ValueError(f"{name} must be a tensor of shape {want} (logprobs "
                             f"(B, T), advantages (B,)), got {getattr(t, 'shape', t)}")
    check_number("clip", clip, low=0, low_open=True)
    high = check_number("clip_high", clip_high, low=0, low_open=True, optional=True)
    check_choice("aggregate", aggregate, AGGREGATES)
    check_number("beta", beta, low=0)
    ratio, A = (logprobs - old_logprobs).exp(), advantages[:, None].to(logprobs.dtype)
    bounded = ratio.clamp(1 - clip, 1 + (clip if high is None else high))
    per_token = -torch.minimum(ratio * A, bounded * A)
    if ref_logprobs is not None and beta > 0:
        per_token = per_token + beta * kl_estimate(logprobs, ref_logprobs, "k3")
    mask = mask.to(per_token.dtype)
    per_token = per_token * mask
    if aggregate == "sequence":
        return (per_token.sum(1) / mask.sum(1).clamp(min=1)).mean()
    if aggregate == "token":
        return per_token.sum() / mask.sum().clamp(min=1)
    return per_token.sum() / (len(mask) * (max_length or mask.size(1)))


@torch.no_grad()
def rollout(model: nn.Module, prompts: Sequence[Sequence[int]], group_size: int,
            max_new_tokens: int, stop_id: int, temperature: float = 1.0,
            generator: torch.Generator | None = None
            ) -> tuple[list[Example], list[list[int]]]:
    """``group_size`` sampled responses to each of ``prompts`` (token id lists), drawn
    in one batch by :meth:`lib.model.GPT.generate` (left-padded prompts, KV cache, each
    row stopping at ``stop_id``, at most ``max_new_tokens``). Returns, group after
    group (prompt ``i``'s responses at rows ``i * G`` to ``(i + 1) * G - 1``,
    ``G = group_size``):

    - one :data:`Example` per response, ``inputs`` = prompt + response minus its last
      token, ``targets`` the response's tokens at their positions and :data:`IGNORE`
      elsewhere (score them with :func:`token_logprobs`, batch with :func:`pad_batch`);
    - the responses' token ids, ending with ``stop_id`` where the row stopped."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token id lists, got "
                         f"{type(prompts).__name__}")
    check_int("group_size", group_size)
    check_int("max_new_tokens", max_new_tokens)
    repeated = [list(p) for p in prompts for _ in range(group_size)]
    ids, attention = left_pad(repeated, pad_id=stop_id, device=model_device(model))
    out = model.generate(ids, max_new_tokens, temperature=temperature, stop_id=stop_id,
                         attention_mask=attention, generator=generator)
    responses = completions(out, ids.size(1), stop_id)
    examples = []
    for prompt, response in zip(repeated, responses):
        inputs = torch.tensor(prompt + response[:-1])
        targets = torch.tensor([IGNORE] * (len(prompt) - 1) + response)
        examples.append((inputs, targets))
    return examples, responses


def grpo(model: nn.Module, prompts: Sequence[Sequence[int]],
         reward_fn: Callable[[int, list[int]], float], steps: int, lr: float,
         stop_id: int, group_size: int = 4, prompts_per_step: int = 4,
         max_new_tokens: int = 16, temperature: float = 1.0, updates: int = 1,
         clip: float = 0.2, beta: float = 0.0, ref_model: nn.Module | None = None,
         scale: str = "group", aggregate: str = "sequence",
         seed: int = 0) -> list[dict[str, float]]:
    """Group relative policy optimisation (DeepSeekMath, Shao et al. 2024), ``steps``
    times: draw ``prompts_per_step`` of ``prompts`` (a generator seeded with ``seed``),
    sample ``group_size`` responses to each (:func:`rollout`, eval mode), score them with
    ``reward_fn(prompt_index, response_ids)``, make :func:`group_advantages` (``scale``),
    take ``updates`` AdamW steps on the trainable parameters with :func:`policy_loss`
    (``clip``, ``aggregate``; old log-probabilities: the first update's, detached), all
    log-probabilities, the reference's too, of softmax(logits / ``temperature`` > 0), as
    TRL's GRPO. ``beta > 0`` adds ``beta`` times the k3 estimate of the KL to
    ``ref_model`` (frozen, e.g. the starting model); with ``beta = 0`` a given
    ``ref_model``'s KL is measured, not penalised. Returns per step the mean ``reward``,
    the last update's ``loss``, the mean response ``length``, the mean per-token ``kl``
    (k3, of the sampling policy; 0 without a reference), ``zero_signal`` (the share of
    groups of equal rewards: no signal). ``aggregate="constant"`` divides by ``B *
    max_new_tokens`` (TRL's ``dr_grpo``). Ends in eval mode; assumes no dropout."""
    if not callable(reward_fn):
        raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
    check_int("steps", steps)
    check_number("lr", lr, low=0, low_open=True)
    check_number("temperature", temperature, low=0, low_open=True)
    check_int("prompts_per_step", prompts_per_step, maximum=len(prompts))
    check_int("updates", updates)
    if beta > 0 and not isinstance(ref_model, nn.Module):
        raise ValueError("beta > 0 needs ref_model, the frozen model to stay near")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=lr, weight_decay=0.0)
    shared = _shared_frozen_blocks(model, ref_model)
    picker = torch.Generator().manual_seed(seed)
    sampler = torch.Generator(device=model_device(model)).manual_seed(seed)
    log = []
    for _ in range(steps):
        pick = torch.randperm(len(prompts), generator=picker)[:prompts_per_step].tolist()
        examples, responses = rollout(model, [prompts[i] for i in pick], group_size,
                                      max_new_tokens, stop_id, temperature, sampler)
        rewards = torch.tensor([float(reward_fn(pick[k // group_size], r))
                                for k, r in enumerate(responses)], dtype=torch.float64)
        advantages = group_advantages(rewards, group_size, scale)
        groups = rewards.view(-1, group_size)  # zero signal: all of a group's equal
        row = _grpo_update(model, optimizer, examples, advantages, updates, clip,
                           aggregate, beta, ref_model, max_new_tokens, temperature,
                           shared)
        log.append({"reward": rewards.mean().item(), **row,
                    "zero_signal": (groups == groups[:, :1]).all(1).double().mean().item()})
    return log


def _shared_frozen_blocks(model: nn.Module, ref_model: nn.Module | None) -> int:
    """How many of the first blocks of a GPT ``model`` are frozen and equal, with its
    embeddings, to ``ref_model``'s (same types, parameters and buffers): 0 when the
    models are not both GPT-shaped, or their embeddings differ or train. Their output
    is the same for both models, so :func:`grpo` computes it once per batch."""
    parts = ("embed", "blocks", "norm_f", "lm_head")
    if ref_model is None or not all(hasattr(m, a) for m in (model, ref_model)
                                    for a in parts):
        return 0
    mine = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    theirs = {**dict(ref_model.named_parameters()), **dict(ref_model.named_buffers())}

    def same(names: list[str]) -> bool:
        return all(n in theirs and not mine[n].requires_grad
                   and mine[n].shape == theirs[n].shape and torch.equal(mine[n], theirs[n])
                   for n in names)

    lower = [n for n in mine if not n.startswith(("blocks.", "norm_f.", "lm_head."))]
    if not same(lower):
        return 0
    shared = 0
    for i, (a, b) in enumerate(zip(model.blocks, ref_model.blocks)):
        names = [n for n in mine if n.startswith(f"blocks.{i}.")]
        if type(a) is not type(b) or not same(names):
            break
        shared += 1
    return shared


def _grpo_update(model: nn.Module, optimizer: torch.optim.Optimizer,
                 examples: list[Example], advantages: torch.Tensor, updates: int,
                 clip: float, aggregate: str, beta: float,
                 ref_model: nn.Module | None, max_length: int,
                 temperature: float, shared: int = 0) -> dict[str, float]:
    """:func:`grpo`'s ``updates`` optimizer steps on one batch of sampled responses,
    log-probabilities taken at the sampling ``temperature``. The first ``shared``
    blocks (frozen, the reference's too: :func:`_shared_frozen_blocks`) run once for
    the batch; the logits are those of ``model(inputs)``, op for op."""
    device = model_device(model)
    inputs, targets = pad_batch(examples, device)
    mask, advantages = targets != IGNORE, advantages.float().to(device)
    if shared:
        with torch.no_grad(), eval_mode(model):
            h = model.embed(inputs)
            for block in model.blocks[:shared]:
                h = block(h)

    def logits(m: nn.Module) -> torch.Tensor:
        if not shared:
            return m(inputs)[0]
        x = h
        for block in m.blocks[shared:]:
            x = block(x)
        return m.lm_head(m.norm_f(x))

    ref = None
    if ref_model is not None:
        with torch.no_grad(), eval_mode(ref_model):
            ref = token_logprobs(logits(ref_model) / temperature, targets)
    model.train()
    for update in range(updates):
        logprobs = token_logprobs(logits(model) / temperature, targets)
        old = logprobs.detach() if update == 0 else old
        loss = policy_loss(logprobs, old, advantages, mask, clip, aggregate=aggregate,
                           max_length=max_length, ref_logprobs=ref, beta=beta)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    kl = 0.0 if ref is None else float(kl_estimate(old, ref)[mask].mean())
    return {"loss": loss.item(), "kl": kl, "length": float(mask.sum(1).float().mean())}
