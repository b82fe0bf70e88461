"""A deterministic synthetic e-commerce corpus: product titles, customer reviews, search queries.

The same (seed, document index) always yields the same text, so a corpus of any size can be
generated shard by shard, in parallel, without keeping it in memory.
"""

from __future__ import annotations

import random

BRANDS = """acme northwind contoso fabrikam litware tailspin wingtip adatum proseware lucerne
fourth-coffee humongous margie alpine blue-yonder coho graphic-design wide-world trey
vanarsdel""".split()
COLORS = "black white red blue green grey silver gold navy beige pink teal olive".split()
MATERIALS = "cotton leather steel bamboo wool ceramic glass oak linen nylon silicone".split()
ADJECTIVES = """lightweight waterproof wireless portable ergonomic premium compact durable
rechargeable organic stainless foldable adjustable vintage slim heavy-duty""".split()
PRODUCTS = {
    "electronics": "headphones speaker charger keyboard mouse monitor webcam router tablet "
    "smartwatch earbuds cable",
    "home": "lamp blanket pillow kettle blender mug pan knife-set rug curtain vase towel",
    "fashion": "jacket sneakers backpack wallet scarf belt hoodie dress boots sunglasses hat",
    "sports": "yoga-mat dumbbell bottle tent bicycle-helmet racket jersey gloves treadmill",
    "toys": "puzzle robot blocks doll board-game kite drone plush train-set",
}
SIZES = "xs s m l xl 250ml 500ml 1l 2-pack 3-pack 10-inch 15-inch 27-inch".split()
GOOD = """great excellent sturdy comfortable fast reliable beautiful perfect quiet bright
solid handy""".split()
BAD = "flimsy noisy slow cheap broken loose dull disappointing scratched faulty".split()
REVIEW_TEMPLATES = [
    "i bought this {product} for my {who} and it is {good} . the {material} feels {good} .",
    "the {color} {product} arrived {when} . {verdict} , would {rec} buy again .",
    "after {n} weeks the {product} is still {good} but the battery is {bad} .",
    "{verdict} . the {brand} {product} looks {good} but the packaging was {bad} .",
    "returned it . the {product} was {bad} and customer service was {bad} .",
    "five stars , the {adjective} {product} is {good} and shipping was {good} .",
    "not as described : it is {bad} , the {color} looks different and the size {size} is off .",
]
WHO = "son daughter wife husband office kitchen dog garden dorm gym".split()
WHEN = "early on-time late damaged yesterday".split()
QUERY_TEMPLATES = [
    "{adjective} {product}",
    "{brand} {product} {color}",
    "cheap {product} under {n}0 dollars",
    "best {product} for {who}",
    "{product} {size} {material}",
    "{color} {material} {product} sale",
]

KINDS = ("title", "review", "query")


def _fill(rng: random.Random, template: str) -> str:
    category = rng.choice(list(PRODUCTS))
    good = rng.random() < 0.7
    values = {
        "brand": rng.choice(BRANDS),
        "color": rng.choice(COLORS),
        "material": rng.choice(MATERIALS),
        "adjective": rng.choice(ADJECTIVES),
        "product": rng.choice(PRODUCTS[category].split()),
        "size": rng.choice(SIZES),
        "good": rng.choice(GOOD),
        "bad": rng.choice(BAD),
        "who": rng.choice(WHO),
        "when": rng.choice(WHEN),
        "n": rng.randint(1, 9),
        "verdict": rng.choice(["love it", "highly recommend"] if good else ["meh", "avoid"]),
        "rec": "definitely" if good else "never",
    }
    return template.format(**values)


def document(seed: int, index: int, mix: dict[str, float]) -> str:
    """Document `index` of the corpus with `seed`: a title, a review or a query."""
    rng = random.Random(seed * 1_000_003 + index)
    kind = rng.choices(KINDS, weights=[mix.get(k, 0.0) for k in KINDS])[0]
    if kind == "title":
        parts = [rng.choice(BRANDS), rng.choice(ADJECTIVES), rng.choice(COLORS),
                 rng.choice(MATERIALS), _fill(rng, "{product}"), rng.choice(SIZES)]
        return " ".join(parts)
    if kind == "review":
        return " ".join(_fill(rng, rng.choice(REVIEW_TEMPLATES)) for _ in range(rng.randint(1, 3)))
    return _fill(rng, rng.choice(QUERY_TEMPLATES))



