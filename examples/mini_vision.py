"""Synthetic pictures with questions and answers for the vision phase of kimi-k3-mini, drawn with PIL on the fly.

A scene is a background (plain, a two-colour gradient or speckled) of a random non-square size and 1-4 objects in
distinct cells of a 3x3 grid: shapes (circle, square, triangle, star, diamond, hexagon) or one digit or capital
letter, each in a named colour that stands out from the background. `scene_qa` asks one question about it ("What is
in this picture?", "What colour is the circle?", "How many squares are there?", "Where is the star?", "What digit is
shown?", ...) and answers in one sentence. Item i of `SceneQA` is drawn from a generator seeded with (seed, i), so
every item is the same whatever order, process or resume reads it in.
"""

import math
import random

from PIL import Image, ImageDraw, ImageFont

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 70, 220), "yellow": (240, 210, 20),
           "orange": (245, 140, 20), "purple": (130, 50, 170), "pink": (240, 120, 180), "brown": (120, 75, 35),
           "black": (15, 15, 15), "white": (250, 250, 250), "grey": (128, 128, 128)}
BACKGROUNDS = {"white": (250, 250, 250), "black": (15, 15, 15), "grey": (128, 128, 128), "beige": (235, 225, 200),
               "light blue": (190, 215, 245), "dark blue": (20, 30, 80), "light green": (200, 240, 200)}
SHAPES = ("circle", "square", "triangle", "star", "diamond", "hexagon")
PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles", "star": "stars", "diamond": "diamonds",
          "hexagon": "hexagons"}
CELLS = {(0, 0): "top left", (1, 0): "top", (2, 0): "top right", (0, 1): "left", (1, 1): "centre", (2, 1): "right",
         (0, 2): "bottom left", (1, 2): "bottom", (2, 2): "bottom right"}
NUMBERS = ("no", "one", "two", "three", "four", "five")
DIGITS = "0123456789"
LETTERS = "ABCDEFGHJKLMNPRSTUVWXYZ"


def _far_enough(a, b):
    return sum((x - y) ** 2 for x, y in zip(a, b)) > 90 ** 2


def _polygon(kind, cx, cy, r):
    if kind == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if kind == "triangle":
        return [(cx, cy - r), (cx + r * 0.95, cy + r * 0.8), (cx - r * 0.95, cy + r * 0.8)]
    if kind == "diamond":
        return [(cx, cy - r), (cx + r * 0.75, cy), (cx, cy + r), (cx - r * 0.75, cy)]
    if kind == "hexagon":
        return [(cx + r * math.cos(math.pi / 3 * k), cy + r * math.sin(math.pi / 3 * k)) for k in range(6)]
    if kind == "star":
        return [(cx + (r if k % 2 == 0 else r * 0.45) * math.sin(math.pi / 5 * k),
                 cy - (r if k % 2 == 0 else r * 0.45) * math.cos(math.pi / 5 * k)) for k in range(10)]
    raise ValueError(kind)


