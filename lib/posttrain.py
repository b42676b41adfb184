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
all that differs, so an RL method plugs in the same way): AdamW on whatever parameters of
the model require gradients (LoRA adapters, see :mod:`lib.lora`), on right-padded
batches: with causal attention a padded position comes after every real one and changes
none of them, and its target is :data:`IGNORE`.
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
    """The fine-tuning loop that SFT, DPO and RL share: ``steps`` AdamW steps on the
    model's trainable parameters (those with ``requires_grad``, e.g. LoRA adapters).

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
