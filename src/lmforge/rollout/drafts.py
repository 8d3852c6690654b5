"""Draft tokens for speculative decoding in the continuous-batching engine (``continuous.ContinuousDecoder``,
``env.draft_tokens``): guesses from token n-grams seen before, which the engine checks in one forward and
keeps only where the row's own draw gives them (``continuous`` module doc)."""

from __future__ import annotations


class NgramDrafter:
    """Draft tokens for speculative decoding, from token n-grams seen before (no second model).

    ``observe(tokens)`` counts, for every ``n`` consecutive tokens, the token that came next;
    ``propose(context, limit, stop_ids)`` follows the most frequent continuation of the last ``n``
    tokens while it is confident -- seen at least ``min_count`` times and at least ``min_share`` of
    what followed that context -- up to ``limit`` tokens or a stop token. A context's counts are
    halved when one passes ``max_count``, so the table follows a policy that changes; past
    ``max_contexts`` contexts, those seen fewer than ``min_count`` times (which never draft) are
    dropped, and if that leaves more than half, the table starts again. Kept across RL steps, the table learns the text
    the policy writes over and over (a tool call's syntax). Where it has nothing confident,
    ``propose`` copies from the row's own ids what followed the last occurrence of the row's last
    two tokens (``index``): a number copied from the question or from a tool's result.
    """

    def __init__(
        self,
        max_tokens: int,
        n: int = 4,
        min_count: int = 2,
        min_share: float = 0.75,
        max_count: int = 64,
        max_contexts: int = 1_000_000,
    ):
        if max_tokens < 1 or n < 1:
            raise ValueError(f"NgramDrafter needs max_tokens >= 1 and n >= 1, got {max_tokens}, {n}")
        self.max_tokens, self.n, self.min_count, self.min_share = max_tokens, n, min_count, min_share
        self.max_count, self.max_contexts = max_count, max_contexts
        self.table: dict[tuple[int, ...], dict[int, int]] = {}

    def observe(self, tokens: list[int]) -> None:
        n, table = self.n, self.table
        if len(table) > self.max_contexts:
            self._prune()
        for i in range(n, len(tokens)):
            counts = table.setdefault(tuple(tokens[i - n : i]), {})
            token = tokens[i]
            counts[token] = counts.get(token, 0) + 1
            if counts[token] > self.max_count:
                for t in list(counts):
                    counts[t] //= 2
                    if not counts[t]:
                        del counts[t]

    def _prune(self) -> None:
        table = self.table
        for key in [key for key, counts in table.items() if sum(counts.values()) < self.min_count]:
            del table[key]
        if len(table) > self.max_contexts // 2:
            table.clear()

    @staticmethod
    def index(ids: list[int]) -> dict:
        """For ``propose``'s lookup in a row's own ids: the last position of each pair of consecutive
        tokens that some token follows."""
        return {(ids[i - 1], ids[i]): i for i in range(1, len(ids) - 1)}

    def propose(
        self,
        context: list[int],
        limit: int,
        stop_ids: list[int],
        ids: list[int] | None = None,
        index: dict | None = None,
    ) -> list[int]:
        """Up to ``limit`` tokens to follow ``context`` (its last ``n`` tokens are what counts). When the
        table has nothing confident and the row's ``ids`` and their ``index`` are given: what followed the
        last occurrence in ``ids`` of the context's last two tokens (a copy from the prompt or a tool's
        result), up to ``limit`` tokens or a stop token."""
        draft = self._from_table(context, limit, stop_ids)
        if draft or index is None or not context:
            return draft
        at = index.get(tuple(context[-2:])) if len(context) > 1 else None
        if at is None:
            return draft
        for token in ids[at + 1 : at + 1 + limit]:
            draft.append(token)
            if token in stop_ids:
                break
        return draft

    def _from_table(self, context: list[int], limit: int, stop_ids: list[int]) -> list[int]:
        if len(context) < self.n:
            return []
        key, draft = tuple(context[-self.n :]), []
        while len(draft) < limit:
            counts = self.table.get(key)
            if not counts:
                break
            token, count = max(counts.items(), key=lambda item: item[1])
            if count < self.min_count or count < self.min_share * sum(counts.values()):
                break
            draft.append(token)
            if token in stop_ids:
                break
            key = key[1:] + (token,)
        return draft
