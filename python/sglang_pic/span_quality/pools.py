"""What the tasks' documents are drawn from: names, towns, tool schemas and standard-library functions.

They sit apart from the tasks that draw them because several tasks share the names and towns, and TaskSizes
(sizes.py) bounds how many tools and functions a prompt may hold by how many are listed here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

COMPANY_ROOTS = ("Vel", "Tor", "Zan", "Quor", "Mir", "Kest", "Lum", "Brix", "Orv", "Pell", "Dax", "Sol", "Nym", "Fen")
COMPANY_ENDS = ("ora", "ex", "ion", "ara", "ix", "ent", "ano", "eth")
COMPANY_KINDS = ("Systems", "Industries", "Labs", "Works", "Foods", "Motors", "Instruments", "Textiles")
COMPANY_NAMES = tuple(f"{r}{e} {k}" for r in COMPANY_ROOTS for e in COMPANY_ENDS for k in COMPANY_KINDS)
PRODUCTS = (
    "bicycle frames", "water pumps", "solar panels", "ceramic tiles", "wool blankets", "microscopes", "canned soup",
    "garden tools", "radio receivers", "paper lanterns", "leather boots", "glass bottles",
)
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "silver", "brown")
FIRST_NAMES = ("Anna", "Boris", "Chiara", "David", "Emil", "Fiona", "Goran", "Hanna", "Igor", "Jana", "Kofi", "Lena")
LAST_NAMES = (
    "Albrecht", "Barros", "Conti", "Duval", "Eriksen", "Fischer", "Greco", "Horvath", "Ibsen", "Janssen", "Kovacs",
    "Laurent", "Mendes", "Nilsson", "Oyelaran", "Pavlov", "Reyes", "Sato", "Tamm", "Varga", "Weber", "Zielinski",
)
TOWN_HEADS = ("Ash", "Bel", "Cran", "Dun", "Elm", "Fair", "Glen", "Hollow", "Iver", "Kirk", "Lang", "Marsh", "Nor",
              "Pine", "Raven", "Stone", "Thorn", "Wil")
TOWN_TAILS = ("ford", "moor", "wick", "bury", "field", "haven", "stead", "ton", "mouth", "dale", "holm", "brook")


def town(rng: random.Random) -> str:
    return rng.choice(TOWN_HEADS) + rng.choice(TOWN_TAILS)


# ---- tools (tool_selection's documents) --------------------------------------------------------------------------
CITIES = ("Paris", "Oslo", "Lisbon", "Nairobi", "Osaka", "Denver", "Prague", "Lima", "Hanoi", "Dublin")
VALUES: dict[str, tuple[str, ...]] = {
    "city": CITIES, "origin": CITIES, "destination": CITIES, "pickup": ("the airport", "the station", "my hotel"),
    "currency": ("EUR", "USD", "JPY", "GBP", "CHF"), "amount": ("25", "120", "300", "1500"),
    "person": ("anna@example.com", "kofi@example.com", "lena@example.com"),
    "subject": ("Quarterly report", "Dinner on Friday", "Project kickoff"),
    "cuisine": ("Thai", "Italian", "Mexican", "Ethiopian"), "symbol": ("AAPL", "NVDA", "TSLA", "SAP"),
    "phrase": ("good morning", "where is the station", "thank you very much"),
    "language": ("French", "Japanese", "German", "Swahili"), "minutes": ("5", "10", "25", "45"),
    "title": ("Dentist appointment", "Team lunch", "Piano lesson"),
    "date": ("2025-03-14", "2025-06-02", "2025-11-20"), "time": ("09:30", "14:00", "18:15"),
    "music": ("jazz", "Beethoven", "Nina Simone"), "topic": ("electric cars", "the Olympics", "climate policy"),
    "percent": ("15", "18", "20"),
}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    params: dict[str, tuple[str, str, str]]  # argument -> (JSON type, description, VALUES key)
    required: tuple[str, ...]
    request: str  # the user's request, with {argument} slots


TOOL_SPECS = (
    ToolSpec("get_weather", "Get the current weather in a city.",
             {"city": ("string", "The city name.", "city")}, ("city",),
             "What's the weather like in {city} right now?"),
    ToolSpec("convert_currency", "Convert an amount of money from one currency to another.",
             {"amount": ("number", "The amount to convert.", "amount"),
              "from_currency": ("string", "ISO code of the source currency.", "currency"),
              "to_currency": ("string", "ISO code of the target currency.", "currency")},
             ("amount", "from_currency", "to_currency"), "How much is {amount} {from_currency} in {to_currency}?"),
    ToolSpec("send_email", "Send an email to a recipient.",
             {"to": ("string", "The recipient's address.", "person"),
              "subject": ("string", "The subject line.", "subject")},
             ("to", "subject"), "Email {to} with the subject '{subject}'."),
    ToolSpec("book_flight", "Book a flight between two cities on a given date.",
             {"origin": ("string", "Departure city.", "origin"),
              "destination": ("string", "Arrival city.", "destination"),
              "date": ("string", "Departure date, YYYY-MM-DD.", "date")},
             ("origin", "destination", "date"), "Book me a flight from {origin} to {destination} on {date}."),
    ToolSpec("find_restaurants", "Find restaurants in a city that serve a cuisine.",
             {"city": ("string", "The city to search.", "city"), "cuisine": ("string", "Kind of food.", "cuisine")},
             ("city", "cuisine"), "Find me a {cuisine} restaurant in {city}."),
    ToolSpec("get_stock_price", "Get the latest trading price of a stock.",
             {"symbol": ("string", "The ticker symbol.", "symbol")}, ("symbol",),
             "What is {symbol} trading at today?"),
    ToolSpec("translate_text", "Translate a text into another language.",
             {"text": ("string", "The text to translate.", "phrase"),
              "target_language": ("string", "The language to translate into.", "language")},
             ("text", "target_language"), "How do you say '{text}' in {target_language}?"),
    ToolSpec("set_timer", "Start a countdown timer.",
             {"minutes": ("integer", "Length of the timer in minutes.", "minutes")}, ("minutes",),
             "Set a timer for {minutes} minutes."),
    ToolSpec("create_event", "Add an event to the user's calendar.",
             {"title": ("string", "What the event is.", "title"), "date": ("string", "YYYY-MM-DD.", "date"),
              "time": ("string", "HH:MM, 24-hour clock.", "time")},
             ("title", "date"), "Put '{title}' in my calendar on {date} at {time}."),
    ToolSpec("play_music", "Play a song, artist or genre on the living-room speaker.",
             {"query": ("string", "What to play.", "music")}, ("query",), "Play some {query} on the speaker."),
    ToolSpec("search_news", "Search recent news articles about a topic.",
             {"topic": ("string", "The subject of the articles.", "topic")}, ("topic",),
             "Show me the latest news about {topic}."),
    ToolSpec("calculate_tip", "Compute the tip on a restaurant bill.",
             {"bill_amount": ("number", "The bill in dollars.", "amount"),
              "tip_percent": ("number", "The tip as a percentage.", "percent")},
             ("bill_amount", "tip_percent"), "What is a {tip_percent} percent tip on a {bill_amount} dollar bill?"),
)


# ---- code (code_retrieval's documents) ---------------------------------------------------------------------------
# Pure-Python functions of the standard library (inspect.getsource needs their source) whose docstrings open with a
# sentence that says what they do without naming them.
STDLIB_FUNCTIONS = (
    "textwrap.dedent", "textwrap.indent", "textwrap.shorten", "shlex.quote", "fnmatch.filter", "json.dumps",
    "base64.b64decode", "heapq.nsmallest", "statistics.stdev", "statistics.fmean", "statistics.multimode",
    "statistics.quantiles", "calendar.isleap", "calendar.monthrange", "difflib.get_close_matches", "difflib.ndiff",
    "ipaddress.collapse_addresses", "glob.glob", "shutil.copyfileobj", "shutil.copytree", "shutil.get_terminal_size",
    "urllib.parse.urljoin", "urllib.parse.parse_qs", "zipfile.is_zipfile", "uuid.uuid5",
    "email.utils.parseaddr", "mimetypes.guess_type", "copy.deepcopy", "dataclasses.asdict", "dataclasses.replace",
    "inspect.cleandoc", "types.new_class", "secrets.token_hex", "traceback.format_exception",
    "warnings.simplefilter", "subprocess.getoutput", "socket.create_connection", "getpass.getuser",
    "tempfile.mkdtemp",
)