# -- labelled variants (classification datasets for tests and demos) -------------------------------

SENTIMENTS = ("negative", "positive")
"""Labels of `labelled_review`, sorted (label id = position)."""
POSITIVE_TEMPLATES = [
    "i bought this {product} for my {who} and it is {good} .",
    "the {material} feels {good} and the {color} looks {good} .",
    "{pverdict} , the {brand} {product} is {good} .",
    "five stars , the {adjective} {product} is {good} and shipping was {good} .",
    "after {n} weeks the {product} is still {good} .",
    "would definitely buy again .",
]
NEGATIVE_TEMPLATES = [
    "returned it . the {product} was {bad} and customer service was {bad} .",
    "not as described : it is {bad} , the {color} looks different and the size {size} is off .",
    "{nverdict} , the {brand} {product} is {bad} .",
    "one star , the {adjective} {product} is {bad} and shipping was {bad} .",
    "after {n} weeks the {product} is already {bad} .",
    "would never buy again .",
]
NEUTRAL_TEMPLATES = [
    "the {color} {product} arrived {when} .",
    "i use the {product} in the {who} .",
    "the {product} looks {good} but the packaging was {bad} .",
    "it is a {material} {product} , size {size} .",
]


def _values(rng: random.Random) -> dict[str, object]:
    category = rng.choice(list(PRODUCTS))
    return {
        "brand": rng.choice(BRANDS), "color": rng.choice(COLORS), "material": rng.choice(MATERIALS),
        "adjective": rng.choice(ADJECTIVES), "product": rng.choice(PRODUCTS[category].split()),
        "size": rng.choice(SIZES), "good": rng.choice(GOOD), "bad": rng.choice(BAD),
        "who": rng.choice(WHO), "when": rng.choice(WHEN), "n": rng.randint(1, 9),
        "pverdict": rng.choice(["love it", "highly recommend", "great buy"]),
        "nverdict": rng.choice(["meh", "avoid", "waste of money"]),
    }


def labelled_review(seed: int, index: int) -> tuple[str, str]:
    """Review `index` and its sentiment ("negative" or "positive", balanced): the verdict the
    review was generated from. Every review has at least one sentence of its sentiment; the
    others are of its sentiment (3 in 4) or neutral, so the label is learnable from the words."""
    rng = random.Random(seed * 1_000_003 + index + 7_777_777)
    label = rng.choice(SENTIMENTS)
    polar = POSITIVE_TEMPLATES if label == "positive" else NEGATIVE_TEMPLATES
    sentences = [rng.choice(polar)]
    for _ in range(rng.randint(0, 2)):
        sentences.append(rng.choice(polar if rng.random() < 0.75 else NEUTRAL_TEMPLATES))
    rng.shuffle(sentences)
    return " ".join(s.format(**_values(rng)) for s in sentences), label


TAGS = ("BRAND", "COLOR", "O", "PRODUCT")
"""Word tags of `tagged_document`, sorted (tag id = position)."""
_SLOT_TAGS = {"{brand}": "BRAND", "{color}": "COLOR", "{product}": "PRODUCT"}
TITLE_TEMPLATE = "{brand} {adjective} {color} {material} {product} {size}"


def tagged_document(seed: int, index: int, mix: dict[str, float]) -> tuple[list[str], list[str]]:
    """Document `index` as whitespace words and one tag per word: BRAND, COLOR or PRODUCT for
    the words drawn from those lists, O for every other word. Kinds (title, review, query) as
    in `document`."""
    rng = random.Random(seed * 1_000_003 + index + 3_333_333)
    kind = rng.choices(KINDS, weights=[mix.get(k, 0.0) for k in KINDS])[0]
    if kind == "title":
        templates = [TITLE_TEMPLATE]
    elif kind == "review":
        templates = [rng.choice(REVIEW_TEMPLATES) for _ in range(rng.randint(1, 2))]
    else:
        templates = [rng.choice(QUERY_TEMPLATES)]
    words: list[str] = []
    tags: list[str] = []
    for template in templates:
        values = _values(rng)
        values["verdict"] = values["pverdict"] if rng.random() < 0.7 else values["nverdict"]
        values["rec"] = rng.choice(["definitely", "never"])
        for slot in template.split(" "):
            word = slot.format(**values)
            for part in word.split():  # a verdict of two words is two words tagged O
                words.append(part)
                tags.append(_SLOT_TAGS.get(slot, "O"))
    return words, tags
