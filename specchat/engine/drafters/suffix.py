"""Mode `suffix`: drafts from everything the model has said, indexed by suffix automata. No model.

SuffixDecoding (Oliaro et al. 2024) and SAM-decoding (Hu et al. 2024): find the longest suffix of the
conversation that occurred before, in this conversation or in a corpus of earlier ones (the user's saved
conversations, the model's earlier replies), and draft the continuation seen most often after it. Prompt
lookup (mode lookup) is its special case: a context-only index, matches of at most 3 tokens, and the latest
occurrence's continuation instead of the most frequent one.

Like lookup's, the drafts are a deterministic function of the tokens, so q is one-hot (Proposal.q = None) and
the exact rule keeps sampling exact.

Two suffix automata: one over the corpus (`add_reference`; each sequence ends with a fresh negative separator,
never a real token, so no match spans two sequences), one over the conversation (extended by the new tokens
each round, rebuilt only when the conversation was rewound or replaced, as lookup's index is). Each state
counts its occurrences and remembers its latest one, both kept online.

Choices (made on replays of the tuning prompts, never the held-out ones): at most one draft per matched token
(ALPHA), as a short match is a weak predictor; no draft from a single-token match (MIN_MATCH), mostly a wrong guess;
a draft stops where the product of the frequencies along it, the chance it is reached and accepted, falls below
MIN_CONFIDENCE (a draft pays above ~0.05, what a position costs); a long match, a copy in progress, drafts past K (MAX_SPEC).

Costs: a round is ~20 us of dict look-ups, nothing beside a verify. The corpus keeps MAX_CORPUS tokens (~45 MB):
past it the oldest sequences go, down to half, and its automaton is rebuilt (amortised O(1) per token). An appended
token counts an occurrence on the suffix-link path, which only a periodic text (a model stuck in a loop) makes
long: the walk stops after MAX_WALK states, where the shortest strings have a single continuation anyway.
"""

from __future__ import annotations

from collections import deque

import torch

from specchat.engine.drafters.base import Drafter, Proposal

MIN_MATCH = 2  # shortest match that drafts
ALPHA = 1.0  # at most round(ALPHA * match length) drafts
MAX_SPEC = 15  # and at most this many, or K if larger (16 positions: the C layer's rows, smallbatch.MAX_ROWS)
MIN_CONFIDENCE = 0.1  # stop before the product of the frequencies along the draft falls below it
MAX_CORPUS = 100_000  # corpus tokens kept (the most recent sequences)
MAX_WALK = 64  # states an appended token counts an occurrence in (the suffix-link path, cut off)


