"""A 2WikiMultihopQA-shaped RAG workload, generated locally and deterministically from a seed.

Most of its length (over 500 lines) is data: the vocabularies and sentence templates.

2WikiMultihopQA asks multi-hop questions (comparisons, "where was the director of film X born?") over ten
Wikipedia paragraphs, two of them gold and eight distractors. Here the paragraphs are composed from sentence
templates over name, place, date and film-title vocabularies (bios, films, towns), so they read like English and
tokenize like it, and a few passages are far more popular than the rest (Zipf), as in real retrieval traffic.
That popularity skew is what makes spans recur at different offsets behind different prefixes. Each question
carries its gold answer (`Gold`), derived from the facts the passages were written from.

Every passage honors the requested token range or the workload is refused (`ValueError`): after its dozen facts a
passage goes on with career, plot or history sentences for as long as its length needs (passages of thousands of
tokens are where span reuse pays most). Questions are never cut: `max_question_tokens` decides only whether a
question gets its answer instruction, and `summary()` records the lengths a workload really has.

Prompts use SGLang's chatml roles with each passage wrapped in `span()`: `rag_program` is the SGLang frontend
program (defined when `sglang` imports) and `rag_prompt` builds the identical text without SGLang, for the
offline engine.
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from itertools import chain

import numpy as np

from sglang_pic.frontend_lang.markers import Span, marked_prompt, span, strip_markers

SYSTEM_PROMPT = "Answer the question using the passages. Be brief."
SYSTEM_TURN = ("<|im_start|>system\n", "<|im_end|>\n")
USER_TURN = ("<|im_start|>user\n", "<|im_end|>\n")
ASSISTANT_START = "<|im_start|>assistant\n"

CountTokens = Callable[[str], int]

MALE_NAMES = (
    "Arthur", "Bernard", "Carl", "Daniel", "Edmund", "Felix", "George", "Henry", "Isaac", "Julian", "Karl",
    "Leonard", "Martin", "Nathan", "Oscar", "Patrick", "Rafael", "Samuel", "Thomas", "Victor", "Walter", "Anton",
    "Giovanni", "Hugo", "Ivan", "Lars", "Mikhail", "Pierre", "Tomas", "Yusuf",
)
FEMALE_NAMES = (
    "Alice", "Beatrice", "Clara", "Dorothy", "Elena", "Frances", "Greta", "Helen", "Irene", "Johanna", "Katherine",
    "Lucia", "Margaret", "Nora", "Olga", "Paula", "Rosa", "Sofia", "Teresa", "Ursula", "Vera", "Agnes", "Marta",
    "Ingrid", "Louise", "Miriam", "Renata", "Sylvia", "Yvonne", "Zofia",
)
SURNAMES = (
    "Abbott", "Bergman", "Castellano", "Dreyer", "Ellison", "Fairbanks", "Gallagher", "Hartmann", "Ivanov",
    "Jansen", "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov", "Quinlan", "Rossi", "Schneider",
    "Tanaka", "Underwood", "Valentini", "Whitfield", "Yamamoto", "Zeller", "Brennan", "Delacroix", "Esposito",
    "Holloway", "Kingsley", "Lorenz", "Marchetti", "Nakamura", "Ostrowski", "Pemberton", "Rasmussen", "Sandoval",
    "Thorne", "Vasquez", "Winslow",
)
COUNTRIES = (
    ("England", "British"), ("France", "French"), ("Germany", "German"), ("Italy", "Italian"),
    ("Sweden", "Swedish"), ("Poland", "Polish"), ("Russia", "Russian"), ("Japan", "Japanese"),
    ("Spain", "Spanish"), ("Denmark", "Danish"), ("the Netherlands", "Dutch"), ("Ireland", "Irish"),
    ("the United States", "American"), ("Canada", "Canadian"), ("Mexico", "Mexican"), ("Nigeria", "Nigerian"),
)
TOWN_HEADS = (
    "Ash", "Bel", "Cran", "Dun", "Elder", "Fair", "Glen", "Hart", "Iron", "Kings", "Lang", "Marl", "North", "Oak",
    "Pen", "Red", "Stan", "Thorn", "Wex", "Wynd",
)
TOWN_TAILS = ("ford", "moor", "wick", "bury", "field", "haven", "stead", "ton", "mouth", "dale", "holm", "brook")
RIVERS = ("Avon", "Loire", "Elbe", "Vistula", "Tiber", "Dnieper", "Shannon", "Ebro", "Rhine", "Oder")
INDUSTRIES = ("textiles", "shipbuilding", "wine making", "coal mining", "tourism", "fishing", "glassware", "printing")
PROFESSIONS = (
    "film director", "screenwriter", "actor", "novelist", "composer", "painter", "architect", "journalist",
    "photographer", "stage designer", "film producer", "poet",
)
UNIVERSITIES = (
    "the University of Vienna", "the Sorbonne", "the University of Bologna", "the Royal College of Art",
    "Uppsala University", "the Moscow Conservatory", "the University of Edinburgh", "Columbia University",
)
TITLE_ADJECTIVES = (
    "Silent", "Crimson", "Last", "Hidden", "Broken", "Golden", "Forgotten", "Distant", "Burning", "Quiet",
    "Northern", "Winter", "Restless", "Lonely", "Second",
)
TITLE_NOUNS = (
    "Harbor", "Garden", "Frontier", "Letter", "Orchard", "Kingdom", "Station", "Voyage", "Promise", "Lighthouse",
    "Carnival", "Bridge", "Summer", "Witness", "Shadow", "River", "Mirror", "Crossing",
)
GENRES = ("drama", "comedy", "thriller", "war film", "musical", "romantic drama", "crime film", "western")
STUDIOS = ("Pathé", "Universum Film", "Gaumont", "Ealing Studios", "Mosfilm", "Toho", "Nordisk Film", "Cines")
FESTIVALS = ("Venice Film Festival", "Cannes Film Festival", "Berlin International Film Festival", "Locarno Festival")
AWARDS = ("Golden Lion", "Palme d'Or", "Golden Bear", "Silver Bear", "Grand Prix", "Jury Prize")
WARS = ("Thirty Years' War", "Napoleonic Wars", "First World War", "Second World War")
STYLES = ("Gothic", "Renaissance", "Baroque", "neoclassical")
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
    "December",
)
# The continuation sentences' words: titles, roles and places that no question asks about (no film titles,
# countries, nationalities, rivers, births or deaths), so a long passage keeps its facts' answers the only ones.
WORK_FORMS = ("Sketches", "Scenes", "Letters", "Variations", "Studies", "Notes", "Songs", "Portraits", "Elegies")
SUBJECTS = (
    "rural life", "the sea", "childhood", "the city at night", "exile", "a family of fishermen", "old age",
    "a travelling circus", "the harvest", "a mining town", "two sisters", "the last days of an empire",
)
QUALITIES = ("lyrical", "austere", "playful", "sombre", "ambitious", "intimate", "restless", "severe", "tender")
ROLES = (
    "schoolteacher", "fisherman", "widow", "young doctor", "soldier", "clerk", "singer", "orphan",
    "lighthouse keeper", "watchmaker", "nurse", "ferryman",
)
LANDMARKS = (
    "harbour", "market square", "railway station", "old mill", "cathedral", "lighthouse", "bridge", "orchard",
    "cemetery", "boarding house",
)
EVENTS = ("flood", "fire", "storm", "gale", "hailstorm", "landslide")
INSTITUTIONS = ("school", "library", "choir", "hospital", "savings bank", "theatre", "football club", "newspaper")
TRADES = ("brewing", "weaving", "pottery", "clockmaking", "tanning", "rope making", "bookbinding", "salt trading")


@dataclass(frozen=True)
class WorkloadConfig:
    num_samples: int = 200
    num_passages: int = 10  # per sample, as in 2WikiMultihopQA (2 gold + 8 distractors)
    corpus_size: int = 1000
    zipf: float = 1.0  # popularity of the passage of rank r is proportional to 1 / r**zipf
    passage_tokens: tuple[int, int] = (100, 200)
    # Questions get an answer instruction only where it keeps them within this many tokens; a question is never cut,
    # so a tokenizer that spells one longer (the tests' tiny one: 39-56 tokens) exceeds it: summary() records the
    # longest. Refusing instead would refuse the documented tiny-model runs and change span quality's questions.
    max_question_tokens: int = 30
    system_prompt: str = SYSTEM_PROMPT
    seed: int = 0

    def __post_init__(self) -> None:
        """Refuse sizes no workload has, before any text is written."""
        lo, hi = self.passage_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"passage_tokens {lo},{hi}: need 1 <= min <= max")
        if not 1 <= self.num_passages <= self.corpus_size:
            raise ValueError(f"num_passages {self.num_passages}: need 1 <= num_passages <= corpus_size "
                             f"({self.corpus_size})")
        if self.max_question_tokens < 1:
            raise ValueError(f"max_question_tokens {self.max_question_tokens}: need >= 1")
        if self.num_samples < 0:
            raise ValueError(f"num_samples {self.num_samples}: need >= 0")


@dataclass(frozen=True)
class Passage:
    pid: int
    kind: str  # person | film | town
    title: str
    text: str  # the span text: title line, then the paragraph
    num_tokens: int
    link: int | None  # the passage this one refers to (a film's director, a person's birthplace): the second hop


@dataclass(frozen=True)
class Gold:
    """A question's answer as the generated facts give it: a right answer says every phrase of `phrases`, and where
    the question names `rivals` (a comparison's other side, "no" against "yes") it says a gold phrase first."""

    phrases: tuple[str, ...]
    rivals: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sample:
    sid: int
    passage_ids: tuple[int, ...]
    question: str
    gold: Gold
    question_tokens: int  # of `question_block(question)`; over max_question_tokens where the bare question is


@dataclass
class _Person:
    name: str
    male: bool
    nationality: str
    profession: str
    born: tuple[int, int, int]  # year, month, day
    died: tuple[int, int, int]
    town: int  # pid of the birthplace passage


@dataclass
class _Film:
    title: str
    year: int
    director: int  # pid of the director's passage
    genre: str
    nationality: str


@dataclass
class _Town:
    name: str
    country: str
    river: str


@dataclass
class RagWorkload:
    config: WorkloadConfig
    corpus: list[Passage]
    samples: list[Sample]

    def passages(self, sample: Sample) -> list[str]:
        return [self.corpus[pid].text for pid in sample.passage_ids]

    def prompt(self, sample: Sample) -> str:
        """The marker-aware prompt (each passage a span) up to the assistant turn."""
        return rag_prompt(self.config.system_prompt, self.passages(sample), sample.question)

    def plain_prompt(self, sample: Sample) -> str:
        """The same prompt as a PIC-unaware engine sees it."""
        return strip_markers(self.prompt(sample))

    def span_texts(self) -> list[str]:
        """Every distinct passage the samples use, in first-use order."""
        seen = dict.fromkeys(pid for s in self.samples for pid in s.passage_ids)
        return [self.corpus[pid].text for pid in seen]

    def summary(self) -> dict:
        """The sizes the workload really has (measured tokens next to the requested range), for a run's record."""
        uses = [pid for s in self.samples for pid in s.passage_ids]
        tokens = [p.num_tokens for p in self.corpus]
        per_sample = [sum(self.corpus[pid].num_tokens for pid in s.passage_ids) for s in self.samples] or [0]
        questions = [s.question_tokens for s in self.samples] or [0]
        return {
            "num_samples": len(self.samples),
            "passages_per_sample": self.config.num_passages,
            "corpus_size": len(self.corpus),
            "zipf": self.config.zipf,
            "distinct_passages_used": len(set(uses)),
            "passage_uses": len(uses),
            "repeat_fraction": 1 - len(set(uses)) / max(len(uses), 1),
            "passage_tokens_requested": list(self.config.passage_tokens),
            "passage_tokens_mean": float(np.mean(tokens)),
            "passage_tokens_min": int(min(tokens)),
            "passage_tokens_max": int(max(tokens)),
            "distinct_used_passage_tokens": int(sum(self.corpus[pid].num_tokens for pid in set(uses))),
            "sample_passage_tokens_mean": float(np.mean(per_sample)),
            "sample_passage_tokens_max": int(max(per_sample)),
            "question_tokens_max": int(max(questions)),
        }

    def describe(self) -> str:
        """One line of `summary` for a run's log: what lengths it actually used."""
        s = self.summary()
        lo, hi = s["passage_tokens_requested"]
        return (f"workload: {s['num_samples']} samples x {s['passages_per_sample']} passages; passage tokens "
                f"{s['passage_tokens_min']}..{s['passage_tokens_max']} (mean {s['passage_tokens_mean']:.0f}, "
                f"requested {lo},{hi}); passages per sample {s['sample_passage_tokens_mean']:.0f} tokens on average "
                f"(max {s['sample_passage_tokens_max']}); {s['distinct_passages_used']} distinct passages used, "
                f"{s['distinct_used_passage_tokens']} tokens; questions up to {s['question_tokens_max']} tokens")


def rag_prompt(system: str, passages: list[str], question: str) -> str:
    """chatml system + user turns, passages as spans, ending where the assistant's answer starts."""
    head = SYSTEM_TURN[0] + system + SYSTEM_TURN[1] + USER_TURN[0]
    tail = question_block(question) + USER_TURN[1] + ASSISTANT_START
    return marked_prompt(head, *(Span(p) for p in passages), tail)


def question_block(question: str) -> str:
    return f"Question: {question}"


try:
    import sglang as sgl
except ImportError:
    sgl = None

if sgl is not None:

    @sgl.function
    def rag_program(s, system: str, passages: list[str], question: str, max_tokens: int = 32):
        """The SGLang frontend form of `rag_prompt` (with a chatml backend) plus the answer."""
        s += sgl.system(system)
        s += sgl.user("".join(span(p) for p in passages) + question_block(question))
        s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens, temperature=0, ignore_eos=True))


