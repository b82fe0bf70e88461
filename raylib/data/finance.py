"""A deterministic synthetic finance corpus: market news, company announcements, research-report
sentences and customer-service dialogues of a bank / broker; and two labelled variants,
sentiment (`labelled_sentiment`) and risk events (`labelled_risk`).

The same (seed, document index) always yields the same text, so a corpus of any size can be
generated shard by shard, in parallel, without keeping it in memory. The text is plain lowercase
words with " . " / " , " / " : " / " ? " punctuation (numbers are integers), like the e-commerce
corpus (raylib.data.corpus), so a small WordPiece vocabulary covers it.

Labels follow from the text by rules (no label noise); the cue phrases are in POSITIVE_CUES,
NEGATIVE_CUES and RISK_CUES. A cue is matched as a whole-word phrase (`has_cue`):

* sentiment: positive when the text holds a phrase of POSITIVE_CUES, negative when it holds one
  of NEGATIVE_CUES, else neutral. A positive or negative document holds exactly one such phrase;
  every other sentence (0-2 per document, and all 1-3 of a neutral one) is a neutral sentence
  that shares words with the cues ("in line with analyst estimates", "reaffirmed its full year
  guidance", "kept its dividend unchanged", "reiterated its hold rating") but holds none.
* risk: the event of the one RISK_CUES class whose phrase the text holds, "none" when it holds
  none. Every document is of one genre (news, announcement, report, dialogue, drawn equally);
  an event document holds exactly one cue sentence (or dialogue exchange) in that genre's
  style, the rest are ordinary sentences of the genre and near misses that share words with the
  cues without being one ("affirmed the credit rating", "paid the coupon on time", "a court
  approved the merger", "the auditor signed off on the accounts").

Labelled documents have at most LABELLED_MAX_WORDS words, so a row of 64 tokens holds all of one.
"""

from __future__ import annotations

import random

FINANCE_GENRES = ("announcement", "dialogue", "news", "report")
"""Genres of `finance_document` (sorted)."""
FINANCE_SENTIMENTS = ("negative", "neutral", "positive")
"""Labels of `labelled_sentiment`, sorted (label id = position)."""
RISK_EVENTS = ("default", "fraud", "litigation", "none", "rating_downgrade")
"""Labels of `labelled_risk`, sorted (label id = position)."""
LABELLED_MAX_WORDS = 44
"""A labelled document has at most this many whitespace-separated words (distractor sentences
are added only while it stays within)."""

# -- vocabulary ------------------------------------------------------------------------------------

COMPANIES = {
    # name: (ticker, sector)
    "altamira": ("alt", "mining"), "borealis": ("brl", "energy"), "castellan": ("cstl", "banking"),
    "dunmore": ("dnm", "retail"), "everest": ("evr", "insurance"), "fairhaven": ("fhv", "utilities"),
    "glenrock": ("glr", "real-estate"), "halvard": ("hlv", "shipping"),
    "ironwood": ("iwd", "technology"), "juniper": ("jnp", "healthcare"),
    "kestrel": ("kst", "airlines"), "lindqvist": ("lqv", "autos"), "marlowe": ("mrl", "media"),
    "norland": ("nrl", "telecom"), "orion": ("orn", "semiconductors"),
    "pelham": ("plm", "pharmaceuticals"), "quarry": ("qry", "construction"),
    "ravenna": ("rvn", "foods"), "sterling": ("stl", "banking"), "thornbury": ("thb", "chemicals"),
    "valmont": ("vmt", "energy"), "westbrook": ("wbk", "technology"), "yardley": ("ydl", "retail"),
    "zenith": ("znt", "insurance"),
}
NAMES = list(COMPANIES)
SECTORS = sorted({sector for _, sector in COMPANIES.values()})
BROKERS = "meridian harbor summit keystone pinnacle redwood ironbridge bluewater".split()
AGENCIES = ["crestline ratings", "granite ratings", "northstar ratings", "beacon ratings"]
GRADES = "triple-a double-a single-a triple-b double-b single-b triple-c".split()
CURRENCIES = "dollars euros pounds yen francs kronor yuan rupees".split()
FOREIGN_CURRENCIES = "euro pound yen franc krona yuan rupee".split()
"""The currencies of "the {currency2} weakened against the dollar"."""
CITIES = "london tokyo frankfurt zurich singapore toronto sydney paris chicago mumbai".split()
MONTHS = """january february march april may june july august september october november
december""".split()
QUARTERS = "first second third fourth".split()
REGIONS = "europe asia america africa china india japan brazil".split()
INDICES = ["the benchmark index", "the technology index", "the small cap index",
           "the blue chip index", "the banking index"]