class SuffixAutomaton:
    """The minimal automaton of every substring of a token sequence, built online (Blumer et al. 1985): an appended
    token adds at most two states and O(1) amortised transitions. A state is the set of substrings that end at the
    same positions; its suffix link leads to its longest suffix that ends at more; a transition appends a token."""

    def __init__(self, max_walk: int = MAX_WALK) -> None:
        self.max_walk = max_walk
        self.next: list[dict[int, int]] = [{}]  # state -> {token: state}
        self.link: list[int] = [-1]  # state -> suffix-link state (root: -1)
        self.length: list[int] = [0]  # state -> length of its longest string
        self.count: list[int] = [0]  # state -> occurrences of its strings (end positions)
        self.recent: list[int] = [0]  # state -> end of their latest occurrence (tokens appended by then)
        self.last = 0  # the state of the whole sequence
        self.size = 0  # tokens appended

    def _new_state(self, length: int, next: dict[int, int], link: int, count: int, recent: int) -> int:
        self.next.append(next)
        self.link.append(link)
        self.length.append(length)
        self.count.append(count)
        self.recent.append(recent)
        return len(self.link) - 1

    def append(self, token: int) -> None:
        nxt, link, length = self.next, self.link, self.length
        self.size += 1
        cur = self._new_state(length[self.last] + 1, {}, 0, 0, self.size)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # q also holds longer strings that occur less often: split the shorter ones off into a clone
                clone = self._new_state(length[p] + 1, dict(nxt[q]), link[q], self.count[q], self.recent[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        # the new end position is one more occurrence of every suffix of the sequence: the suffix-link path
        count, recent, s = self.count, self.recent, cur
        for _ in range(self.max_walk):
            if s <= 0:
                break
            count[s] += 1
            recent[s] = self.size
            s = link[s]

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.append(token)

    def step(self, state: int, length: int, token: int) -> tuple[int, int]:
        """Matching statistics: from the longest match (its state and length) of a text, the longest match of the
        text with `token` appended (follow suffix links until `token` can follow)."""
        nxt, link = self.next, self.link
        while state > 0 and token not in nxt[state]:
            state = link[state]
            length = self.length[state]
        child = nxt[state].get(token)
        return (child, length + 1) if child is not None else (0, 0)

    def continuation(self, state: int, k: int, min_confidence: float) -> tuple[list[int], float]:
        """Up to k tokens from `state`: each time the continuation seen most often (ties: the latest), while the
        product of their frequencies (count / all continuations' counts) stays >= min_confidence."""
        count, recent = self.count, self.recent
        ids: list[int] = []
        confidence = 1.0
        while len(ids) < k:
            best, best_token, total = -1, 0, 0
            for token, child in self.next[state].items():
                total += count[child]
                if token >= 0 and (best < 0 or (count[child], recent[child]) > (count[best], recent[best])):
                    best, best_token = child, token  # separators (< 0, a sequence's end) count but are never drafted
            if best < 0 or confidence * count[best] / total < min_confidence:
                break
            confidence *= count[best] / total
            ids.append(best_token)
            state = best
        return ids, confidence


class SuffixDrafter(Drafter):
    """Draft from the longest earlier match of the conversation's last tokens, in the conversation itself or in
    the corpus (the longer wins; ties: the conversation), at least `min_match` tokens long: the most frequent
    continuation, at most round(alpha * match length) tokens and max(K, max_spec), while its confidence is >=
    min_confidence."""

    name = "suffix"

    @classmethod
    def build(cls, target, draft=None, *, references: list[list[int]] | None = None, min_match: int = MIN_MATCH,
              alpha: float = ALPHA, min_confidence: float = MIN_CONFIDENCE, max_corpus: int = MAX_CORPUS,
              max_spec: int = MAX_SPEC, **options) -> "SuffixDrafter":
        return cls(references, min_match=min_match, alpha=alpha, min_confidence=min_confidence, max_corpus=max_corpus,
                   max_spec=max_spec)

    def __init__(self, references: list[list[int]] | None = None, *, min_match: int = MIN_MATCH, alpha: float = ALPHA,
                 min_confidence: float = MIN_CONFIDENCE, max_corpus: int = MAX_CORPUS, max_spec: int = MAX_SPEC) -> None:
        if min_match < 1 or alpha <= 0 or max_corpus < 1 or max_spec < 0:
            raise ValueError(f"need min_match >= 1, alpha > 0, max_corpus >= 1, max_spec >= 0; "
                             f"got {min_match}, {alpha}, {max_corpus}, {max_spec}")
        self.min_match, self.alpha, self.min_confidence, self.max_corpus = min_match, alpha, min_confidence, max_corpus
        self.max_spec = max_spec
        self.references: deque[list[int]] = deque()  # the corpus's sequences, oldest first
        self.corpus_tokens = 0
        self._rebuild_corpus()
        for ids in references or []:
            self.add_reference(ids)
        self.appended = 0  # tokens ever appended to a context automaton (a rebuild appends them all again)
        self.reset()

    def reset(self) -> None:
        """Forget the conversation; the corpus stays (it is input, like a model's weights)."""
        self.tokens: list[int] = []  # the conversation indexed so far
        self.context = SuffixAutomaton()
        self.in_corpus = (0, 0)  # (state, length) of the longest suffix of self.tokens found in the corpus
        self.confidence = 0.0  # of the latest proposal: the product of its tokens' frequencies (0: none)

    # ---------------------------------------------------------------- the corpus

    def add_reference(self, ids: list[int]) -> None:
        """Index one more sequence (a saved conversation, an earlier reply); no match crosses its ends."""
        ids = list(ids)[-self.max_corpus :]
        self.references.append(ids)
        self.corpus_tokens += len(ids)
        if self.corpus_tokens > self.max_corpus:  # drop the oldest down to half the cap and rebuild
            while len(self.references) > 1 and self.corpus_tokens > self.max_corpus // 2:
                self.corpus_tokens -= len(self.references.popleft())
            self._rebuild_corpus()
        else:
            self._index_reference(ids)
        self.in_corpus = None  # states may have split: match the conversation again

    def _rebuild_corpus(self) -> None:
        self.corpus = SuffixAutomaton()
        for ids in self.references:
            self._index_reference(ids)

    def _index_reference(self, ids: list[int]) -> None:
        self.corpus.extend(ids)
        self.corpus.append(-1 - self.corpus.size)  # a separator no other position holds

    # ---------------------------------------------------------------- matching

    def _sync(self, tokens: list[int]) -> None:
        """Extend the context automaton and the corpus match to `tokens`; start over if the conversation was
        rewound or replaced."""
        if len(tokens) < len(self.tokens) or tokens[: len(self.tokens)] != self.tokens:
            self.reset()
        new = tokens[len(self.tokens) :]
        self.context.extend(new)
        self.appended += len(new)
        self.tokens.extend(new)
        if self.in_corpus is None:  # the corpus changed
            self.in_corpus, new = (0, 0), self.tokens
        state, length = self.in_corpus
        for token in new:
            state, length = self.corpus.step(state, length, token)
        self.in_corpus = (state, length)

    def match(self, tokens: list[int]) -> tuple[SuffixAutomaton, int, int] | None:
        """The automaton, state and length of the longest suffix of `tokens` seen before (in the conversation or
        the corpus, at least min_match tokens), or None."""
        self._sync(tokens)
        context = self.context
        earlier = context.link[context.last]  # the longest suffix that also ends before the end
        best = (context, earlier, context.length[earlier]) if earlier > 0 else None
        state, length = self.in_corpus
        if length > (best[2] if best else 0):
            best = (self.corpus, state, length)
        return best if best is not None and best[2] >= self.min_match else None

    def match_length(self, tokens: list[int]) -> int:
        """How many tokens the match that drafts after `tokens` spans (0: none): a long match is a copy in progress."""
        match = self.match(tokens)
        return match[2] if match else 0

    def drafts(self, tokens: list[int], k: int) -> tuple[list[int], float]:
        """What it drafts after `tokens` (up to k ids) and their confidence; ([], 0.0) without a match. Mode auto
        also calls it in rounds another mode runs, to score the drafts against what followed."""
        match = self.match(tokens)
        if match is None:
            return [], 0.0
        automaton, at, length = match
        ids, confidence = automaton.continuation(at, min(k, max(1, round(self.alpha * length))), self.min_confidence)
        return ids, confidence if ids else 0.0

    def draft_len(self, k: int) -> int:
        """Its drafts cost nothing and a long match is a copy in progress: up to max_spec even where K is less
        (SuffixDecoding's max_spec_tokens; the match length and the confidence bound each round's)."""
        return max(k, self.max_spec)

    def propose(self, state, k, params, generator) -> Proposal:
        ids, self.confidence = self.drafts(state.tokens, k)
        if not ids:
            return Proposal.empty(state.device)
        return Proposal(torch.tensor(ids, dtype=torch.long, device=state.device), None, calls=0)
