"""The forward of preference pairs without padding: a pair's prompt once, its two completions as
branches of one causal tree, pairs packed end to end into rows that run without padding.

A pair ``(prompt, chosen, rejected)`` whose two sides start with the same prompt tokens becomes one
segment ``prompt | chosen completion | rejected completion``: position ids count from the prompt's
start in each branch (the rejected branch restarts where the chosen one did), and the attention
mask lets a completion token see its prompt and the earlier tokens of its own branch, never the
other branch or another pair. Every token then sees exactly what it sees when its side runs alone,
so the log-probabilities are the per-side forward's, while the prompt runs once and no padding runs
at all (a batch of unequal pairs padded to its longest row spends a third or more of the work on
padding). Where the two prompts differ, the segment's branches are the whole sides.

A side's last trained token is only a target: the inputs of a branch stop before it. Segments are
laid end to end into rows of at most ``row_tokens`` tokens (one segment alone if it is longer);
each row is one forward of batch 1. The embedding lookup runs once for all rows (one vocabulary-
sized embedding gradient per forward, not one per row), and the LM head runs only on the positions
that predict a trained token, once for all rows.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core.ops import selective_log_softmax
from ..data.preference import PreferencePair
from ..runtime.optim import PLAIN_HEAD_MODELS, decoder_of

Tensor = torch.Tensor

# Rows of about this many tokens: long enough for the matmuls to run near the CPU's peak, short
# enough that the attention over a row (which computes every pair of its positions, masked or not)
# stays a few percent of the work. The no-grad forward of the DPO benchmark's first 8 pairs
# (SmolLM2-135M, fp32, 1 thread, best of 5 on the loaded 2-core EPYC): rows of <= 100 tokens 2.62 s,
# <= 200: 1.96 s, <= 400: 2.00 s, all 583 tokens in one row: 3.11 s.
ROW_TOKENS = 256


@dataclasses.dataclass
class PairPack:
    """b pairs as packed rows; the 2b sides are numbered chosen 0..b-1, then rejected b..2b-1."""

    input_ids: list[Tensor]  # per row (L,)
    position_ids: list[Tensor]  # per row (L,): the token's position in its own side
    attend: list[Tensor]  # per row (L, L) bool: query i may attend to key j
    predict_at: Tensor  # (N,) index into the rows laid end to end: the position that predicts each trained token
    targets: Tensor  # (N,) the trained tokens
    side_of: Tensor  # (N,) the side (0..2b-1) each trained token belongs to
    num_sides: int
    num_tokens: int  # the tokens of the 2b sides (a shared prompt counted on both): the data, not the layout

    def to(self, device) -> "PairPack":
        move = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("input_ids", "position_ids", "attend"):
            move[name] = [t.to(device) for t in move[name]]
        for name in ("predict_at", "targets", "side_of"):
            move[name] = move[name].to(device)
        return PairPack(**move)


def _segment(pair: PreferencePair) -> tuple[list[int], list[int], list[int], list[tuple[int, int, int]]]:
    """One pair -> (tokens, positions, branch per token: 0 prompt, 1 chosen, 2 rejected, and its trained
    tokens as (index in the segment of the position that predicts it, token, 0 chosen / 1 rejected))."""
    sides = (pair.chosen, pair.rejected)
    starts = [side.loss_mask.index(1) for side in sides]
    shared = starts[0] == starts[1] and sides[0].input_ids[: starts[0]] == sides[1].input_ids[: starts[1]]
    prefix = starts[0] if shared else 0
    tokens, positions, branch = list(sides[0].input_ids[:prefix]), list(range(prefix)), [0] * prefix
    trained = []
    for which, side in enumerate(sides):
        # token k (k >= 1) is predicted by position k - 1; the inputs stop before the last trained token
        ks = [k for k in range(1, len(side.input_ids)) if side.loss_mask[k]]
        last = ks[-1] if ks else prefix
        offset = len(tokens) - prefix  # segment index of side position p >= prefix
        trained += [((k - 1) if k - 1 < prefix else offset + k - 1, side.input_ids[k], which) for k in ks]
        tokens += side.input_ids[prefix:last]
        positions += list(range(prefix, max(prefix, last)))
        branch += [which + 1] * max(0, last - prefix)
    return tokens, positions, branch, trained


def _attend(segment_of: Tensor, branch: Tensor) -> Tensor:
    """(L, L) bool: causal, within a segment, a key in the prompt or in the query's own branch."""
    length = len(branch)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same_segment = segment_of[:, None] == segment_of[None, :]
    visible = (branch[None, :] == 0) | (branch[None, :] == branch[:, None])
    return causal & same_segment & visible


def segment_length(pair: PreferencePair) -> int:
    """The tokens a pair runs as in :func:`pack_pairs` (its prompt once, both completions but their last
    trained tokens)."""
    return len(_segment(pair)[0])


