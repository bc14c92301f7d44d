"""Turns one step's logits into next token ids: penalties, then greedy argmax or filtered sampling.

Sampling uses the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) i.i.d. picks token i with probability
proportional to p_i, so filtered tokens only need p_i = 0 and nothing is renormalised. The noise is the only
randomness, and a seeded request draws its row of noise from its own generator, always V values per step in
vocabulary order. Every other stage is row-wise and a no-op for neutral values, so a seeded request gets the same
tokens whatever batch it shares a step with.
"""

from __future__ import annotations

import torch

from sglang_pic.sampling.sampling_batch_info import SamplingBatchInfo

# top_k / top_p look at this many best tokens first and fall back to the whole vocabulary only when a nucleus is
# wider: a partial top-k is far cheaper than sorting 150k logits per row, above all on CPU.
_CANDIDATES = 1024


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's private RNG; create once per request and reuse every step so each step draws fresh noise."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % (1 << 64))  # any Python int maps to torch's accepted range
    return generator


class Sampler:
    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """[B, V] logits -> [B] int64 token ids. The input tensor is left untouched (logprobs read it raw)."""
        if logits.shape != (info.batch_size, info.vocab_size):
            expected = (info.batch_size, info.vocab_size)
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match the batch's {expected}")
        logits = adjust_logits(logits.float(), info)
        greedy = torch.argmax(logits, dim=-1)
        if info.is_all_greedy:
            return greedy
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        probs = filter_probs(probs, info)
        sampled = torch.argmax(probs / _exponential_noise(probs, info), dim=-1)
        return torch.where(info.greedy_mask, greedy, sampled)


def adjust_logits(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Penalties, logit bias and the min_new_tokens ban, out of place.

    The repetition penalty goes first so that its sign test sees the model's own logit (as in HF); the OpenAI
    frequency/presence penalties then subtract from the result.
    """
    if info.seen_mask is not None:
        rp = info.repetition_penalties
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(info.seen_mask, penalised, logits)
    if info.output_counts is not None:
        counts = info.output_counts
        logits = logits - info.frequency_penalties * counts - info.presence_penalties * (counts > 0)
    if info.logit_bias is not None:
        logits = logits + info.logit_bias
    if info.ban_rows is not None:
        logits = logits.index_put((info.ban_rows, info.ban_ids), torch.tensor(float("-inf"), device=logits.device))
    return logits


def filter_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the tokens removed by top_k, then top_p (over the mass top_k kept), then min_p.

    Each stage yields a per-row probability cutoff and tokens below it are dropped, so tokens tied with the last
    kept one stay: the result never depends on how a sort orders equal probabilities.
    """
    cutoff = _top_k_top_p_cutoff(probs, info) if info.need_top_k_top_p else None
    if info.need_min_p:
        floor = info.min_ps.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        cutoff = floor if cutoff is None else torch.maximum(cutoff, floor)
    return probs if cutoff is None else probs.masked_fill(probs < cutoff, 0.0)


def _top_k_top_p_cutoff(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """[B, 1] smallest probability each row keeps under top_k then top_p (0 for rows using neither).

    Looks at the best few candidates first; only rows whose nucleus is wider get a full sort.
    """
    vocab = probs.shape[-1]
    top_ks, top_ps = info.top_ks.unsqueeze(1), info.top_ps.unsqueeze(1)
    depth = min(vocab, max(_CANDIDATES, info.max_top_k))
    cutoff, count = _cutoff_within(probs, top_ks, top_ps, depth)
    if depth < vocab:
        too_shallow = (count == depth) & (top_ps < 1.0) & (top_ks == vocab) & ~info.greedy_mask.unsqueeze(1)
        rows = too_shallow.squeeze(1).nonzero().squeeze(1)
        if rows.numel():
            cutoff[rows] = _cutoff_within(probs[rows], top_ks[rows], top_ps[rows], vocab)[0]
    return torch.where((top_ks < vocab) | (top_ps < 1.0), cutoff, torch.zeros_like(cutoff))


def _cutoff_within(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, depth: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cutoff and kept count ([N, 1] each) judged from each row's `depth` best probabilities.

    Exact whenever the count stays below `depth` or the row's top_k fits in it; values and running sums over the
    best tokens do not depend on `depth`, so neither does the cutoff.
    """
    vocab = probs.shape[-1]
    if depth < vocab:
        values = probs.topk(depth, dim=-1).values
    else:
        values = probs.sort(dim=-1, descending=True).values
    ranks = torch.arange(depth, device=probs.device).unsqueeze(0)
    in_top_k = ranks < top_ks
    kept = values.masked_fill(~in_top_k, 0.0)
    cumulative = kept.cumsum(dim=-1)
    # Mass top_k kept: a finite top_k fits in `depth`; without one it is the whole row.
    mass = torch.where(top_ks < vocab, cumulative[:, -1:], probs.sum(dim=-1, keepdim=True))
    # The nucleus: tokens whose better-ranked predecessors have not yet reached top_p of that mass.
    inside = in_top_k & ((cumulative - kept < top_ps * mass) | (top_ps >= 1.0))
    count = inside.sum(dim=-1, keepdim=True).clamp_(min=1)  # 0 only for a NaN row; keep gather in range
    return values.gather(1, count - 1), count


def _exponential_noise(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Exp(1) noise as -log(1 - U): uniform draws are several times cheaper than exponential_ on CPU."""
    uniform = torch.empty_like(probs)
    if len(info.seeded_rows) < info.batch_size:
        uniform.uniform_()
    for row in info.seeded_rows:  # drawn where the generator lives (the CPU): on any device a seed gives the same noise
        generator = info.generators[row]
        draw = torch.rand(uniform.shape[-1], generator=generator, dtype=uniform.dtype, device=generator.device)
        uniform[row].copy_(draw)
    noise = torch.log1p(-uniform).neg_()
    # U = 0 gives exactly 0, which would turn a filtered token's 0 / 0 into NaN, and argmax picks NaN.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
