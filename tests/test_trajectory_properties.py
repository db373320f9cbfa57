"""Property tests: whatever the history does, a trained token is a sampled token with its logprob."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from rollbus.trajectory import Turn, merge_turns_all, segment_chain

# Context tokens come from a small vocabulary (so common prefixes happen by chance); sampled tokens
# are unique ids >= SAMPLED, so a trained token names the turn and position it was sampled at.
SAMPLED = 1000
context = st.lists(st.integers(1, 6), max_size=4)


@dataclass
class Client:
    """A client that re-renders its history every turn, sometimes inexactly."""

    base: list[int]
    history: list[list[int]] = field(default_factory=list)  # rendered chunks
    next_id: int = SAMPLED
    turns: list[Turn] = field(default_factory=list)
    origin: dict[int, tuple[int, int]] = field(default_factory=dict)  # sampled id -> (turn, position)

    def sample(self, draw, prompt: list[int]) -> list[int]:
        output = list(range(self.next_id, self.next_id + draw(st.integers(0, 4))))
        self.next_id += len(output)
        logprobs = [-(t / 10_000) for t in output]
        if output and draw(st.integers(0, 9)) == 0:
            logprobs = logprobs[:-1]  # the engine lost a logprob
        for position, t in enumerate(output):
            self.origin[t] = (len(self.turns), position)
        self.turns.append(Turn(prompt, output, logprobs, "stop", len(self.turns)))
        return output


def rerender(draw, chunk: list[int]) -> list[int]:
    """Render a past chunk again: usually exact, sometimes drifted or with a token count change."""
    kind = draw(st.sampled_from(["exact"] * 4 + ["replace", "cut", "grow"]))
    if kind == "exact" or not chunk:
        return chunk
    at = draw(st.integers(0, len(chunk) - 1))
    if kind == "replace":
        return chunk[:at] + [draw(st.integers(1, 6))] + chunk[at + 1 :]
    if kind == "cut":
        return chunk[:at]
    return chunk[:at] + draw(context) + chunk[at:]


@st.composite
def rerendered_histories(draw, drift: bool = True) -> Client:
    client = Client(base=draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    for _ in range(draw(st.integers(1, 8))):
        if drift and draw(st.integers(0, 7)) == 0:  # compaction: history starts over
            client.base = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
            client.history = []
        if drift:
            client.history = [rerender(draw, c) for c in client.history if draw(st.integers(0, 9))]
        client.history.append(draw(context))
        prompt = client.base + [t for chunk in client.history for t in chunk]
        client.history.append(client.sample(draw, prompt))
    return client


def check_trained_tokens_are_sampled(client: Client, sequences) -> set[int]:
    trained: set[int] = set()
    for seq in sequences:
        n = len(seq.response_ids)
        assert len(seq.loss_mask) == len(seq.rollout_logprobs) == len(seq.policy_versions) == n
        for i, (t, mask) in enumerate(zip(seq.response_ids, seq.loss_mask, strict=True)):
            if not mask:
                assert seq.rollout_logprobs[i] == 0.0
                continue
            assert t not in trained, "a sampled token is trained twice"
            trained.add(t)
            turn_index, position = client.origin[t]
            source = client.turns[turn_index]
            assert source.output_ids[position] == t
            assert seq.policy_versions[i] == source.policy_version
            # an output whose logprobs were lost is never trained (mask 0), so this one has them all
            assert len(source.output_logprobs) == len(source.output_ids)
            assert seq.rollout_logprobs[i] == source.output_logprobs[position]
            # a trained output is trained whole and in order: its tokens sit at their positions
            assert seq.response_ids[i - position : i - position + len(source.output_ids)] == source.output_ids
    return trained


@settings(max_examples=300, deadline=None)
@given(rerendered_histories())
def test_merge_trains_only_sampled_tokens_once(client: Client):
    sequences = merge_turns_all(client.turns)
    check_trained_tokens_are_sampled(client, sequences)
    # each sequence is exactly what the model saw on its last turn, plus what it sampled
    for seq in sequences:
        full = seq.prompt_ids + seq.response_ids
        assert any(full == t.prompt_ids + t.output_ids for t in client.turns)


@settings(max_examples=200, deadline=None)
@given(rerendered_histories(drift=False))
def test_untouched_history_keeps_every_sampled_token(client: Client):
    sequences = merge_turns_all(client.turns)
    trained = check_trained_tokens_are_sampled(client, sequences)
    misaligned = [t for t in client.turns if len(t.output_logprobs) != len(t.output_ids)]
    lost = {t_id for turn in misaligned for t_id in turn.output_ids}
    assert trained == set(client.origin) - lost  # every sampled token with its logprob, and only those
    if trained:
        assert sum(seq.misaligned_tokens for seq in sequences) == len(lost)
    canonical = segment_chain(client.turns)
    assert sequences == ([canonical] if trained else [])