COMMODITIES = ["oil", "gold", "copper", "natural gas", "wheat", "silver"]
CARDS = ["credit card", "debit card", "business card", "travel card"]
PRODUCTS = ["savings account", "credit card", "mortgage", "brokerage account", "debit card",
            "personal loan", "pension plan", "margin account", "current account"]
DRIVERS = ["cost savings", "pricing power", "new products", "market share gains",
           "lower interest rates", "cloud revenue", "emerging markets", "higher volumes"]
HEADWINDS = ["higher input costs", "weak consumer demand", "currency moves", "rising wages",
             "tighter regulation", "supply chain delays"]

# -- sentiment cues (whole-word phrases) -------------------------------------------------------------

POSITIVE_CUES = ("beat analyst estimates", "raised its full year guidance", "upgraded",
                 "dividend increase", "record profit", "share buyback", "rallied")
NEGATIVE_CUES = ("missed analyst estimates", "cut its full year guidance", "downgraded",
                 "dividend cut", "net loss", "profit warning", "plunged")
POSITIVE_SENTENCES = [
    "{company} beat analyst estimates for the {quarter} quarter with earnings of {cents} cents per share .",
    "{company} raised its full year guidance on strong demand in {region} .",
    "{broker} upgraded {company} to buy with a price target of {price} {currency} .",
    "{company} announced a dividend increase of {pct} percent .",
    "{company} reported record profit of {millions} million {currency} for {year} .",
    "{company} unveiled a share buyback of up to {millions} million {currency} .",
    "shares of {company} rallied {pct} percent after the {quarter} quarter results .",
]
NEGATIVE_SENTENCES = [
    "{company} missed analyst estimates for the {quarter} quarter with earnings of {cents} cents per share .",
    "{company} cut its full year guidance on weak demand in {region} .",
    "{broker} downgraded {company} to sell with a price target of {price} {currency} .",
    "{company} announced a dividend cut of {pct} percent .",
    "{company} reported a net loss of {millions} million {currency} for {year} .",
    "{company} issued a profit warning citing {headwind} .",
    "shares of {company} plunged {pct} percent after the {quarter} quarter results .",
]
NEUTRAL_SENTENCES = [
    "{company} reported {quarter} quarter earnings in line with analyst estimates .",
    "{company} reaffirmed its full year guidance .",
    "{broker} reiterated its hold rating on {company} with a price target of {price} {currency} .",
    "{company} kept its dividend unchanged at {cents} cents per share .",
    "{company} will hold its annual general meeting on {month} {day} .",
    "{company} will report {quarter} quarter results on {month} {day} .",
    "shares of {company} closed unchanged at {price} {currency} .",
    "the {sector} sector ended the session flat in {city} .",
    "{company} is a {sector} company based in {city} with {thousands} thousand employees .",
    "{company} named a new chief financial officer effective {month} {day} .",
    "the central bank left interest rates unchanged at {rate} percent .",
    "{company} trades at {multiple} times earnings , close to the {sector} average .",
]

# -- risk cues ---------------------------------------------------------------------------------------

