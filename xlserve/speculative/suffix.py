"""Suffix matching (``--speculative suffix``): the longest earlier match of the request's
latest tokens, in its own prompt and output or in earlier answers (a bounded store shared
by every request), and the continuation most of the longest matches agree on.

Unlike ``ngram`` (the latest match of at most four tokens, followed blindly), this looks
at every earlier occurrence of the last two tokens, extends each match backwards (up to 32
tokens), and proposes token by token while the matches at least half as long as the best
one mostly agree: a context seen many times with one continuation (a JSON envelope, a
tool's name and argument keys, an answer given before) yields long proposals, a context
with scattered continuations short ones or none. Earlier answers make the second turn of
a repeated request, or the hundredth call of the same tool, predictable.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque

from xlserve.speculative.proposer import Proposer

MATCH = 32  # longest match compared backwards
CANDIDATES = 64  # most recent occurrences of the last two tokens looked at
AGREE = 0.5  # share of the long matches that must continue with the proposed token
SHARED_TOKENS = 1 << 18  # earlier answers kept for every request (about 2 MiB of ids)


class TokenIndex:
    """A token sequence with the end positions of every bigram in it, extended as it grows."""

    def __init__(self):
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, int], list[int]] = defaultdict(list)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            if len(self.tokens) > 1:
                self.ends[(self.tokens[-2], token)].append(len(self.tokens) - 1)

    def matches(self, query: list[int], before: int) -> list[tuple[int, int]]:
        """(length, end) of the latest occurrences of ``query``'s last two tokens ending before
        ``before``, each extended backwards as far as it agrees with ``query``."""
        if len(query) < 2:
            return []
        found = []
        for end in reversed(self.ends.get((query[-2], query[-1]), ())):
            if end >= before:
                continue
            length = 2
            while length < MATCH and end - length >= 0 and length < len(query) \
                    and self.tokens[end - length] == query[-1 - length]:
                length += 1
            found.append((length, end))
            if len(found) == CANDIDATES:
                break
        return found


class SuffixProposer(Proposer):
    name = "suffix"
    guesses_ahead = True

    def __init__(self, shared_tokens: int = SHARED_TOKENS):
        self.requests: dict[str, TokenIndex] = {}
        self.shared = TokenIndex()
        self.answers: deque[list[int]] = deque()  # what the shared index holds, oldest first
        self.shared_tokens = shared_tokens

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        return self.propose_scored(request_id, tokens, k)[0]

    def propose_scored(self, request_id: str, tokens: list[int], k: int) -> tuple[list[int], int]:
        """The guesses and the length of the longest match they continue (up to MATCH)."""
        own = self.requests.setdefault(request_id, TokenIndex())
        own.extend(tokens[len(own.tokens):])
        sources = [(own, m) for m in own.matches(tokens, len(tokens) - 1)]  # not the query's own end
        sources += [(self.shared, m) for m in self.shared.matches(tokens, len(self.shared.tokens))]
        if not sources:
            return [], 0
        best = max(length for _, (length, _) in sources)
        if best < 3:  # two tokens alone predict little
            return [], 0
        runs = [(index, end) for index, (length, end) in sources if 2 * length >= best]
        out: list[int] = []
        while len(out) < k and runs:
            votes = Counter(index.tokens[end + 1 + len(out)] for index, end in runs
                            if end + 1 + len(out) < len(index.tokens))
            if not votes:
                break
            token, count = votes.most_common(1)[0]
            if token < 0 or count < AGREE * len(runs):  # an answer's end, or no agreement
                break
            out.append(token)
            runs = [(index, end) for index, end in runs
                    if end + len(out) < len(index.tokens) and index.tokens[end + len(out)] == token]
        return out, best if out else 0

    def reset(self) -> None:
        self.shared, self.answers = TokenIndex(), deque()

    def forget(self, request_id: str, output: list[int]) -> None:
        """Drops the request's index; its answer joins the shared store (the oldest leave)."""
        self.requests.pop(request_id, None)
        if len(output) < 4:
            return
        self.answers.append(list(output))
        self.shared.extend([-1, *output])  # -1: no match crosses from one answer into the next
        if len(self.shared.tokens) > self.shared_tokens:
            while sum(len(a) + 1 for a in self.answers) > self.shared_tokens // 2:
                self.answers.popleft()
            self.shared = TokenIndex()
            for answer in self.answers:
                self.shared.extend([-1, *answer])
