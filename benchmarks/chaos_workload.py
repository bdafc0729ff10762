"""The chaos soak's seeded schedule: conversations sharing prefixes, in waves, and the faults between them.

A conversation opens with one of a few system prompts (or forks another
conversation after one of its turns) and takes turns: each turn's prompt is the
conversation so far (questions, and the *reference's* answers) plus a new
question. The answers are the stock reference's greedy outputs, so every prompt
is the same in every run whatever a run under test answers; a wrong answer is
counted, never carried on. A wave is a few requests of distinct conversations
sent at once; faults come between waves (``flush``, disk and G4 damage,
restarts, weight updates) or inside one (aborted streams). Everything here is a
function of ``--seed`` and ``--requests``.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional

from sglang_kvbm.ops.demo.model import prompt_ids

ANSWER = 8  # greedy tokens per request (ignore_eos): prompt lengths are known before any answer
MAX_PROMPT = 1400  # under the model's 2048 positions and the default 1536-token device pool, with the answer

# Faults per 1000 requests (each kind happens at least once in any run); "where": between waves, or inside one.
FAULT_RATES = {
    "abort_prefill": 30, "abort_decode": 30,
    "flush": 10,
    "disk_data_flip": 14, "disk_header_flip": 10, "disk_truncate": 3, "disk_delete_segment": 3,
    "kill9_restart": 2, "kill9_index_flip": 2, "kill9_journal_flip": 2,
    "weight_update": 3,
}
MOONCAKE_RATES = {"g4_object_damage": 12, "master_restart": 2}
INSIDE_WAVE = {"abort_prefill", "abort_decode"}


@dataclasses.dataclass
class Conversation:
    system: int  # index of its system prompt, when it does not fork
    turns: int  # how many it takes
    questions: list  # token ids of each turn's question
    fork: Optional[tuple] = None  # (conversation, turn): it continues that turn's prompt + answer


@dataclasses.dataclass(frozen=True)
class Request:
    index: int
    conv: int
    turn: int
    repeat: bool  # the exact prompt of an earlier request again
    second: bool  # sent to the second worker (--mooncake)


@dataclasses.dataclass
class Schedule:
    systems: list
    conversations: list
    waves: list  # lists of Request
    faults: dict  # wave index -> fault kinds to apply after that wave (inside-wave kinds: during it)
    answers: dict = dataclasses.field(default_factory=dict)  # (conv, turn) -> reference output ids

    @property
    def requests(self) -> int:
        return sum(len(w) for w in self.waves)

    def prompt(self, conv: int, turn: int) -> list:
        """The conversation up to ``turn``'s question (needs the reference's answers of its earlier turns)."""
        c = self.conversations[conv]
        if c.fork is not None:
            parent, at = c.fork
            tokens = self.prompt(parent, at) + self.answers[(parent, at)]
        else:
            tokens = list(self.systems[c.system])
        for t in range(turn):
            tokens += c.questions[t] + self.answers[(conv, t)]
        return tokens + c.questions[turn]

    def length(self, conv: int, turn: int) -> int:
        c = self.conversations[conv]
        if c.fork is not None:
            n = self.length(*c.fork) + ANSWER
        else:
            n = len(self.systems[c.system])
        return n + sum(len(q) + ANSWER for q in c.questions[:turn]) + len(c.questions[turn])


def build(seed: int, requests: int, *, concurrency: int = 3, active: int = 16, systems: int = 12,
          mooncake: bool = False, second_share: float = 0.3) -> Schedule:
    rng = random.Random(seed)
    vocab = 4096
    sys_prompts = [prompt_ids(seed * 1000 + s, rng.randrange(160, 400), vocab) for s in range(systems)]
    sched = Schedule(sys_prompts, [], [], {})
    next_q = [seed * 1_000_000]

    def new_conv(done: list) -> int:
        fork = None
        if done and rng.random() < 0.3:  # a branch of a turn already answered
            parent, turn = rng.choice(done)
            fork = (parent, turn)
        questions = []
        for _ in range(rng.randrange(3, 9)):
            next_q[0] += 1
            questions.append(prompt_ids(next_q[0], rng.randrange(16, 96), vocab))
        sched.conversations.append(Conversation(rng.randrange(systems), len(questions), questions, fork))
        conv = len(sched.conversations) - 1
        # it ends before a prompt would pass MAX_PROMPT
        c = sched.conversations[conv]
        while c.turns > 1 and sched.length(conv, c.turns - 1) + ANSWER > MAX_PROMPT:
            c.turns -= 1
        if sched.length(conv, 0) + ANSWER > MAX_PROMPT:  # a fork of a long one: start fresh instead
            c.fork = None
        return conv

    done: list = []  # (conv, turn) answered in an earlier wave
    live = [new_conv(done) for _ in range(active)]
    progress = {c: 0 for c in live}
    index = 0
    while index < requests:
        wave, answered = [], []
        for conv in rng.sample(live, min(len(live), rng.randrange(1, concurrency + 1))):
            if index >= requests:
                break
            turn, repeat = progress[conv], False
            if turn and rng.random() < 0.1:  # the same prompt as an earlier turn, exactly
                turn, repeat = rng.randrange(turn), True
            second = mooncake and rng.random() < second_share
            wave.append(Request(index, conv, turn, repeat, second))
            index += 1
            if not repeat:
                answered.append((conv, turn))
                progress[conv] += 1
        sched.waves.append(wave)
        done += answered
        for conv in list(live):
            if progress[conv] >= sched.conversations[conv].turns:
                live.remove(conv)
                new = new_conv(done)
                live.append(new)
                progress[new] = 0

    rates = {**FAULT_RATES, **(MOONCAKE_RATES if mooncake else {})}
    waves = len(sched.waves)
    for kind, per_1000 in rates.items():
        for _ in range(max(1, round(per_1000 * requests / 1000))):
            # not in the first tenth (the tiers fill first), nor after the last wave: requests follow each fault
            sched.faults.setdefault(rng.randrange(waves // 10, max(waves // 10 + 1, waves - 1)), []).append(kind)
    for kinds in sched.faults.values():
        rng.shuffle(kinds)
    return sched