def _article(word: str) -> str:
    """'a' or 'an' as the word is spoken ("an Irish", "an 1893", "a 1920")."""
    if word[0].isdigit():
        return "an" if word.startswith(("8", "11", "18")) else "a"
    return "an" if word[0].lower() in "aeiou" else "a"


def _date(d: tuple[int, int, int]) -> str:
    return f"{d[2]} {MONTHS[d[1] - 1]} {d[0]}"


def _with_article(word: str) -> str:
    return f"{_article(word)} {word}"


def _someone(rng: random.Random) -> str:
    """A name for a passing mention (spouse, cast, crew): not an entity with a passage of its own."""
    return f"{rng.choice(MALE_NAMES + FEMALE_NAMES)} {rng.choice(SURNAMES)}"


def _somewhere(rng: random.Random) -> str:
    return rng.choice(TOWN_HEADS) + rng.choice(TOWN_TAILS)


def _endless(rng: random.Random, templates: tuple[Callable[[], str], ...]) -> Iterator[str]:
    while True:
        yield rng.choice(templates)()


class _CorpusWriter:
    """Writes bios, film and town paragraphs; each passage grows sentence by sentence to its token target."""

    def __init__(self, cfg: WorkloadConfig, count_tokens: CountTokens) -> None:
        self.cfg = cfg
        self.count = count_tokens
        self.rng = random.Random(cfg.seed)
        self.facts: dict[int, object] = {}
        self.names: set[str] = set()

    # ---- entities -------------------------------------------------------------------------------------------
    def _unique(self, make: Callable[[], str]) -> str:
        for _ in range(1000):
            name = make()
            if name not in self.names:
                self.names.add(name)
                return name
        raise ValueError("entity vocabulary exhausted: lower the corpus size")

    def _person(self, towns: list[int]) -> _Person:
        rng = self.rng
        male = rng.random() < 0.5
        name = self._unique(lambda: f"{rng.choice(MALE_NAMES if male else FEMALE_NAMES)} {rng.choice(SURNAMES)}")
        born = (rng.randint(1850, 1960), rng.randint(1, 12), rng.randint(1, 28))
        died = (born[0] + rng.randint(38, 95), rng.randint(1, 12), rng.randint(1, 28))
        return _Person(name, male, rng.choice(COUNTRIES)[1], rng.choice(PROFESSIONS), born, died, rng.choice(towns))

    def _town(self) -> _Town:
        rng = self.rng
        return _Town(self._unique(lambda: rng.choice(TOWN_HEADS) + rng.choice(TOWN_TAILS)),
                     rng.choice(COUNTRIES)[0], rng.choice(RIVERS))

    def _film(self, directors: list[int]) -> _Film:
        rng = self.rng
        title = self._unique(lambda: rng.choice((
            lambda: f"The {rng.choice(TITLE_ADJECTIVES)} {rng.choice(TITLE_NOUNS)}",
            lambda: f"{rng.choice(TITLE_NOUNS)} of the {rng.choice(TITLE_NOUNS)}",
            lambda: f"Return to {_somewhere(rng)}",
        ))())
        director = rng.choice(directors)
        born = self.facts[director].born[0]
        return _Film(title, rng.randint(born + 22, born + 60), director, rng.choice(GENRES), rng.choice(COUNTRIES)[1])

    # ---- sentences ------------------------------------------------------------------------------------------
    def _person_sentences(self, p: _Person) -> list[str]:
        rng = self.rng
        he, his = ("He", "his") if p.male else ("She", "her")
        town = self.facts[p.town].name

        def year(lo: int, hi: int) -> int:
            """A year `lo`..`hi` years after birth, no later than the death."""
            return min(p.born[0] + rng.randint(lo, hi), p.died[0])

        taught_from = year(30, 45)

        more = [
            f"{he} began {his} career in {year(18, 30)} as an assistant to {_someone(rng)}.",
            f"In {year(20, 40)}, {he.lower()} married {_someone(rng)}; the couple had "
            f"{rng.choice(('two', 'three', 'four'))} children.",
            f"{his.capitalize()} work was shown at the {rng.choice(FESTIVALS)}, where it won the "
            f"{rng.choice(AWARDS)} in {year(25, 45)}.",
            f"After moving to {_somewhere(rng)} in {year(25, 50)}, {he.lower()} worked for "
            f"{rng.choice(STUDIOS)} for {rng.randint(3, 15)} years.",
            f"{his.capitalize()} father was a {rng.choice(PROFESSIONS)} from {_somewhere(rng)}, and {his} mother "
            f"taught music.",
            f"Critics described {his} style as {rng.choice(('restrained', 'lyrical', 'bold', 'austere'))} and "
            f"{rng.choice(('precise', 'warm', 'ironic', 'melancholic'))}.",
            f"From {taught_from} to {min(taught_from + rng.randint(3, 15), p.died[0])}, {he.lower()} taught at "
            f"{rng.choice(UNIVERSITIES)}.",
            f"{his.capitalize()} memoirs, published in {year(55, 70)}, describe a childhood in {town} and the "
            f"years of the war.",
            f"{he} was elected a member of the Academy of Arts in {year(40, 60)}.",
        ]
        return [
            f"{p.name} ({_date(p.born)} – {_date(p.died)}) was {_article(p.nationality)} {p.nationality} "
            f"{p.profession}.",
            f"{he} was born in {town} and studied at {rng.choice(UNIVERSITIES)}.",
            *rng.sample(more, len(more)),
            f"{he} died in {_somewhere(rng)} on {_date(p.died)}.",
        ]

    def _film_sentences(self, f: _Film) -> list[str]:
        rng = self.rng
        more = [
            f"The screenplay was written by {_someone(rng)}, based on a novel of the same name.",
            f"Filming took place in {_somewhere(rng)} over {rng.randint(5, 20)} weeks in {f.year - 1}.",
            f"The film premiered at the {rng.choice(FESTIVALS)} in {rng.choice(MONTHS)} {f.year} and was "
            f"distributed by {rng.choice(STUDIOS)}.",
            f"The music was composed by {_someone(rng)}, and the cinematography was by {_someone(rng)}.",
            f"It was a {rng.choice(('modest', 'great', 'surprising'))} success and was remade in "
            f"{f.year + rng.randint(10, 40)}.",
            f"Critics praised its {rng.choice(('acting', 'photography', 'score', 'pacing'))} but found the ending "
            f"{rng.choice(('abrupt', 'sentimental', 'confusing'))}.",
            f"It was made on a budget of about {rng.randint(2, 90) * 10000} dollars and earned "
            f"{rng.choice(('twice', 'three times', 'half'))} that amount.",
            f"A restored version was shown at the {rng.choice(FESTIVALS)} in {f.year + rng.randint(30, 60)}.",
            f"{_someone(rng)} received the {rng.choice(AWARDS)} for the best supporting role.",
        ]
        return [
            f"{f.title} is {_article(str(f.year))} {f.year} {f.nationality} {f.genre} directed by "
            f"{self.facts[f.director].name}.",
            f"It stars {_someone(rng)} and {_someone(rng)}.",
            *rng.sample(more, len(more)),
        ]

    def _town_sentences(self, t: _Town) -> list[str]:
        rng = self.rng
        more = [
            f"At the census of {rng.randint(1900, 2020)} it had {rng.randint(2, 90) * 1000} inhabitants.",
            f"The town was first mentioned in a charter of {rng.randint(900, 1500)}.",
            f"Its economy was long based on {rng.choice(INDUSTRIES)} and later on {rng.choice(INDUSTRIES)}.",
            f"A railway line to {_somewhere(rng)} opened in {rng.randint(1840, 1930)}.",
            f"The old {rng.choice(('church', 'castle', 'market hall', 'bridge'))} was rebuilt after a fire in "
            f"{rng.randint(1600, 1900)}.",
            f"During the {rng.choice(WARS)}, the town was occupied and much of its centre was destroyed.",
            f"A weekly market has been held on the main square since {rng.randint(1300, 1800)}.",
            f"The town hall, built in {rng.randint(1400, 1900)} in the {rng.choice(STYLES)} style, houses a small "
            f"museum of local history.",
            f"{t.name} is twinned with {_somewhere(rng)} and {_somewhere(rng)}.",
            f"The nearest airport is in {_somewhere(rng)}, about {rng.randint(12, 90)} kilometres to the "
            f"{rng.choice(('north', 'south', 'east', 'west'))}.",
        ]
        return [f"{t.name} is a town in {t.country}, on the river {t.river}.", *rng.sample(more, len(more))]

    # ---- continuations: endless sentences for passages longer than the facts ---------------------------------
    # Each passage draws them from a generator of its own, so however many it takes, the writer's shared draws
    # (entities, facts, length targets) stay where they were.
    def _person_more(self, p: _Person, rng: random.Random) -> Iterator[str]:
        """A career, work by work; no births, deaths or nationalities, so the facts' answers stay the only ones."""
        he, his = ("he", "his") if p.male else ("she", "her")

        def year() -> int:
            return rng.randint(p.born[0] + 18, p.died[0])

        def work() -> str:
            return f"{rng.choice(WORK_FORMS)} of {_somewhere(rng)}"

        templates = (
            lambda: f"In {year()}, {he} completed {work()}, {_with_article(rng.choice(QUALITIES))} work about "
                    f"{rng.choice(SUBJECTS)}.",
            lambda: f"{his.capitalize()} {work()} ({year()}) was dedicated to {_someone(rng)}.",
            lambda: f"In {year()}, {he} spent several months in {_somewhere(rng)}, where {he} met the "
                    f"{rng.choice(ROLES)} {_someone(rng)}.",
            lambda: f"{he.capitalize()} corresponded for many years with {_someone(rng)}, whose letters are kept "
                    f"in {_somewhere(rng)}.",
            lambda: f"The lectures {he} gave in {_somewhere(rng)} in {year()} were later printed as {work()}.",
            lambda: f"With {_someone(rng)}, {he} opened a small workshop in {_somewhere(rng)} in {year()}.",
            lambda: f"{his.capitalize()} students included {_someone(rng)} and {_someone(rng)}.",
            lambda: f"Critics called {his} {work()} {rng.choice(QUALITIES)} and compared it with {his} earlier "
                    f"work on {rng.choice(SUBJECTS)}.",
            lambda: f"In {year()}, a fire destroyed {his} studio in {_somewhere(rng)}, along with "
                    f"{rng.randint(3, 40)} unfinished works.",
            lambda: f"{he.capitalize()} returned to {rng.choice(SUBJECTS)} in {year()}, after a long journey to "
                    f"{_somewhere(rng)}.",
        )
        return _endless(rng, templates)

    def _film_more(self, f: _Film, rng: random.Random) -> Iterator[str]:
        """Plot, shooting and reception; no director, release year or nationality besides the facts'."""
        templates = (
            lambda: f"The story follows {_someone(rng)}, {_with_article(rng.choice(ROLES))} who returns to "
                    f"{_somewhere(rng)} after {rng.randint(2, 30)} years away.",
            lambda: f"In one scene, the {rng.choice(ROLES)} waits at the {rng.choice(LANDMARKS)} for a letter that "
                    f"never arrives.",
            lambda: f"Later, {_someone(rng)} learns that the {rng.choice(LANDMARKS)} is to be sold to a stranger "
                    f"from {_somewhere(rng)}.",
            lambda: f"The scenes at the {rng.choice(LANDMARKS)} were shot near {_somewhere(rng)} in "
                    f"{rng.randint(2, 9)} days.",
            lambda: f"A reviewer in {_somewhere(rng)} called the film {rng.choice(QUALITIES)} and singled out the "
                    f"{rng.choice(ROLES)} played by {_someone(rng)}.",
            lambda: f"{_someone(rng)} later recalled that the scene of the {rng.choice(EVENTS)} took "
                    f"{rng.randint(2, 14)} days to film.",
            lambda: f"The film ran for {rng.randint(2, 30)} weeks at a single cinema in {_somewhere(rng)}.",
            lambda: f"Its last scene, set at the {rng.choice(LANDMARKS)} during a {rng.choice(EVENTS)}, was "
                    f"shortened by {rng.randint(2, 12)} minutes for audiences abroad.",
            lambda: f"The {rng.choice(ROLES)} is played by {_someone(rng)}, who learned {rng.choice(TRADES)} for "
                    f"the part.",
        )
        return _endless(rng, templates)

    def _town_more(self, t: _Town, rng: random.Random) -> Iterator[str]:
        """History and trades; no river or country besides the facts'."""
        templates = (
            lambda: f"In {rng.randint(1500, 1950)}, a {rng.choice(EVENTS)} damaged the {rng.choice(LANDMARKS)} and "
                    f"much of the street around it.",
            lambda: f"{_someone(rng)}, a local {rng.choice(ROLES)}, founded a {rng.choice(INSTITUTIONS)} in the "
                    f"town in {rng.randint(1700, 1990)}.",
            lambda: f"The quarter by the {rng.choice(LANDMARKS)} grew around a {rng.choice(TRADES)} works opened "
                    f"in {rng.randint(1600, 1950)}.",
            lambda: f"By {rng.randint(1700, 1990)}, {rng.randint(2, 60)} families in the town lived from "
                    f"{rng.choice(TRADES)}.",
            lambda: f"Every {rng.choice(MONTHS)}, the town holds a fair of {rng.choice(TRADES)} by the "
                    f"{rng.choice(LANDMARKS)}.",
            lambda: f"The road to {_somewhere(rng)} passes the {rng.choice(LANDMARKS)} and an inn first recorded in "
                    f"{rng.randint(1400, 1800)}.",
            lambda: f"Its {rng.choice(INSTITUTIONS)}, opened in {rng.randint(1800, 1960)}, moved to new premises in "
                    f"{rng.randint(1961, 2015)}.",
            lambda: f"Local records tell of a {rng.choice(EVENTS)} in {rng.randint(1300, 1900)} that lasted "
                    f"{rng.randint(2, 30)} days.",
            lambda: f"The painter {_someone(rng)} spent {rng.randint(2, 20)} summers in {t.name} and painted its "
                    f"{rng.choice(LANDMARKS)}.",
        )
        return _endless(rng, templates)

    # ---- passages -------------------------------------------------------------------------------------------
    def _paragraph(self, title: str, sentences: Iterator[str]) -> tuple[str, int]:
        """Title line plus whole sentences until the text reaches a token target drawn from the configured range,
        cut back by words to the range's maximum; a range no word boundary can land in is refused.

        Each sentence is tokenized alone for a running estimate and the whole text only near the target, so a
        4K-token passage costs a few whole-text counts, not one per sentence."""
        lo, hi = self.cfg.passage_tokens
        target = self.rng.randint(lo, hi)
        words: list[str] = []
        ends: list[int] = []  # the word count at each sentence's end

        @cache  # `words` only grows, so a prefix's count never changes
        def tokens(num_words: int) -> int:
            return self.count(f"{title}\n{' '.join(words[:num_words])}\n")

        estimate = self.count(f"{title}\n")
        for sentence in sentences:  # endless: every kind continues past its facts
            words += sentence.split()
            ends.append(len(words))
            estimate += self.count(f" {sentence}")
            if estimate >= target and tokens(len(words)) >= target:
                break
        while len(ends) > 1 and tokens(ends[-2]) >= target:  # where the estimate ran short of the count
            ends.pop()
        start = ends[-2] if len(ends) > 1 else 1
        # the most words that fit `hi`, searched within the last sentence (a text's count grows with its words)
        keep = start - 1 + bisect_left(range(start, ends[-1] + 1), True, key=lambda n: tokens(n) > hi)
        if keep == 0:
            raise ValueError(f"passage_tokens {lo},{hi}: the passage {title!r} needs {tokens(1)} tokens for its "
                             f"title line and one word; raise the maximum")
        num_tokens = tokens(keep)
        if not lo <= num_tokens <= hi:
            raise ValueError(f"passage_tokens {lo},{hi}: cut at a word boundary, the passage {title!r} has "
                             f"{num_tokens} tokens; widen the range")
        return f"{title}\n{' '.join(words[:keep])}\n", num_tokens

    def corpus(self) -> list[Passage]:
        n = self.cfg.corpus_size
        kinds = ["town"] * max(1, n * 15 // 100) + ["person"] * max(1, n // 2)
        kinds += ["film"] * (n - len(kinds))
        kinds = kinds[:n]
        out: list[Passage] = []
        towns: list[int] = []
        people: list[int] = []
        for pid, kind in enumerate(kinds):  # towns, then people born in them, then films they directed
            more = random.Random(f"{self.cfg.seed}/{pid}")  # the continuation's own draws
            if kind == "town":
                fact = self._town()
                title, link = fact.name, None
                sentences = chain(self._town_sentences(fact), self._town_more(fact, more))
                towns.append(pid)
            elif kind == "person":
                fact = self._person(towns)
                title, link = fact.name, fact.town
                sentences = chain(self._person_sentences(fact), self._person_more(fact, more))
                people.append(pid)
            else:
                fact = self._film(people)
                title, link = fact.title, fact.director
                sentences = chain(self._film_sentences(fact), self._film_more(fact, more))
            self.facts[pid] = fact
            text, tokens = self._paragraph(title, sentences)
            out.append(Passage(pid, kind, title, text, tokens, link))
        return out


class _QuestionWriter:
    """2Wiki's question types over the sample's gold passages: compositional (two hops) and comparison."""

    def __init__(self, corpus: list[Passage], facts: dict[int, object], rng: random.Random) -> None:
        self.corpus = corpus
        self.facts = facts
        self.rng = rng

    def _candidates(self, gold: int, others: list[int]) -> list[tuple[str, Gold]]:
        """(question, answer) pairs about the gold passage."""
        fact = self.facts[gold]
        same_kind = [p for p in others if type(self.facts[p]) is type(fact)]
        out = []
        if isinstance(fact, _Film):
            director = self.facts[fact.director]
            out += [(f"Where was the director of the film {fact.title} born?", Gold((self.facts[director.town].name,))),
                    (f"When did the director of the film {fact.title} die?", Gold((str(director.died[0]),)))]
            if same_kind:
                other = self.facts[self.rng.choice(same_kind)]
                out.append((f"Which film came out first, {fact.title} or {other.title}?",
                            _first(fact.title, fact.year, other.title, other.year)))
        elif isinstance(fact, _Person):
            country = self.facts[fact.town].country
            out.append((f"In which country is the town where {fact.name} was born?", Gold((_bare(country),))))
            if same_kind:
                other = self.facts[self.rng.choice(same_kind)]
                same = fact.nationality == other.nationality
                out += [(f"Who was born first, {fact.name} or {other.name}?",
                         _first(fact.name, fact.born, other.name, other.born)),
                        (f"Are {fact.name} and {other.name} of the same nationality?",
                         Gold(("yes",), ("no",)) if same else Gold(("no",), ("yes",)))]
        else:
            out.append((f"Which river flows through the town of {fact.name}, and in which country is it?",
                        Gold((fact.river, _bare(fact.country)))))
        return out

    def question(self, gold: int, others: list[int], count: CountTokens, max_tokens: int) -> tuple[str, int, Gold]:
        """A question about the gold passage, its tokens (`question_block`'s) and its answer, with an answer
        instruction added to the question when it fits `max_tokens`."""
        core, answer = self.rng.choice(self._candidates(gold, others))
        full = f"{core} Answer with a short phrase, then explain it in one sentence."
        full_tokens = count(question_block(full))
        if full_tokens <= max_tokens:
            return full, full_tokens, answer
        return core, count(question_block(core)), answer


def _first(a: str, a_key: object, b: str, b_key: object) -> Gold:
    """Which of two comes first by key; a tie's right answer names both."""
    if a_key == b_key:
        return Gold((a, b))
    return Gold((a,), (b,)) if a_key < b_key else Gold((b,), (a,))


def _bare(country: str) -> str:
    """A country without its article ("the Netherlands" is answered "Netherlands" as often)."""
    return country.removeprefix("the ")


def _zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w / w.sum()


def build_workload(cfg: WorkloadConfig, count_tokens: CountTokens) -> RagWorkload:
    """The corpus and the samples for `cfg`; `count_tokens` is the model tokenizer's length (no special tokens).
    Raises ValueError where this tokenizer's text can't honor the passage lengths."""
    writer = _CorpusWriter(cfg, count_tokens)
    corpus = writer.corpus()
    np_rng = np.random.default_rng(cfg.seed)
    by_rank = np_rng.permutation(len(corpus))  # popularity rank -> passage id, unrelated to generation order
    weights = _zipf_weights(len(corpus), cfg.zipf)
    questions = _QuestionWriter(corpus, writer.facts, random.Random(cfg.seed + 1))
    samples = []
    for sid in range(cfg.num_samples):
        gold = int(by_rank[np_rng.choice(len(corpus), p=weights)])
        chosen = [gold]
        link = corpus[gold].link
        if link is not None and cfg.num_passages > 1:
            chosen.append(link)  # the second hop, as 2Wiki's second gold paragraph
        pool = weights.copy()
        pool[np.isin(by_rank, chosen)] = 0.0
        extra = np_rng.choice(len(corpus), size=cfg.num_passages - len(chosen), replace=False, p=pool / pool.sum())
        chosen += [int(by_rank[r]) for r in extra]
        question, question_tokens, answer = questions.question(gold, chosen[1:], count_tokens, cfg.max_question_tokens)
        order = np_rng.permutation(len(chosen))
        samples.append(Sample(sid, tuple(chosen[i] for i in order), question, answer, question_tokens))
    return RagWorkload(cfg, corpus, samples)