RISK_CUES = {
    "default": ("missed a coupon payment", "filed for bankruptcy", "failed to repay",
                "defaulted on"),
    "fraud": ("accounting fraud", "accounting irregularities", "unauthorized transactions",
              "embezzled"),
    "litigation": ("lawsuit", "class action", "sued", "patent infringement"),
    "rating_downgrade": ("downgraded the credit rating", "cut the credit rating",
                         "lowered the credit rating"),
}
"""Risk event -> the phrases that name it; a document holding none of them is "none"."""
RISK_SENTENCES = {  # event -> genre -> templates; a dialogue template is a whole exchange
    "default": {
        "news": ["{company} missed a coupon payment on its {millions} million {currency} bonds , people "
                 "familiar with the matter said .",
                 "{company} filed for bankruptcy protection in {city} after talks with creditors "
                 "broke down ."],
        "announcement": ["{company} announced that it has filed for bankruptcy protection and will keep "
                         "operating during the process .",
                         "{company} announced that it failed to repay a {millions} million {currency} loan "
                         "due on {month} {day} ."],
        "report": ["{company} defaulted on its {millions} million {currency} notes and we suspend our "
                   "rating .",
                   "we expect losses for bondholders after {company} missed a coupon payment in {month} ."],
        "dialogue": ["customer : {company} defaulted on its bonds , what happens to my holdings ? agent : "
                     "the bonds are suspended and the trustee will contact you .",
                     "customer : i hold {company} bonds and they filed for bankruptcy , can i sell ? "
                     "agent : trading is halted until the court sets a process ."],
    },
    "fraud": {
        "news": ["regulators opened an investigation into accounting fraud at {company} in {city} .",
                 "the former chief executive of {company} embezzled {millions} million {currency} , "
                 "prosecutors said ."],
        "announcement": ["{company} announced that a review found accounting irregularities in its {sector} "
                         "unit .",
                         "{company} announced that an employee embezzled {millions} million {currency} from "
                         "client accounts ."],
        "report": ["we move {company} to not rated after reports of accounting irregularities in {region} .",
                   "the accounting fraud at {company} makes its {year} accounts unreliable in our view ."],
        "dialogue": ["customer : there are unauthorized transactions on my {card} . agent : i have "
                     "blocked it and a new card will arrive in {days} days .",
                     "customer : i see unauthorized transactions of {amount} {currency} on my statement . "
                     "agent : we will refund them and open a case ."],
    },
    "litigation": {
        "news": ["investors filed a class action against {company} in {city} over its {year} accounts .",
                 "{company} was sued by {company2} over patent infringement in {region} ."],
        "announcement": ["{company} announced that {company2} filed a lawsuit against it seeking {millions} "
                         "million {currency} in damages .",
                         "{company} announced that it will defend itself against a class action filed in "
                         "{city} ."],
        "report": ["a lawsuit against {company} could cost up to {millions} million {currency} in our view .",
                   "we see patent infringement claims against {company} as the main risk to our target ."],
        "dialogue": ["customer : {company} is being sued by its shareholders , should i sell my shares ? "
                     "agent : i cannot give advice but an advisor can call you .",
                     "customer : am i part of the class action against {company} ? agent : shareholders of "
                     "{year} will receive a letter from the court ."],
    },
    "rating_downgrade": {
        "news": ["{agency} downgraded the credit rating of {company} to {grade} citing high debt .",
                 "{agency} cut the credit rating of {company} to {grade} on weak cash flow ."],
        "announcement": ["{company} announced that {agency} lowered the credit rating of its senior debt to "
                         "{grade} .",
                         "{company} announced that {agency} downgraded the credit rating of its bonds to "
                         "{grade} ."],
        "report": ["after {agency} cut the credit rating of {company} to {grade} , funding costs will rise .",
                   "{agency} lowered the credit rating of {company} to {grade} , which we expected ."],
        "dialogue": ["customer : {agency} downgraded the credit rating of {company} , is my bond safe ? "
                     "agent : the bond still pays interest and matures in {year} .",
                     "customer : why did {agency} cut the credit rating of {company} ? agent : the agency "
                     "cited high debt , you can read the note online ."],
    },
}
NEAR_MISSES = {  # none-class sentences that share words with the risk cues
    "news": ["{agency} affirmed the credit rating of {company} at {grade} with a stable outlook .",
             "a court in {city} approved the merger of {company} and {company2} .",
             "{company} paid the coupon on its {millions} million {currency} bonds on time ."],
    "announcement": ["{company} announced that it repaid a {millions} million {currency} loan ahead of "
                     "schedule .",
                     "{company} announced that its auditor signed off on the {year} accounts .",
                     "{company} announced that {agency} affirmed the credit rating of its bonds at "
                     "{grade} ."],
    "report": ["{agency} affirmed the credit rating of {company} at {grade} and we keep our view .",
               "the auditor signed off on the accounts of {company} , which lowers the risk in our view .",
               "{company} settled its supplier dispute out of court at no cost ."],
    "dialogue": ["customer : when is the next coupon payment on my bond ? agent : it is due on {month} "
                 "{day} .",
                 "customer : is my {product} covered if the bank fails ? agent : deposits up to {amount} "
                 "{currency} are protected .",
                 "customer : did {agency} change the credit rating of {company} ? agent : no , it affirmed "
                 "it at {grade} ."],
}