def pack_pairs(pairs: list[PreferencePair], row_tokens: int = ROW_TOKENS) -> PairPack:
    """b pairs -> :class:`PairPack`: each pair one segment, segments in order into rows of at most
    ``row_tokens`` tokens (a longer segment is a row of its own)."""
    num = len(pairs)
    rows: list[list[tuple]] = [[]]
    for index, pair in enumerate(pairs):
        segment = _segment(pair)
        if rows[-1] and sum(len(s[0]) for _, s in rows[-1]) + len(segment[0]) > row_tokens:
            rows.append([])
        rows[-1].append((index, segment))
    input_ids, position_ids, attend = [], [], []
    predict_at, targets, side_of = [], [], []
    start = 0  # index of the row's first token in the rows laid end to end
    for row in rows:
        segment_of, branch = [], []
        for number, (index, (tokens, positions, branches, trained)) in enumerate(row):
            offset = start + len(segment_of)
            predict_at += [offset + at for at, _, _ in trained]
            targets += [token for _, token, _ in trained]
            side_of += [index + which * num for _, _, which in trained]
            segment_of += [number] * len(tokens)
            branch += branches
        input_ids.append(torch.tensor([t for _, segment in row for t in segment[0]], dtype=torch.long))
        position_ids.append(torch.tensor([p for _, segment in row for p in segment[1]], dtype=torch.long))
        attend.append(_attend(torch.tensor(segment_of), torch.tensor(branch)))
        start += len(segment_of)
    num_tokens = sum(len(side.input_ids) for pair in pairs for side in pair)
    return PairPack(
        input_ids,
        position_ids,
        attend,
        torch.tensor(predict_at, dtype=torch.long),
        torch.tensor(targets, dtype=torch.long),
        torch.tensor(side_of, dtype=torch.long),
        2 * num,
        num_tokens,
    )


def _attention_mask(model, attend: Tensor) -> Tensor:
    """(L, L) bool -> the (1, 1, L, L) mask the model's attention takes as given: bool for SDPA,
    additive (0 where allowed, the dtype's minimum elsewhere) for the eager attention."""
    implementation = getattr(model.config, "_attn_implementation", "sdpa")
    if implementation == "sdpa":
        return attend[None, None]
    if implementation == "eager":
        blocked = torch.finfo(torch.float32).min
        return torch.zeros(attend.shape, device=attend.device).masked_fill(~attend, blocked)[None, None]
    raise ValueError(
        f"the pair forward needs SDPA or eager attention for its tree mask; this model uses {implementation!r}"
    )


def pair_logits(model, pack: PairPack) -> Tensor:
    """Logits (N, V) that predict ``pack.targets``: one forward of batch 1 per row, the embedding
    lookup once, the LM head on the N predicting positions only (plain-head models; others get
    their full logits, then the N rows)."""
    lengths = [len(ids) for ids in pack.input_ids]
    window = getattr(model.config, "sliding_window", None)  # the tree mask is full causal within a side
    longest = max((int(positions.max()) + 1 for positions in pack.position_ids if len(positions)), default=0)
    if window and longest > window:
        raise ValueError(
            f"a side of {longest} tokens is longer than the model's sliding attention window "
            f"({window}), which the packed pair forward does not apply; set data.max_len <= {window}"
        )
    plain = getattr(model.config, "model_type", "") in PLAIN_HEAD_MODELS and decoder_of(model) is not None
    forward = decoder_of(model) if plain else model
    embeds = model.get_input_embeddings()(torch.cat(pack.input_ids))  # (sum L, H)
    outputs = []
    for part, positions, attend in zip(embeds.split(lengths), pack.position_ids, pack.attend):
        out = forward(
            inputs_embeds=part[None],
            position_ids=positions[None],
            attention_mask=_attention_mask(model, attend),
            use_cache=False,
        )
        outputs.append(out.last_hidden_state[0] if plain else out.logits[0])
    picked = torch.cat(outputs)[pack.predict_at]  # (N, H) or (N, V)
    return model.get_output_embeddings()(picked) if plain else picked


def side_logps(logits: Tensor, pack: PairPack) -> tuple[Tensor, Tensor]:
    """Logits (N, V) -> each side's summed log-probability of its trained tokens and their count:
    (2b,) each, chosen sides first."""
    # fp32 math at least (fp64 stays fp64)
    token_logps = selective_log_softmax(logits if logits.dtype == torch.float64 else logits.float(), pack.targets)
    sums = torch.zeros(pack.num_sides, dtype=token_logps.dtype, device=token_logps.device)
    counts = torch.zeros(pack.num_sides, dtype=torch.long, device=token_logps.device)
    return sums.index_add(0, pack.side_of, token_logps), counts.index_add(
        0, pack.side_of, torch.ones_like(pack.side_of)
    )
