"""The vocabulary of :mod:`bench.memgen`: what users say about themselves and how they ask.

Each :class:`Slot` has values, several ways to state a value in conversation (``{v}``), the
canonical fact an agent would store, questions worded to share few words with the statements,
and (for slots that change) questions about a past date (``{d}``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ABSTAIN_ONLY", "FILLER", "MULTI_SLOTS", "SINGLE_SLOTS", "Slot"]


@dataclass(frozen=True)
class Slot:
    """One thing a user can say about themselves."""

    name: str
    values: tuple[str, ...]
    statements: tuple[str, ...]
    fact: str
    questions: tuple[str, ...]
    temporal: tuple[str, ...] = ()
    keyed: bool = True
    preference: bool = False


SINGLE_SLOTS: list[Slot] = [
    Slot(
        "city",
        ("Lisbon", "Denver", "Osaka", "Nairobi", "Toronto", "Krakow", "Melbourne", "Valencia"),
        (
            "I just moved to {v}, still unpacking boxes.",
            "We relocated to {v} last month.",
            "Home is {v} now, the rent is wild.",
            "I'm based in {v} these days.",
        ),
        "lives in {v}",
        (
            "Which city is my current home?",
            "Where am I residing at the moment?",
            "What town do I call home right now?",
        ),
        ("Where was I residing on {d}?", "Which city was home for me on {d}?"),
    ),
    Slot(
        "employer",
        (
            "Acme Robotics",
            "Globex",
            "Initech",
            "Umbrella Health",
            "Stark Logistics",
            "Hooli",
            "Vandelay Imports",
        ),
        (
            "I started a new job at {v}.",
            "I signed the offer from {v} yesterday.",
            "My badge for {v} finally arrived, first week there.",
        ),
        "works at {v}",
        (
            "Who is my employer?",
            "Which company pays my salary?",
            "What organisation am I on the payroll of?",
        ),
        ("Which company employed me on {d}?", "Who was paying my salary on {d}?"),
    ),
    Slot(
        "job",
        (
            "data engineer",
            "nurse",
            "product designer",
            "chemistry teacher",
            "paralegal",
            "sous chef",
        ),
        (
            "My role is {v} now.",
            "I got promoted, I'm officially a {v}.",
            "Career change: I'm working as a {v}.",
        ),
        "job title is {v}",
        ("What's my occupation?", "What do I do for a living?", "What is my profession?"),
        ("What was my occupation on {d}?",),
    ),
    Slot(
        "car",
        ("Subaru Outback", "Tesla Model 3", "Honda Civic", "Ford F-150", "Volvo XC40"),
        (
            "I bought a {v} over the weekend.",
            "Picked up my new {v} from the dealer.",
            "I'm driving a {v} now.",
        ),
        "drives a {v}",
        (
            "What vehicle do I own?",
            "What am I getting around in on the road?",
            "Which automobile is parked in my garage?",
        ),
        ("What vehicle did I own on {d}?",),
    ),
    Slot(
        "phone",
        ("Pixel 8", "iPhone 15", "Galaxy S23", "Fairphone 5"),
        ("I switched to a {v}.", "My new {v} arrived today.", "Upgraded my handset to a {v}."),
        "uses a {v} phone",
        ("Which mobile device do I carry?", "What smartphone model is mine?"),
        ("Which mobile device did I carry on {d}?",),
    ),
    Slot(
        "partner",
        ("Priya", "Marcus", "Elena", "Tomas", "Aiko", "Grace"),
        (
            "My wife {v} says hi.",
            "{v} and I just celebrated our anniversary.",
            "My husband {v} cooked tonight.",
        ),
        "partner is named {v}",
        ("What's my spouse called?", "Who am I married to?"),
        (),
    ),
    Slot(
        "gym",
        ("spin classes", "CrossFit", "swimming laps", "yoga", "marathon training"),
        ("I've been doing {v} three times a week.", "My exercise routine is {v} now."),
        "works out with {v}",
        ("How do I keep fit?", "What is my fitness regime?"),
        ("How was I keeping fit on {d}?",),
    ),
    Slot(
        "cadence",
        ("daily", "weekly", "monthly"),
        (
            "Can you send me summaries {v}?",
            "I'd like a {v} recap from you.",
            "Let's do the digest {v} from now on.",
        ),
        "prefers {v} summaries",
        ("How often should I get recap emails?", "What frequency works for my digests?"),
        ("How often did I want recaps on {d}?",),
        preference=True,
    ),
    Slot(
        "channel",
        ("email", "SMS", "Slack", "a phone call"),
        (
            "Please reach me by {v}.",
            "{v} is the best way to contact me.",
            "If anything comes up, use {v}.",
        ),
        "prefers to be contacted by {v}",
        ("What's the best way to get in touch with me?", "How do I like to be reached?"),
        ("How did I want to be reached on {d}?",),
        preference=True,
    ),
    Slot(
        "cuisine",
        ("Thai", "Ethiopian", "Neapolitan pizza", "sushi", "vegan Mexican"),
        (
            "I'm obsessed with {v} food.",
            "Nothing beats {v} for dinner.",
            "My favourite meal is {v}.",
        ),
        "favourite cuisine is {v}",
        (
            "Recommend somewhere to eat tonight that I'd enjoy.",
            "Pick a restaurant for my birthday.",
        ),
        ("What restaurant would I have picked on {d}?",),
        preference=True,
    ),
    Slot(
        "seat",
        ("aisle", "window"),
        ("I always pick the {v} seat when flying.", "On planes I need the {v}."),
        "prefers {v} seats on flights",
        (
            "Book me a flight to Chicago: where should I sit?",
            "Choose my spot on the plane for the trip.",
        ),
        (),
        preference=True,
    ),
    Slot(
        "music",
        ("jazz", "techno", "bluegrass", "K-pop", "classical"),
        ("I've had {v} on repeat all week.", "Honestly {v} is my favourite genre."),
        "likes listening to {v}",
        ("Put on a playlist I'd enjoy.", "What should play in the background while I work?"),
        (),
        preference=True,
    ),
    Slot(
        "tone",
        ("formal", "casual", "brief bullet points"),
        ("Keep your replies {v}, please.", "I prefer {v} when you write to me."),
        "wants replies written as {v}",
        ("How should you word messages to me?", "What style do I like answers in?"),
        ("What style did I like answers in on {d}?",),
        preference=True,
    ),
]

MULTI_SLOTS: list[Slot] = [
    Slot(
        "pets",
        (
            "a beagle named Rufus",
            "a tabby cat called Miso",
            "two goldfish",
            "a parrot named Kiwi",
            "a rescue greyhound",
        ),
        ("We adopted {v}.", "Say hello to the newest family member, {v}."),
        "has {v} as a pet",
        ("What animals share my household?", "Tell me about the creatures I look after."),
        keyed=False,
    ),
    Slot(
        "hobbies",
        ("bouldering", "pottery", "chess", "sourdough baking", "birdwatching", "salsa dancing"),
        ("I've gotten into {v} lately.", "Spent all Saturday on {v} again."),
        "enjoys {v} as a hobby",
        ("What do I do for fun?", "How do I spend my free time?"),
        keyed=False,
    ),
    Slot(
        "trips",
        ("Iceland", "Peru", "Vietnam", "Morocco", "Norway"),
        ("I just got back from {v}, amazing trip.", "Flew home from {v} yesterday."),
        "travelled to {v}",
        ("Which countries have I visited recently?", "Where have my vacations taken me?"),
        keyed=False,
    ),
    Slot(
        "allergies",
        ("peanuts", "shellfish", "penicillin", "pollen", "lactose"),
        ("I'm allergic to {v}.", "Found out I react badly to {v}."),
        "is allergic to {v}",
        ("Is there anything I must avoid eating or taking?", "What are my sensitivities?"),
        keyed=False,
    ),
]

#: slots nobody ever states: questions about them have no answer in memory
ABSTAIN_ONLY: list[Slot] = [
    Slot("blood", ("",), ("",), "", ("What's my blood type?", "Which blood group am I?")),
    Slot(
        "school",
        ("",),
        ("",),
        "",
        ("Which university did I graduate from?", "Where did I study for my degree?"),
    ),
    Slot("shoes", ("",), ("",), "", ("What shoe size do I wear?",)),
    Slot("birthday", ("",), ("",), "", ("When is my birthday?", "What's my date of birth?")),
    Slot("sibling", ("",), ("",), "", ("How many brothers and sisters do I have?",)),
    Slot("movie", ("",), ("",), "", ("What's my all-time favourite film?",)),
    Slot("license", ("",), ("",), "", ("What is my passport number?",)),
]

#: chit-chat; ``{x}`` is a value from some slot (a lexical hard negative), ``{n}`` a number
FILLER: tuple[str, ...] = (
    "Can you summarise this article about {x} for me?",
    "My colleague keeps talking about {x}, what is it exactly?",
    "What's the weather going to be like this weekend?",
    "Draft an email to the team about the {n} open tickets.",
    "My sister is thinking about {x}, any thoughts?",
    "Remind me what a Gantt chart is.",
    "I read a funny story about {x} today.",
    "Convert {n} kilometres to miles please.",
    "What's a good book on habit building?",
    "Help me plan a {n}-minute presentation.",
    "Someone at the cafe mentioned {x}, sounded interesting.",
    "Is {x} popular these days?",
    "Write a haiku about Mondays.",
    "How do I fix a merge conflict in git?",
    "My neighbour just got {x}, they won't stop talking about it.",
    "What's {n} times 17?",
)