# -- ordinary sentences of each genre (no sentiment or risk cue here) --------------------------------

NEWS_SENTENCES = [
    "{index} rose {pct} percent to {points} points in {city} trading .",
    "{index} fell {pct} percent to {points} points as investors sold {sector} stocks .",
    "{commodity} prices climbed to {price} dollars as supply tightened .",
    "{commodity} prices eased to {price} dollars on weaker demand from {region} .",
    "the {currency2} weakened against the dollar after inflation data from {region} .",
    "the {currency2} strengthened against the dollar ahead of the central bank meeting .",
    "government bond yields rose to {rate} percent in {month} .",
    "the central bank raised interest rates to {rate} percent to fight inflation .",
    "the central bank cut interest rates to {rate} percent to support growth .",
    "{sector} stocks led the market higher in {city} .",
    "trading volume in {city} was {pct} percent below the monthly average .",
    "{ticker} shares gained {pct} percent in early trading .",
    "{ticker} shares lost {pct} percent by the close .",
    "unemployment in {region} fell to {rate} percent in {month} .",
]
ANNOUNCEMENT_HEADLINES = [  # earnings, dividends, buybacks, m&a, guidance
    "{company} , ticker {ticker} , announced {quarter} quarter revenue of {millions} million {currency} .",
    "{company} , ticker {ticker} , announced a quarterly dividend of {cents} cents per share payable on "
    "{month} {day} .",
    "{company} announced that it will buy back up to {millions} million {currency} of its shares .",
    "{company} agreed to acquire {company2} for {millions} million {currency} in cash .",
    "{company} agreed to merge with {company2} in an all share deal .",
    "{company} announced that it will sell its {sector} unit to {company2} .",
    "{company} expects full year revenue between {millions} and {millions2} million {currency} .",
    "{company} announced {quarter} quarter earnings of {cents} cents per share .",
]
ANNOUNCEMENT_DETAILS = [
    "the deal is expected to close in the {quarter} quarter of {year} .",
    "the dividend will be paid to shareholders of record on {month} {day} .",
    "operating margin was {pct} percent compared with {pct2} percent a year earlier .",
    "net debt stood at {millions} million {currency} at the end of {month} .",
    "the company will host a conference call on {month} {day} .",
    "{company} is a {sector} company headquartered in {city} .",
    "the board approved the plan at its meeting on {month} {day} .",
    "the buyback will run until the end of {year} .",
    "growth was driven by {driver} .",
]
REPORT_RATINGS = [
    "we rate {company} buy with a price target of {price} {currency} .",
    "we rate {company} hold with a price target of {price} {currency} .",
    "we rate {company} sell with a price target of {price} {currency} .",
    "{broker} starts coverage of {company} at buy with a price target of {price} {currency} .",
    "{broker} starts coverage of {company} at hold with a price target of {price} {currency} .",
]
REPORT_SENTENCES = [
    "we raise our {year} earnings estimate for {company} to {cents} cents per share .",
    "we lower our {year} earnings estimate for {company} to {cents} cents per share .",
    "our analysts see upside for {company} from {driver} .",
    "the main risks to our view are {headwind} and {headwind2} .",
    "{company} trades at {multiple} times earnings against {multiple2} for the {sector} sector .",
    "we expect margins at {company} to reach {pct} percent by {year} .",
    "{broker} analysts expect {sector} earnings to grow {pct} percent in {year} .",
    "our target values {company} at {multiple} times next year earnings .",
]
DIALOGUE_EXCHANGES = [
    "customer : what is the balance of my {product} ? agent : your balance is {amount} {currency} .",
    "customer : i want to transfer {amount} {currency} to my {product} . agent : the transfer will arrive "
    "in {days} days .",
    "customer : my card was declined in {city} . agent : i have removed the block , please try again .",
    "customer : what is the interest rate on the {product} ? agent : it is {rate} percent a year .",
    "customer : i want to buy {shares} shares of {company} . agent : the order is placed at {price} "
    "{currency} a share .",
    "customer : why was my order for {ticker} not filled ? agent : the limit price was below the market .",
    "customer : how do i open a {product} ? agent : you can apply online in about {days} minutes .",
    "customer : what is the fee for trading in {city} ? agent : each trade costs {cents} {currency} .",
    "customer : can i change the date of my mortgage payment ? agent : yes , it will move to {month} {day} .",
    "customer : when will {company} pay its dividend ? agent : the payment date is {month} {day} .",
]
DIALOGUE_CLOSING = "customer : thank you for your help . agent : you are welcome , have a nice day ."


