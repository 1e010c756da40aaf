"""Quality tasks for partial caches, generated locally with fixed seeds.

Two families, both split at the handoff point: the ``context`` is what the upstream agent
prefills and ships as a KV cache; the ``question`` (and ``answer_prefix``) is what the
downstream agent appends. ``TaskSample.prompt(tokenizer)`` gives both halves as token ids.

Needle in a haystack, built the way RULER builds its ``niah_*`` tasks: needles are
sentences "One of the special magic {numbers} for {key} is: {value}." with adjective-noun
keys and 7-digit numbers (or UUIDs) as values, inserted at random sentence slots of a
haystack, joined by newlines. Haystacks: ``"noise"`` repeats RULER's "The grass is green..."
passage (niah_single_1 style); ``"needle"`` is made of distractor needles with other keys
(niah_multikey_2 style). ``num_keys > 1`` plants needles for several keys and asks about one
(multi-key); ``num_values > 1`` plants several values for the asked key (multi-value).
RULER's essay haystack needs Paul Graham's essays, which cannot be downloaded here, so
it is not offered. The instruction wording follows RULER's template, singularized when one
value is asked for, and the answer prefix is RULER's.

Facts QA from the ``worlddatax`` package: a list of facts about countries (capitals and
currencies, with distractor countries), one question about one country, the gold answer.
A small model knows many capitals, so it answers some of these with no context at all.

Fiction QA: the same shape about an invented world (towns, planets, companies and people
with made-up names, four facts each, one sentence a line); nothing in it can be known
without the context, so a question alone scores next to nothing.

Every generator is sized by ``target_tokens``: the largest haystack whose chat-templated
context (``TaskSample.prompt(...)[0]``) has at most that many tokens. The same seed and
target give the same sample; the gold answers are always present in the context.
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
# RULER's key words are wonderwords adjective-noun pairs; a fixed local vocabulary here.
_ADJECTIVES = (
    "ancient bitter brave bright calm clever cold crooked curious damp eager early fancy "
    "fierce fragile gentle gloomy golden grumpy hollow humble icy jolly lazy lively lucky "
    "mellow misty modest muddy narrow noisy odd pale polite proud quiet rapid rough rusty "
    "sandy shaggy shiny silent silly sleepy slim smooth snowy sour spicy steady sticky "
    "stormy sturdy sweet tame tidy tiny vivid wary wild windy witty woolly young zesty"
).split()
_NOUNS = (
    "anchor apple badger barrel beacon beetle blanket bridge candle canyon castle cedar "
    "cherry cloud comet copper cottage crater dolphin dragon falcon feather fjord forest "
    "fountain garden glacier harbor hedgehog helmet island jacket kettle lantern lemon "
    "lizard meadow mirror monkey needle orchard otter oyster paddle parrot pebble pepper "
    "pigeon pillow planet puzzle rabbit ribbon saddle salmon shovel spider squirrel statue "
    "teapot thistle tiger tunnel turnip violin walnut whistle willow wizard"
).split()
KEY_WORDS = tuple(sorted(f"{a}-{n}" for a in _ADJECTIVES for n in _NOUNS))
TASK_NAMES = ("niah_single", "niah_multikey", "niah_multivalue", "facts_qa", "fiction_qa")
# suite()'s default cycle: the tasks the packaged sensitivity profile and utility table
# were measured on, so that the commands they record still reproduce them
SUITE_TASKS = TASK_NAMES[:4]


@dataclass(frozen=True)
class TaskSample:
    """One generated example.

    answers: the gold answers; ``kvtransport.model.metrics`` scores a prediction against them
        (any one for EM/contains/F1, all of them for ``contains_all``).
    """

    task: str
    seed: int
    context: str
    question: str
    answers: tuple[str, ...]
    answer_prefix: str = ""

    def prompt(self, tokenizer: Any) -> tuple[list[int], list[int]]:
        """(context_ids, question_ids), split at the handoff (see model.chat_prompt)."""
        from kvtransport.model.loader import chat_prompt

        return chat_prompt(tokenizer, self.context, self.question, answer_prefix=self.answer_prefix)


def _context_tokens(tokenizer: Any, context: str) -> int:
    from kvtransport.model.loader import chat_prompt

    return len(chat_prompt(tokenizer, context)[0])


def _fit(
    build: Callable[[int], TaskSample], tokenizer: Any, target: int, lo: int, hi: int
) -> TaskSample:
    """The sample with the largest size n in [lo, hi] whose context fits ``target`` tokens.

    Context length grows with n, so a binary search finds it (RULER grows the haystack in
    fixed increments instead; same result, fewer tokenizer calls).
    """
    best = build(lo)
    if _context_tokens(tokenizer, best.context) > target:
        raise ValueError(f"target_tokens={target} is too small for even the smallest sample")
    most = hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        cand = build(mid)
        if _context_tokens(tokenizer, cand.context) <= target:
            lo, best = mid, cand
        else:
            hi = mid - 1
    if lo == most and (got := _context_tokens(tokenizer, best.context)) < FILL_SHARE * target:
        raise ValueError(f"{best.task} has material for {got} context tokens, not "
                         f"target_tokens={target}: ask for fewer or another task")  # fmt: skip
    return best


FILL_SHARE = 0.9
"""The share of ``target_tokens`` a sample must fill: a task whose material runs out
before that refuses the target rather than return a shorter context (facts_qa states
each country's facts once, a few thousand tokens in all)."""


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "words":
        return rng.choice(KEY_WORDS)
    raise ValueError(f"unknown needle type {kind!r} (numbers, uuids, words)")


def _niah_question(type_v: str, query: str, single: bool) -> tuple[str, str]:
    """(question, answer prefix) asking for ``query``'s value(s), in RULER's wording."""
    if single:
        return (
            f"What is the special magic {type_v} for {query} mentioned in the provided text?",
            f"The special magic {type_v} for {query} mentioned in the provided text is",
        )
    return (
        f"What are all the special magic {type_v} for {query} mentioned in the provided text?",
        f"The special magic {type_v} for {query} mentioned in the provided text are",
    )


def niah(
    tokenizer: Any,
    *,
    target_tokens: int = 400,
    seed: int = 0,
    num_keys: int = 1,
    num_values: int = 1,
    haystack: str = "noise",
    key_type: str = "words",
    value_type: str = "numbers",
) -> TaskSample:
    """A RULER-style needle-in-a-haystack sample (one key asked, ``num_values`` answers)."""
    if haystack not in ("noise", "needle"):
        raise ValueError(f"haystack must be 'noise' or 'needle', got {haystack!r}")
    if num_keys < 1 or num_values < 1:
        raise ValueError("num_keys and num_values must be at least 1")
    name = (
        "niah_multivalue" if num_values > 1 else "niah_multikey" if num_keys > 1 else "niah_single"
    )
    name = "niah_multikey" if haystack == "needle" else name
    rng = random.Random(f"{name}/{haystack}/{key_type}/{value_type}/{seed}")
    keys: list[str] = []
    while len(keys) < num_keys:
        k = _random_value(rng, key_type)
        if k not in keys:
            keys.append(k)
    values = [[_random_value(rng, value_type) for _ in range(num_values)] for _ in keys]
    needles = [
        NEEDLE.format(type_v=value_type, key=k, value=v)
        for k, vs in zip(keys, values, strict=True)
        for v in vs
    ]
    rng.shuffle(needles)
    asked = rng.randrange(num_keys)
    query, answers = keys[asked], tuple(values[asked])
    hay_seed = rng.getrandbits(64)

    single = num_values == 1
    type_v = value_type[:-1] if single else value_type  # RULER singularizes for one value
    intro = (
        f"A special magic {type_v} is hidden within the following text. Make sure to "
        f"memorize it. I will quiz you about the {type_v} afterwards."
        if single
        else f"Some special magic {type_v} are hidden within the following text. Make sure "
        f"to memorize it. I will quiz you about the {type_v} afterwards."
    )
    question, prefix = _niah_question(type_v, query, single)

    def build(n: int) -> TaskSample:
        hrng = random.Random(hay_seed)  # the same haystack prefix for every size n
        if haystack == "noise":
            sentences = [NOISE] * n
        else:
            sentences = []
            while len(sentences) < n:
                k = _random_value(hrng, key_type)
                if k in keys:
                    continue
                v = _random_value(hrng, value_type)
                sentences.append(NEEDLE.format(type_v=value_type, key=k, value=v))
        slots = sorted(hrng.sample(range(n + len(needles)), len(needles)))
        body = list(sentences)
        for slot, needle in zip(slots, needles, strict=True):
            body.insert(slot, needle)
        context = intro + "\n" + "\n".join(body)
        return TaskSample(name, seed, context, question, answers, prefix)

    return _fit(build, tokenizer, target_tokens, 0, max(1, target_tokens))


# ----------------------------------------------------------------------------- facts QA


def _countries() -> list[dict]:
    import worlddatax

    return sorted(
        (c for c in worlddatax.get_all_countries() if c.get("capital") and c.get("currency_name")),
        key=lambda c: str(c["name"]),
    )


def _facts(country: dict) -> dict[str, str]:
    name = country["name"]
    return {
        "capital": f"The capital of {name} is {country['capital']}.",
        "currency": f"The currency of {name} is the {country['currency_name']} "
        f"({country['currency_code']}).",
    }


def _facts_question(country: dict, attr: str) -> tuple[str, str, tuple[str, ...]]:
    """(question, answer prefix, gold answers) about one attribute of ``country``."""
    name = country["name"]
    if attr == "capital":
        return f"What is the capital of {name}?", f"The capital of {name} is", (country["capital"],)
    return (
        f"What is the currency of {name}?",
        f"The currency of {name} is the",
        (country["currency_name"],),
    )


def facts_qa(
    tokenizer: Any, *, target_tokens: int = 400, seed: int = 0, attribute: str | None = None
) -> TaskSample:
    """A question about one country's capital or currency, among distractor facts.

    attribute: "capital", "currency" or None (picked by the seed). Distractors are the
    facts of other countries (and the asked country's other attribute), shuffled; the
    answer fact sits at a random depth.
    """
    if attribute not in (None, "capital", "currency"):
        raise ValueError(f"attribute must be 'capital' or 'currency', got {attribute!r}")
    rng = random.Random(f"facts_qa/{seed}")
    countries = _countries()
    target = rng.choice(countries)
    attr = attribute or rng.choice(("capital", "currency"))
    others = [c for c in countries if c["name"] != target["name"]]
    rng.shuffle(others)
    distractors = [f for c in others for f in _facts(c).values()]
    answer_fact = _facts(target)[attr]
    other_fact = _facts(target)["currency" if attr == "capital" else "capital"]
    question, prefix, answers = _facts_question(target, attr)
    intro = "Read the following facts about countries and answer the question after them."
    depth = rng.random()
    other_depth = rng.random()

    def build(n: int) -> TaskSample:
        body = distractors[:n]
        body.insert(round(other_depth * len(body)), other_fact)
        body.insert(round(depth * len(body)), answer_fact)
        context = intro + "\n" + "\n".join(body)
        return TaskSample("facts_qa", seed, context, question, answers, prefix)

    return _fit(build, tokenizer, target_tokens, 0, len(distractors))


# ----------------------------------------------------------------------------- fiction QA

# Invented names: a noun of _NOUNS and a place-name ending ("Cedarholm", "Otterford"), and
# people a given name and such a surname. A model cannot know any fact about them, so with
# no context its answers are guesses. (Names of random syllables were tried first: the
# 135M model confuses them with one another far more often than these.)
_ENDINGS = "ford mere holm wick stead vale by thorpe haven moor dale brook ton field gate".split()
# prefix words of the names drawn once the noun-ending pairs run out (long contexts)
_PREFIXES = "North South East West Old New Little Great Upper Lower High Far".split()
_GIVEN = (
    "Alric Bertil Corwin Dagny Elowen Fenna Gideon Hesper Isolde Jory Kestrel Linnea Merrick "
    "Nell Oriel Perrin Quill Rowan Sable Tamsin Ulric Vesna Wren Yara Zebedee Brannoc Cato "
    "Delphine Emrys Thaddeus"
).split()
_GOODS = (
    "saffron, amber, cork, indigo, pewter, walnut oil, sealskin, juniper, flint, "
    "quills, tallow, lacquer, goat cheese, slate, linen, cinnabar, myrrh, felt hats, "
    "brass bells, dried figs, whetstones, beeswax, oyster pearls, cedar planks"
).split(", ")
_COLOURS = (
    "violet, amber, teal, crimson, ochre, silver, jade, indigo, scarlet, turquoise, "
    "magenta, bronze, lilac, copper, mauve, emerald, saffron, maroon"
).split(", ")
_TRADES = (
    "glassblower, beekeeper, cartographer, lighthouse keeper, clockmaker, tanner, "
    "falconer, bookbinder, potter, ropemaker, harpist, stonemason, weaver, cooper"
).split(", ")
# kind -> (attribute, fact sentence, question, value kind); every sentence ends with
# "{v}.", so the answer prefix is the sentence up to the value, with the entity in it.
_INSTRUMENTS = "lute harp flute oboe fiddle bagpipes cello zither accordion banjo".split()
# kind -> (attribute, fact sentence, question, value kind); every sentence ends with
# "{v}.", so the answer prefix is the sentence up to the value, with the entity in it. An
# entity states four of its kind's eight: the fewer facts share a sentence pattern, the
# less the small model confuses one entity's fact with another's.
_FICTION: dict[str, tuple[tuple[str, str, str, str], ...]] = {
    "town": (
        ("founder", "The town of {e} was founded by {v}.", "Who founded the town of {e}?",
         "person"),
        ("river", "The river that flows through {e} is the {v}.",
         "Which river flows through the town of {e}?", "word"),
        ("export", "The main export of the town of {e} is {v}.",
         "What is the main export of the town of {e}?", "goods"),
        ("year", "The town of {e} was built in the year {v}.",
         "In which year was the town of {e} built?", "year"),
        ("emblem", "The emblem of the town of {e} is a {v}.",
         "What is the emblem of the town of {e}?", "noun"),
        ("mayor", "The mayor of the town of {e} is {v}.", "Who is the mayor of the town of {e}?",
         "person"),
        ("valley", "The town of {e} lies in the valley of {v}.",
         "In which valley does the town of {e} lie?", "word"),
        ("roofs", "The roofs of the town of {e} are painted {v}.",
         "What colour are the roofs of the town of {e} painted?", "colour"),
    ),
    "planet": (
        ("moon", "The largest moon of the planet {e} is called {v}.",
         "What is the largest moon of the planet {e} called?", "word"),
        ("discoverer", "The planet {e} was discovered by {v}.",
         "Who discovered the planet {e}?", "person"),
        ("colour", "The sky of the planet {e} is {v}.",
         "What colour is the sky of the planet {e}?", "colour"),
        ("capital", "The capital city of the planet {e} is {v}.",
         "What is the capital city of the planet {e}?", "word"),
        ("creature", "The planet {e} is home to a creature called the {v}.",
         "What creature is the planet {e} home to?", "word"),
        ("star", "The planet {e} orbits the star {v}.", "Which star does the planet {e} orbit?",
         "word"),
        ("year", "The planet {e} was first mapped in the year {v}.",
         "In which year was the planet {e} first mapped?", "year"),
        ("crop", "The farmers of the planet {e} grow {v}.",
         "What do the farmers of the planet {e} grow?", "goods"),
    ),
    "company": (
        ("founder", "The company {e} was founded by {v}.", "Who founded the company {e}?",
         "person"),
        ("city", "The headquarters of the company {e} are in {v}.",
         "Where are the headquarters of the company {e}?", "word"),
        ("product", "The company {e} sells {v}.", "What does the company {e} sell?", "goods"),
        ("year", "The company {e} was founded in the year {v}.",
         "In which year was the company {e} founded?", "year"),
        ("logo", "The logo of the company {e} shows a {v}.",
         "What does the logo of the company {e} show?", "noun"),
        ("engineer", "The chief engineer of the company {e} is {v}.",
         "Who is the chief engineer of the company {e}?", "person"),
        ("partner", "The company {e} trades with the town of {v}.",
         "Which town does the company {e} trade with?", "word"),
        ("vans", "The delivery vans of the company {e} are {v}.",
         "What colour are the delivery vans of the company {e}?", "colour"),
    ),
    "person": (
        ("birthplace", "{e} was born in the village of {v}.",
         "In which village was {e} born?", "word"),
        ("trade", "{e} works as a {v}.", "What does {e} work as?", "trade"),
        ("pet", "The pet dog of {e} is named {v}.", "What is the name of the pet dog of {e}?",
         "word"),
        ("colour", "The favourite colour of {e} is {v}.", "What is the favourite colour of {e}?",
         "colour"),
        ("instrument", "{e} plays the {v}.", "Which instrument does {e} play?", "instrument"),
        ("friend", "The best friend of {e} is {v}.", "Who is the best friend of {e}?", "person"),
        ("home", "{e} lives on the planet {v}.", "On which planet does {e} live?", "word"),
        ("born", "{e} was born in the year {v}.", "In which year was {e} born?", "year"),
    ),
}  # fmt: skip
_FICTION_INTRO = (
    "Read the following facts about an invented world (its towns, planets, companies and "
    "people) and answer the question after them."
)
# without it the model goes on reciting facts after the answer
_FICTION_ASK = " Answer in a few words."
_FICTION_SENTENCES = [
    (re.compile(re.escape(s).replace(r"\{e\}", "(.+?)").replace(r"\{v\}", "(.+)")), kind, attr)
    for kind, attrs in _FICTION.items()
    for attr, s, _q, _v in attrs
]


@dataclass(frozen=True)
class _Fact:
    kind: str
    entity: str
    attr: str
    value: str

    def _spec(self) -> tuple[str, str, str, str]:
        return next(a for a in _FICTION[self.kind] if a[0] == self.attr)

    @property
    def sentence(self) -> str:
        return self._spec()[1].format(e=self.entity, v=self.value)

    def question(self, sample: TaskSample) -> TaskSample:
        """``sample`` asking for this fact (answer prefix: the sentence up to the value)."""
        _attr, sentence, question, _kind = self._spec()
        prefix = sentence.split("{v}")[0].rstrip().format(e=self.entity)
        return replace(sample, question=question.format(e=self.entity) + _FICTION_ASK,
                       answers=(self.value,), answer_prefix=prefix)  # fmt: skip


class _Names:
    """Invented names, never the same one twice (so each fact is stated once). Their nouns
    and given names are dealt from shuffled decks, so that names share no word until a
    deck runs out (a large context): the model tells such names apart best."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()
        self.decks: dict[tuple[str, ...], list[str]] = {}
        self.plain_left = True  # noun-ending names not all taken yet

    def _deal(self, words: tuple[str, ...] | list[str]) -> str:
        key = tuple(words)
        deck = self.decks.setdefault(key, [])
        if not deck:
            deck.extend(self.rng.sample(key, len(key)))
        return deck.pop()

    def _unique(self, make: Callable[[], str]) -> str:
        for _ in range(10_000):
            name = make()
            if name not in self.used:
                self.used.add(name)
                return name
        raise ValueError("fiction_qa ran out of invented names; ask for fewer tokens")

    def word(self) -> str:
        """A place name ("Cedarholm"); once every noun-ending pair is taken (a context
        of several thousand tokens), one with a prefix word ("North Cedarholm")."""

        def plain() -> str:
            return self._deal(_NOUNS).capitalize() + self.rng.choice(_ENDINGS)

        if self.plain_left:
            try:
                return self._unique(plain)
            except ValueError:
                self.plain_left = False  # (as good as) all taken
        return self._unique(lambda: f"{self.rng.choice(_PREFIXES)} {plain()}")

    def person(self) -> str:
        return self._unique(lambda: f"{self._deal(_GIVEN)} {self.word()}")


def _fiction_entity(rng: random.Random, names: _Names, kind: str) -> list[_Fact]:
    entity = names.person() if kind == "person" else names.word()
    facts = []
    for attr, _s, _q, vkind in sorted(rng.sample(_FICTION[kind], 4)):
        if vkind in ("person", "word"):
            value = getattr(names, vkind)()
        elif vkind == "year":
            value = str(rng.randint(1100, 1999))
        else:
            lists = {"goods": _GOODS, "colour": _COLOURS, "trade": _TRADES, "noun": _NOUNS,
                     "instrument": _INSTRUMENTS}  # fmt: skip
            value = rng.choice(lists[vkind])
        facts.append(_Fact(kind, entity, attr, value))
    return facts


def fiction_qa(tokenizer: Any, *, target_tokens: int = 400, seed: int = 0) -> TaskSample:
    """A question about one attribute of one invented entity, among facts about others.

    The world is made up from the seed: towns, planets, companies and people with invented
    names (seeded syllables), four attributes each (a founder, a river, a year, a colour,
    ...), each stated once in its own sentence (one a line). Unlike facts_qa, a model cannot
    know any of it, so with no context its answer is a guess. The asked entity's facts sit
    at random depths; the other entities' facts, shuffled, pad the context to the target.
    """
    rng = random.Random(f"fiction_qa/{seed}")
    names = _Names(rng)
    kinds = sorted(_FICTION)
    asked = _fiction_entity(rng, names, rng.choice(kinds))
    pick = rng.randrange(len(asked))
    # a sentence takes more than 5 tokens: enough facts for any context that fits
    n_max = max(8, target_tokens // 5)
    others = [f for _ in range(n_max // 4 + 1) for f in _fiction_entity(rng, names,
              rng.choice(kinds))]  # fmt: skip
    rng.shuffle(others)
    depths = [rng.random() for _ in asked]
    probe = TaskSample("fiction_qa", seed, "", "", ())
    sample = asked[pick].question(probe)

    def build(n: int) -> TaskSample:
        body = [f.sentence for f in others[:n]]
        for fact, depth in zip(asked, depths, strict=True):
            body.insert(round(depth * len(body)), fact.sentence)
        return replace(sample, context=_FICTION_INTRO + "\n" + "\n".join(body))

    return _fit(build, tokenizer, target_tokens, 0, len(others))


def _fiction_fact(line: str) -> _Fact | None:
    """The fact a context line states, if it is one of fiction_qa's sentences."""
    for pattern, kind, attr in _FICTION_SENTENCES:
        if m := pattern.fullmatch(line):
            return _Fact(kind, m.group(1), attr, m.group(2))
    return None


def generate(task: str, tokenizer: Any, *, target_tokens: int = 400, seed: int = 0) -> TaskSample:
    """A sample of a named task (one of TASK_NAMES)."""
    if task == "niah_single":
        return niah(tokenizer, target_tokens=target_tokens, seed=seed)
    if task == "niah_multikey":
        return niah(tokenizer, target_tokens=target_tokens, seed=seed, haystack="needle")
    if task == "niah_multivalue":
        return niah(tokenizer, target_tokens=target_tokens, seed=seed, num_values=4)
    if task == "facts_qa":
        return facts_qa(tokenizer, target_tokens=target_tokens, seed=seed)
    if task == "fiction_qa":
        return fiction_qa(tokenizer, target_tokens=target_tokens, seed=seed)
    raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASK_NAMES)}")