def _background(rng, width, height, name):
    base = BACKGROUNDS[name]
    style = rng.choice(("plain", "plain", "gradient", "speckled"))
    img = Image.new("RGB", (width, height), base)
    draw = ImageDraw.Draw(img)
    if style == "gradient":
        other = tuple(max(0, min(255, c + rng.randint(-40, 40))) for c in base)
        for y in range(height):
            t = y / max(1, height - 1)
            draw.line([(0, y), (width, y)], fill=tuple(round(a + (b - a) * t) for a, b in zip(base, other)))
    elif style == "speckled":
        for _ in range(width * height // 60):
            x, y = rng.randrange(width), rng.randrange(height)
            draw.point((x, y), fill=tuple(max(0, min(255, c + rng.randint(-50, 50))) for c in base))
    return img


def draw_scene(rng):
    """(PIL image, scene) with scene = {"background", "objects": [{"kind", "colour", "cell", "glyph"?}]}."""
    width, height = rng.randrange(112, 337, 4), rng.randrange(112, 337, 4)
    bg_name = rng.choice(list(BACKGROUNDS))
    img = _background(rng, width, height, bg_name)
    draw = ImageDraw.Draw(img)
    colours = [c for c, rgb in COLOURS.items() if _far_enough(rgb, BACKGROUNDS[bg_name])]
    cells = rng.sample(list(CELLS), rng.choice((1, 1, 2, 2, 3, 4)))
    glyph_at = rng.randrange(len(cells)) if rng.random() < 0.25 else None
    objects = []
    for i, (cx, cy) in enumerate(cells):
        colour = rng.choice(colours)
        r = min(width, height) / 6 * rng.uniform(0.55, 0.9)
        x = (cx + 0.5) * width / 3 + rng.uniform(-0.1, 0.1) * width / 3
        y = (cy + 0.5) * height / 3 + rng.uniform(-0.1, 0.1) * height / 3
        if i == glyph_at:
            kind, glyph = rng.choice((("digit", rng.choice(DIGITS)), ("letter", rng.choice(LETTERS))))
            font = ImageFont.load_default(size=max(12, int(r * 2)))
            draw.text((x, y), glyph, fill=COLOURS[colour], font=font, anchor="mm")
            objects.append({"kind": kind, "glyph": glyph, "colour": colour, "cell": CELLS[(cx, cy)]})
            continue
        kind = rng.choice(SHAPES)
        if kind == "circle":
            draw.ellipse([x - r, y - r, x + r, y + r], fill=COLOURS[colour])
        else:
            draw.polygon(_polygon(kind, x, y, r), fill=COLOURS[colour])
        objects.append({"kind": kind, "colour": colour, "cell": CELLS[(cx, cy)]})
    return img, {"background": bg_name, "objects": objects, "size": (width, height)}


def _phrase(obj):
    if obj["kind"] in ("digit", "letter"):
        return f"a {obj['colour']} {obj['kind']} {obj['glyph']}"
    return f"{'an' if obj['colour'][0] in 'aeiou' else 'a'} {obj['colour']} {obj['kind']}"


def caption(scene):
    groups = {}
    for obj in scene["objects"]:
        key = (obj["colour"], obj["kind"], obj.get("glyph"))
        groups.setdefault(key, []).append(obj)
    parts = []
    for (colour, kind, glyph), objs in groups.items():
        if len(objs) == 1 or glyph is not None:
            parts += [_phrase(o) for o in objs]
        else:
            parts.append(f"{NUMBERS[len(objs)]} {colour} {PLURAL[kind]}")
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    text = f"{listed} on a {scene['background']} background."
    return text[0].upper() + text[1:]


def _count_sentence(n, kind):
    return f"There is one {kind}." if n == 1 else f"There are {NUMBERS[n]} {PLURAL[kind]}."


def scene_qa(scene, rng):
    """One (question, answer) pair about the scene."""
    objs = scene["objects"]
    shapes = [o for o in objs if o["kind"] in SHAPES]
    unique = [o for o in shapes if sum(p["kind"] == o["kind"] for p in shapes) == 1]
    glyphs = [o for o in objs if o["kind"] in ("digit", "letter")]
    options = ["describe", "describe", "count", "count_all", "background"]
    options += ["colour", "where"] if unique else []
    options += ["glyph", "glyph"] if glyphs else []
    kind = rng.choice(options)
    if kind == "describe":
        return rng.choice(("What is in this picture?", "Describe the image.", "What do you see?")), caption(scene)
    if kind == "count":
        shape = rng.choice([o["kind"] for o in shapes] + list(SHAPES)) if shapes else rng.choice(SHAPES)
        return f"How many {PLURAL[shape]} are there?", _count_sentence(sum(o["kind"] == shape for o in shapes), shape)
    if kind == "count_all":
        n = len(objs)
        return "How many objects are in the picture?", ("There is one object." if n == 1 else
                                                        f"There are {NUMBERS[n]} objects.")
    if kind == "background":
        return "What colour is the background?", f"The background is {scene['background']}."
    if kind == "colour":
        o = rng.choice(unique)
        return f"What colour is the {o['kind']}?", f"The {o['kind']} is {o['colour']}."
    if kind == "where":
        o = rng.choice(unique)
        place = "in the centre" if o["cell"] == "centre" else f"at the {o['cell']}"
        return f"Where is the {o['kind']}?", f"The {o['kind']} is {place}."
    o = rng.choice(glyphs)
    question = "What digit is shown?" if o["kind"] == "digit" else "What letter is in the picture?"
    return question, f"The {o['kind']} {o['glyph']}."


def item_rng(seed, index, salt=0):
    return random.Random(seed * 1_000_003 + index * 7919 + salt)


def scene_example(seed, index):
    """(image, question, answer) of item `index`."""
    rng = item_rng(seed, index)
    image, scene = draw_scene(rng)
    question, answer = scene_qa(scene, rng)
    return image, question, answer