def _values(rng: random.Random, company: str | None = None) -> dict[str, object]:
    """Values for every slot of the templates; `company` (default: drawn) and a second one."""
    company = company or rng.choice(NAMES)
    company2 = rng.choice([c for c in NAMES if c != company])
    return {
        "company": company, "company2": company2, "ticker": COMPANIES[company][0],
        "sector": COMPANIES[company][1], "broker": rng.choice(BROKERS), "agency": rng.choice(AGENCIES),
        "grade": rng.choice(GRADES), "currency": rng.choice(CURRENCIES),
        "currency2": rng.choice(FOREIGN_CURRENCIES), "city": rng.choice(CITIES),
        "month": rng.choice(MONTHS), "day": rng.randint(1, 28), "quarter": rng.choice(QUARTERS),
        "year": rng.randint(2018, 2027), "region": rng.choice(REGIONS), "index": rng.choice(INDICES),
        "commodity": rng.choice(COMMODITIES), "product": rng.choice(PRODUCTS), "card": rng.choice(CARDS),
        "driver": rng.choice(DRIVERS), "headwind": rng.choice(HEADWINDS),
        "headwind2": rng.choice(HEADWINDS), "pct": rng.randint(1, 30), "pct2": rng.randint(1, 30),
        "cents": rng.randint(5, 95), "price": rng.randint(5, 900), "millions": rng.randint(10, 990),
        "millions2": rng.randint(10, 990), "thousands": rng.randint(1, 90),
        "points": rng.randint(1000, 9000), "rate": rng.randint(1, 9), "multiple": rng.randint(6, 40),
        "multiple2": rng.randint(6, 40), "amount": rng.randint(10, 5000), "days": rng.randint(1, 10),
        "shares": rng.randint(1, 500),
    }


def _ordinary(genre: str) -> list[str]:
    """A genre's ordinary sentences (or dialogue exchanges): no risk cue in any of them."""
    if genre == "news":
        return NEWS_SENTENCES + POSITIVE_SENTENCES + NEGATIVE_SENTENCES + NEUTRAL_SENTENCES
    if genre == "announcement":
        return ANNOUNCEMENT_HEADLINES + ANNOUNCEMENT_DETAILS
    if genre == "report":
        return REPORT_RATINGS + REPORT_SENTENCES + NEUTRAL_SENTENCES[1:4]
    return DIALOGUE_EXCHANGES


def genre_document(seed: int, index: int, mix: dict[str, float]) -> tuple[str, str]:
    """(genre, text) of document `index`: its genre drawn by the `mix` weights (keys among
    FINANCE_GENRES), then 2-5 news sentences, an announcement (a headline and 1-3 details), a
    report (a rating and 1-3 more sentences) or a dialogue (1-3 exchanges); one document in ten
    holds besides a risk event or a near miss of its genre (RISK_SENTENCES, NEAR_MISSES)."""
    rng = random.Random(seed * 1_000_003 + index + 5_151_515)
    genre = rng.choices(FINANCE_GENRES, weights=[mix.get(g, 0.0) for g in FINANCE_GENRES])[0]
    if genre == "news":
        templates = [rng.choice(NEWS_SENTENCES if rng.random() < 0.5 else _ordinary("news"))
                     for _ in range(rng.randint(2, 5))]
    elif genre == "announcement":
        templates = [rng.choice(ANNOUNCEMENT_HEADLINES)]
        templates += rng.sample(ANNOUNCEMENT_DETAILS, rng.randint(1, 3))
    elif genre == "report":
        templates = [rng.choice(REPORT_RATINGS)] + rng.sample(REPORT_SENTENCES, rng.randint(1, 3))
    else:
        templates = rng.sample(DIALOGUE_EXCHANGES, rng.randint(1, 3))
        if rng.random() < 0.3:
            templates.append(DIALOGUE_CLOSING)
    if rng.random() < 0.1:  # now and then a risk event or a near miss
        event = rng.choice(list(RISK_SENTENCES))
        extra = rng.choice(RISK_SENTENCES[event][genre] + NEAR_MISSES[genre])
        templates.insert(rng.randint(0, len(templates)), extra)
    company = rng.choice(NAMES)  # one company throughout (and others where a template names two)
    return genre, " ".join(t.format(**_values(rng, company)) for t in templates)