_NEEDLE_LINE = re.compile(r"One of the special magic (\S+) for (\S+) is: (\S+)\.")


def question_set(sample: TaskSample, k: int) -> tuple[TaskSample, ...]:
    """``sample`` first, then up to ``k - 1`` other questions about the same context.

    Why: one question is a knife edge for judging a partial cache. A small model's answer to
    it can flip on a small difference in what arrived, so one answer says little about how
    much of the context survived; several questions about the same received cache do.

    Each extra question is a TaskSample with the sample's task, seed and context (so the
    same context token ids and the same cache) that asks for another fact the context
    states exactly once: another country's capital or currency (facts_qa) or another key's
    value (needle haystacks). They are drawn by the seed, one from each of ``k - 1`` equal
    stretches of those facts in context order, so they cover the context front to back.
    A context with no other such fact (niah_single's noise haystack, niah_multivalue's one
    key) gives the sample alone. ``sample`` itself is never changed.
    """
    if k < 1:
        raise ValueError("k must be at least 1")
    candidates = [
        q
        for q in _context_questions(sample)
        if (q.question, q.answers) != (sample.question, sample.answers)
    ]
    rng = random.Random(f"question_set/{sample.task}/{sample.seed}")
    m = k - 1
    if len(candidates) <= m:
        picked = candidates
    else:
        n = len(candidates)
        picked = [candidates[rng.randrange(j * n // m, (j + 1) * n // m)] for j in range(m)]
    return (sample, *picked)


def _context_questions(sample: TaskSample) -> list[TaskSample]:
    """One single-answer question per fact the context states once, in context order."""
    lines = sample.context.splitlines()
    out: list[TaskSample] = []
    if sample.task == "facts_qa":
        by_line: dict[str, tuple[dict, str]] = {}
        for c in _countries():
            for attr, line in _facts(c).items():
                by_line[line] = (c, attr)
        for line in lines:
            if line in by_line and lines.count(line) == 1:
                question, prefix, answers = _facts_question(*by_line[line])
                out.append(replace(sample, question=question, answers=answers,
                                   answer_prefix=prefix))  # fmt: skip
        return out
    if sample.task == "fiction_qa":
        facts = [f for line in lines if (f := _fiction_fact(line))]
        asked = [(f.entity, f.attr) for f in facts]
        return [f.question(sample) for f in facts if asked.count((f.entity, f.attr)) == 1]
    needles = [m.groups() for line in lines if (m := _NEEDLE_LINE.fullmatch(line))]
    keys = [key for _type, key, _value in needles]
    for type_v, key, value in needles:
        if keys.count(key) == 1:
            question, prefix = _niah_question(type_v[:-1], key, True)
            out.append(replace(sample, question=question, answers=(value,), answer_prefix=prefix))
    return out


def suite(
    tokenizer: Any,
    *,
    n: int,
    target_tokens: int = 400,
    seed: int = 0,
    tasks: tuple[str, ...] = SUITE_TASKS,
) -> list[TaskSample]:
    """``n`` samples cycling through ``tasks``, seeds ``seed, seed+1, ...``."""
    return [
        generate(tasks[i % len(tasks)], tokenizer, target_tokens=target_tokens, seed=seed + i)
        for i in range(n)
    ]