def finance_document(seed: int, index: int, mix: dict[str, float]) -> str:
    """Document `index` of the corpus with `seed`: a genre drawn by the `mix` weights (see
    `genre_document`)."""
    return genre_document(seed, index, mix)[1]


# -- labelled variants -------------------------------------------------------------------------------


def has_cue(text: str, phrase: str) -> bool:
    """Whether `phrase` occurs in `text` as whole (space-separated) words."""
    return f" {phrase} " in f" {text} "


def _assemble(rng: random.Random, key: str, pool: list[str], n_extra: int) -> str:
    """`key` and up to `n_extra` sentences from `pool` in a random order, about one company
    (fresh values for every other slot); extras only while within LABELLED_MAX_WORDS."""
    company = rng.choice(NAMES)
    sentences = [key.format(**_values(rng, company))]
    words = len(sentences[0].split())
    for _ in range(n_extra):
        extra = rng.choice(pool).format(**_values(rng, company))
        if words + len(extra.split()) > LABELLED_MAX_WORDS:
            continue
        words += len(extra.split())
        sentences.append(extra)
    rng.shuffle(sentences)
    return " ".join(sentences)


def labelled_sentiment(seed: int, index: int) -> tuple[str, str]:
    """Document `index` and its sentiment ("negative", "neutral" or "positive", balanced): a
    positive or negative one holds one sentence of its polarity (a POSITIVE_CUES /
    NEGATIVE_CUES phrase) and 0-2 neutral sentences; a neutral one 1-3 neutral sentences."""
    rng = random.Random(seed * 1_000_003 + index + 6_262_626)
    label = rng.choice(FINANCE_SENTIMENTS)
    key = rng.choice({"negative": NEGATIVE_SENTENCES, "neutral": NEUTRAL_SENTENCES,
                      "positive": POSITIVE_SENTENCES}[label])
    return _assemble(rng, key, NEUTRAL_SENTENCES, rng.randint(0, 2)), label


def labelled_risk(seed: int, index: int) -> tuple[str, str]:
    """Document `index` and its risk event (RISK_EVENTS, balanced): a genre drawn equally, then
    the event's cue sentence (or exchange) in that genre's style, or for "none" an ordinary
    one, with 0-2 more ordinary sentences or near misses (NEAR_MISSES) of the genre."""
    rng = random.Random(seed * 1_000_003 + index + 7_373_737)
    label = rng.choice(RISK_EVENTS)
    genre = rng.choice(FINANCE_GENRES)
    pool = _ordinary(genre) + NEAR_MISSES[genre]
    key = rng.choice(pool if label == "none" else RISK_SENTENCES[label][genre])
    return _assemble(rng, key, pool, rng.randint(0, 2)), label


def sentiment_by_rule(text: str) -> str:
    """The sentiment the cue phrases give (what `labelled_sentiment` labels)."""
    if any(has_cue(text, p) for p in POSITIVE_CUES):
        return "positive"
    if any(has_cue(text, p) for p in NEGATIVE_CUES):
        return "negative"
    return "neutral"


def risk_by_rule(text: str) -> str:
    """The risk event the cue phrases give (what `labelled_risk` labels); "ambiguous" for a text
    holding cues of several events (never generated)."""
    found = [event for event, phrases in RISK_CUES.items() if any(has_cue(text, p) for p in phrases)]
    return found[0] if len(found) == 1 else "none" if not found else "ambiguous"
