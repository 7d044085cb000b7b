"""The shapes world: its vocabulary, scene description, caption grammar and prompt parser.

One definition of what the world contains, shared by the renderer
(``omniloop.eval.shapes_render``), the procedural training data
(``omniloop.train.data.shapes``) and the adherence evaluator (``omniloop.eval.adherence``).
It lives outside ``train/`` because the evaluator and the CLI need it, and nothing outside
``omniloop.train`` may import ``omniloop.train``.

Coordinates. An object's position is given in *free-region* units: (u, v) in [0, 1]^2 maps
the object's centre onto the part of the frame where the whole object fits
(x = R + u * (W - 2R), y = R + v * (H - 2R), R the object's half-size in pixels), so any
position in [0, 1]^2 keeps the object fully in frame at every resolution and aspect.
v grows downward (image rows), so "up" decreases v.

Held-out split (deterministic, documented in ``is_held_out``): one seventh of the
(color, shape, motion) combinations never appear in training; every single attribute and
every *pair* of attributes still does, so the held-out set measures compositional
generalisation on prompts the model has never seen.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Iterator

import numpy as np

# --------------------------------------------------------------------------------------
# 1. Vocabulary (defined once; every other module reads these tables)
# --------------------------------------------------------------------------------------

RGB = tuple[int, int, int]

# Object colors: saturated, pairwise >= 113 apart in RGB (closest: red/orange, orange/yellow).
COLORS: dict[str, RGB] = {
    "red": (225, 25, 35),
    "orange": (255, 128, 0),
    "yellow": (255, 235, 40),
    "green": (40, 200, 50),
    "cyan": (20, 215, 225),
    "blue": (40, 75, 250),
    "purple": (170, 60, 230),
    "white": (245, 245, 245),
}

# Backgrounds: dark tints and one light gray. Every object color is >= 125 away in RGB from
# every background (closest: purple on light gray; white on light gray differs by 75 per channel).
BACKGROUNDS: dict[str, RGB] = {
    "black": (0, 0, 0),
    "dark gray": (50, 50, 50),
    "light gray": (170, 170, 170),
    "navy": (15, 25, 70),
    "dark green": (20, 60, 30),
    "brown": (70, 40, 20),
}

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")

LINEAR_MOTIONS: dict[str, tuple[int, int]] = {"right": (1, 0), "left": (-1, 0), "up": (0, -1), "down": (0, 1)}
MOTIONS: tuple[str, ...] = (*LINEAR_MOTIONS, "static", "bouncing", "circling")

# Object size: the side of its bounding square, as a fraction of min(height, width).
SIZES: dict[str, float] = {"small": 0.20, "medium": 0.26, "large": 0.32}

# The attributes a prompt can ask for, per object, that the evaluator scores.
OBJECT_ATTRIBUTES: tuple[str, ...] = ("color", "shape", "motion")

MAX_OBJECTS = 2


def _check(value: str, vocab, what: str) -> None:
    if value not in vocab:
        raise ValueError(f"unknown {what} {value!r}; pass one of {list(vocab)}")


# --------------------------------------------------------------------------------------
# 2. Scene description
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ObjectSpec:
    """One object and its trajectory. Positions are free-region units (module docstring).

    ``center`` is where the object is at mid-clip (for ``circling``: the circle's centre).
    ``travel`` is the path length in free-region spans over the whole clip (linear motions
    and ``bouncing``, which reflects off the walls); ``turns``/``radius``/``phase`` describe
    ``circling`` (``radius`` in units of the shorter free span, so the path is a circle in
    pixels at any aspect); ``axis``/``sign`` the bouncing axis and initial direction
    (``sign`` is also the circling orientation).
    """

    color: str
    shape: str
    motion: str = "static"
    size: str = "medium"
    scale: float = 1.0  # size jitter, multiplies SIZES[size]
    center: tuple[float, float] = (0.5, 0.5)
    travel: float = 0.6
    axis: str = "x"
    sign: int = 1
    radius: float = 0.3
    turns: float = 0.9
    phase: float = 0.0

    def __post_init__(self) -> None:
        _check(self.color, COLORS, "color")
        _check(self.shape, SHAPES, "shape")
        _check(self.motion, MOTIONS, "motion")
        _check(self.size, SIZES, "size")
        _check(self.axis, ("x", "y"), "bouncing axis")
        if not 0.5 <= self.scale <= 1.5:
            raise ValueError(f"scale={self.scale} must be in [0.5, 1.5]")
        if self.sign not in (-1, 1):
            raise ValueError(f"sign={self.sign} must be 1 or -1")
        if min(self.travel, self.radius, self.turns) < 0:
            raise ValueError(f"travel, radius and turns must be >= 0, got {self.travel}, {self.radius}, {self.turns}")
        lo, hi = self._extent()
        if not (np.all(lo >= -1e-9) and np.all(hi <= 1 + 1e-9)):
            raise ValueError(
                f"{self.motion} object at center={self.center} leaves the frame "
                f"(path spans {lo.round(3).tolist()}..{hi.round(3).tolist()}); move center or shorten travel/radius"
            )

    @property
    def diameter(self) -> float:
        """Bounding-square side as a fraction of min(height, width)."""
        return SIZES[self.size] * self.scale

    def _extent(self) -> tuple[np.ndarray, np.ndarray]:
        c = np.asarray(self.center, dtype=np.float64)
        if self.motion in LINEAR_MOTIONS:
            half = 0.5 * self.travel * np.abs(np.asarray(LINEAR_MOTIONS[self.motion], dtype=np.float64))
            return c - half, c + half
        if self.motion == "circling":
            return c - self.radius, c + self.radius
        return c, c  # static; bouncing reflects, so only the center must be inside

    def path(self, num_frames: int) -> np.ndarray:
        """Free-region centre per frame: [F, 2] (u, v). A single frame is the mid-clip pose."""
        t = np.linspace(-0.5, 0.5, num_frames) if num_frames > 1 else np.zeros(1)
        c = np.asarray(self.center, dtype=np.float64)
        if self.motion in LINEAR_MOTIONS:
            return c + np.outer(t * self.travel, LINEAR_MOTIONS[self.motion])
        if self.motion == "bouncing":
            out = np.repeat(c[None], len(t), axis=0)
            a = 0 if self.axis == "x" else 1
            out[:, a] = _reflect(c[a] + self.sign * self.travel * t)
            return out
        if self.motion == "circling":
            angle = self.phase + self.sign * 2 * math.pi * self.turns * t
            return c + self.radius * np.stack([np.cos(angle), np.sin(angle)], axis=1)
        return np.repeat(c[None], len(t), axis=0)


def _reflect(x: np.ndarray) -> np.ndarray:
    """Fold a coordinate into [0, 1] as a ball reflecting off both walls (triangle wave)."""
    return 1.0 - np.abs(np.mod(x, 2.0) - 1.0)


@dataclass(frozen=True, slots=True)
class Scene:
    """1-2 objects of distinct colors on a uniform background."""

    objects: tuple[ObjectSpec, ...]
    background: str = "black"

    def __post_init__(self) -> None:
        if not 1 <= len(self.objects) <= MAX_OBJECTS:
            raise ValueError(f"a scene holds 1..{MAX_OBJECTS} objects, got {len(self.objects)}")
        _check(self.background, BACKGROUNDS, "background")
        colors = [o.color for o in self.objects]
        if len(set(colors)) != len(colors):
            # NOTE: the evaluator separates objects by color, so a scene never repeats one.
            raise ValueError(f"objects of one scene need distinct colors, got {colors}")


# --------------------------------------------------------------------------------------
# 3. Held-out split
# --------------------------------------------------------------------------------------

_SPLIT_MODULUS, _SPLIT_RESIDUE = 7, 5


def is_held_out(color: str, shape: str, motion: str) -> bool:
    """Whether a (color, shape, motion) combination is reserved for evaluation.

    Rule: ``(ci + 2*si + 3*mi) % 7 == 5`` on the indices into COLORS, SHAPES, MOTIONS.
    For each (color, shape) exactly one of the 7 motions is held out; for each
    (color, motion) at most one shape, for each (shape, motion) at most two colors. So 40
    of the 280 combinations are held out, while every attribute value and every pair of
    values still occurs in training. The residue keeps the demo prompts ("a red circle
    moving right", ...) in training.
    """
    ci, si, mi = list(COLORS).index(color), SHAPES.index(shape), MOTIONS.index(motion)
    return (ci + 2 * si + 3 * mi) % _SPLIT_MODULUS == _SPLIT_RESIDUE


def held_out_combos() -> list[tuple[str, str, str]]:
    return [(c, s, m) for c in COLORS for s in SHAPES for m in MOTIONS if is_held_out(c, s, m)]


def scene_is_held_out(scene: Scene) -> bool:
    """A scene is evaluation-only if any of its objects is a held-out combination."""
    return any(is_held_out(o.color, o.shape, o.motion) for o in scene.objects)


# --------------------------------------------------------------------------------------
# 4. Scene sampling
# --------------------------------------------------------------------------------------


def sample_object(rng: np.random.Generator, color: str, shape: str, motion: str, size: str | None = None) -> ObjectSpec:
    """A random pose and trajectory for the given semantics (stays in frame by construction)."""
    size = size or str(rng.choice(list(SIZES)))
    scale = float(rng.uniform(0.92, 1.08))
    spec = partial(ObjectSpec, color=color, shape=shape, motion=motion, size=size, scale=scale)
    if motion in LINEAR_MOTIONS:
        travel = float(rng.uniform(0.45, 0.8))
        along, across = float(rng.uniform(travel / 2, 1 - travel / 2)), float(rng.uniform(0.0, 1.0))
        center = (along, across) if LINEAR_MOTIONS[motion][0] else (across, along)
        return spec(center=center, travel=travel)
    if motion == "bouncing":
        # travel >= 1.3 spans: at least one wall reflection with both legs >= 0.3 span
        return spec(center=tuple(rng.uniform(0.0, 1.0, 2).tolist()),
                          travel=float(rng.uniform(1.3, 1.7)), axis=str(rng.choice(["x", "y"])),
                          sign=int(rng.choice([-1, 1])))
    if motion == "circling":
        radius = float(rng.uniform(0.28, 0.4))
        return spec(center=tuple(rng.uniform(radius, 1 - radius, 2).tolist()), radius=radius,
                          turns=float(rng.uniform(0.8, 1.0)), phase=float(rng.uniform(0, 2 * math.pi)),
                          sign=int(rng.choice([-1, 1])))
    return spec(center=tuple(rng.uniform(0.05, 0.95, 2).tolist()))


def objects_overlap(a: ObjectSpec, b: ObjectSpec, samples: int = 33) -> bool:
    """Whether the bounding squares of two objects touch at any time (checked on a square frame)."""
    pa, pb = a.path(samples), b.path(samples)
    da, db = a.diameter, b.diameter
    xa, xb = da / 2 + pa * (1 - da), db / 2 + pb * (1 - db)  # [T, 2] frame fractions
    gap = np.abs(xa - xb) - (da + db) / 2
    return bool(np.any(np.all(gap < 0.02, axis=1)))


@lru_cache(maxsize=16)
def _combo_pools(motions: tuple[str, ...]) -> tuple[list, list, list]:
    """(all, train, held-out) (color, shape, motion) combinations with the given motions."""
    combos = [(c, s, m) for c in COLORS for s in SHAPES for m in motions]
    return combos, [k for k in combos if not is_held_out(*k)], [k for k in combos if is_held_out(*k)]


def sample_scene(
    rng: np.random.Generator,
    *,
    split: str = "train",
    two_object_prob: float = 0.3,
    motions: tuple[str, ...] = MOTIONS,
) -> Scene:
    """A random scene of the given split ('train', 'held_out' or 'any').

    'train' scenes contain no held-out combination; 'held_out' scenes contain at least one
    (their first object). Two objects never overlap and have distinct colors.
    """
    _check(split, ("train", "held_out", "any"), "split")
    combos, train, held = _combo_pools(tuple(motions))
    first_pool = {"train": train, "held_out": held, "any": combos}[split]
    other_pool = train if split == "train" else combos
    if not first_pool:
        raise ValueError(f"no {split} combination uses motions {motions}")
    background = str(rng.choice(list(BACKGROUNDS)))
    first = sample_object(rng, *first_pool[rng.integers(len(first_pool))])
    if rng.random() < two_object_prob:
        for _ in range(50):
            c, s, m = other_pool[rng.integers(len(other_pool))]
            if c == first.color:
                continue
            second = sample_object(rng, c, s, m)
            if not objects_overlap(first, second):
                return Scene((first, second), background)
    return Scene((first,), background)


# --------------------------------------------------------------------------------------
# 5. Caption grammar
# --------------------------------------------------------------------------------------

# Motion paraphrases: participle phrases ("a red circle moving right") and finite verb
# phrases ("a red circle slides to the right"). Every one must parse back (tested).
MOTION_PHRASES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "right": (
        ("moving right", "moving to the right", "sliding to the right", "drifting right", "moving rightward",
         "traveling right", "heading right", "gliding from left to right"),
        ("moves right", "slides to the right", "drifts right", "travels rightward", "heads to the right",
         "glides from left to right"),
    ),
    "left": (
        ("moving left", "moving to the left", "sliding to the left", "drifting left", "moving leftward",
         "traveling left", "heading left", "gliding from right to left"),
        ("moves left", "slides to the left", "drifts left", "travels leftward", "heads to the left",
         "glides from right to left"),
    ),
    "up": (
        ("moving up", "moving upward", "rising", "floating up", "drifting upward", "climbing", "going up"),
        ("moves up", "rises", "floats upward", "drifts up", "climbs", "goes up"),
    ),
    "down": (
        ("moving down", "moving downward", "falling", "sinking", "dropping down", "drifting downward", "going down"),
        ("moves down", "falls", "sinks", "drops down", "drifts downward", "goes down"),
    ),
    "static": (
        ("standing still", "staying still", "not moving", "sitting still", "resting in place", "holding still"),
        ("stays still", "does not move", "sits still", "stays in place", "rests motionless"),
    ),
    "bouncing": (
        ("bouncing", "bouncing back and forth", "bouncing off the walls", "bouncing between the walls",
         "ricocheting off the edges"),
        ("bounces", "bounces back and forth", "bounces off the walls", "ricochets between the edges"),
    ),
    "circling": (
        ("moving in a circle", "circling", "going around in a circle", "orbiting", "moving in circles",
         "circling around"),
        ("moves in a circle", "circles around", "goes around in a circle", "orbits", "travels in a circle"),
    ),
}
# Axis-specific bouncing paraphrases (the parser must not read "up"/"left" in them as a direction).
BOUNCE_AXIS_PHRASES = {"x": ("bouncing side to side", "bounces left and right"),
                       "y": ("bouncing up and down", "bounces up and down")}

SIZE_WORDS = {"small": ("small", "little", "tiny"), "medium": ("medium-sized", "medium"), "large": ("large", "big")}
COLOR_WORDS_IN_CAPTIONS = {"purple": ("purple", "violet", "magenta"), "cyan": ("cyan", "turquoise", "aqua"),
                           "yellow": ("yellow", "golden")}
SHAPE_WORDS_IN_CAPTIONS = {"circle": ("circle", "disc"), "cross": ("cross", "plus sign"), "star": ("star",),
                           "square": ("square",), "triangle": ("triangle",)}
_DARK_BACKGROUNDS = ("black", "dark gray", "navy", "dark green", "brown")

# Templates. Fields: {np} "a small red circle", {bare} "small red circle", {the} "the red
# circle", {part}/{fin} the motion phrases, {bg} "a navy background".
SINGLE_TEMPLATES: tuple[str, ...] = (
    "{np} {part}",
    "{np} {fin}",
    "{bare}, {part}",
    "{np} {part} on {bg}",
    "{the} is {part}",
    "a video of {np} {part}",
    "{np} that {fin}",
    "{np} {part} against {bg}",
)
PAIR_TEMPLATES: tuple[str, ...] = (
    "{np1} {part1} and {np2} {part2}",
    "{np1} {fin1} while {np2} {fin2}",
    "two shapes: {np1} {part1} and {np2} {part2}",
    "{np1} {part1} and {np2} {part2} on {bg}",
    "{bare1} {part1}, {bare2} {part2}",
)
IMAGE_TEMPLATES: tuple[str, ...] = ("{np}", "{np} on {bg}", "a picture of {np}", "{bare}")
IMAGE_PAIR_TEMPLATES: tuple[str, ...] = ("{np1} and {np2}", "{np1} and {np2} on {bg}", "a picture of {np1} and {np2}")


@dataclass(frozen=True, slots=True)
class _Wording:
    """Which paraphrase to use for each slot (index modulo the slot's options)."""

    phrase: int = 0
    size: bool = False
    synonym: int = 0
    exact_background: bool = True


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _noun_phrase(obj: ObjectSpec, w: _Wording) -> str:
    colors = COLOR_WORDS_IN_CAPTIONS.get(obj.color, (obj.color,))
    shapes = SHAPE_WORDS_IN_CAPTIONS[obj.shape]
    words = [colors[w.synonym % len(colors)], shapes[w.synonym % len(shapes)]]
    if w.size:
        sizes = SIZE_WORDS[obj.size]
        words.insert(0, sizes[w.phrase % len(sizes)])
    return " ".join(words)


def _motion_phrase(obj: ObjectSpec, finite: bool, w: _Wording) -> str:
    options = MOTION_PHRASES[obj.motion][int(finite)]
    if obj.motion == "bouncing":
        options = options + (BOUNCE_AXIS_PHRASES[obj.axis][int(finite)],)
    return options[w.phrase % len(options)]


def _background_phrase(background: str, w: _Wording) -> str:
    if w.exact_background:
        name = background
    else:
        name = "dark" if background in _DARK_BACKGROUNDS else "light"
    return f"{_article(name)} {name} background"


def _fields(obj: ObjectSpec, w: _Wording, suffix: str = "") -> dict[str, str]:
    bare = _noun_phrase(obj, w)
    return {f"np{suffix}": f"{_article(bare)} {bare}", f"bare{suffix}": bare, f"the{suffix}": f"the {bare}",
            f"part{suffix}": _motion_phrase(obj, False, w) if obj.motion else "",
            f"fin{suffix}": _motion_phrase(obj, True, w) if obj.motion else ""}


def render_caption(scene: Scene, template: str, w: _Wording = _Wording(), *, second: _Wording | None = None) -> str:
    """Fill one template for a scene (templates with suffixes 1/2 for two objects)."""
    if len(scene.objects) == 1:
        fields = _fields(scene.objects[0], w)
    else:
        fields = {**_fields(scene.objects[0], w, "1"), **_fields(scene.objects[1], second or w, "2")}
    return template.format(bg=_background_phrase(scene.background, w), **fields)


def _templates_for(scene: Scene, with_motion: bool) -> tuple[str, ...]:
    if len(scene.objects) == 1:
        return SINGLE_TEMPLATES if with_motion else IMAGE_TEMPLATES
    return PAIR_TEMPLATES if with_motion else IMAGE_PAIR_TEMPLATES


def describe(scene: Scene, rng: np.random.Generator, *, with_motion: bool = True) -> str:
    """A random caption of the scene (``with_motion=False`` for single-frame samples)."""
    templates = _templates_for(scene, with_motion)

    def wording() -> _Wording:
        return _Wording(phrase=int(rng.integers(1 << 16)), size=bool(rng.random() < 0.3),
                        synonym=int(rng.integers(1 << 16)) if rng.random() < 0.15 else 0,
                        exact_background=bool(rng.random() < 0.7))

    template = templates[rng.integers(len(templates))]
    return render_caption(scene, template, wording(), second=wording())


def all_captions(scene: Scene, *, with_motion: bool = True) -> Iterator[str]:
    """Every template with every paraphrase, size word, synonym and background wording (for tests)."""
    longest = max(len(p) for pair in MOTION_PHRASES.values() for p in pair) + 1
    for template in _templates_for(scene, with_motion):
        for k in range(longest if with_motion else 3):
            w = _Wording(phrase=k, size=bool(k % 2), synonym=k, exact_background=bool(k % 3))
            yield render_caption(scene, template, w, second=_Wording(phrase=k + 1, size=not k % 2, synonym=k + 1))


# --------------------------------------------------------------------------------------
# 6. Prompt parsing
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParsedObject:
    """What a prompt asks of one object; None where the prompt does not say (or we can't tell)."""

    color: str | None = None
    shape: str | None = None
    motion: str | None = None
    size: str | None = None

    def get(self, attribute: str) -> str | None:
        return getattr(self, attribute)


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    text: str
    # at least one object; a prompt with nothing recognisable gives one all-None object
    objects: tuple[ParsedObject, ...] = field(default_factory=lambda: (ParsedObject(),))
    background: str | None = None

    @property
    def recognized(self) -> bool:
        return self.background is not None or any(
            o.get(a) is not None for o in self.objects for a in OBJECT_ATTRIBUTES
        )


def _alternation(words) -> str:
    return "|".join(sorted(words, key=len, reverse=True))


# Ordered: earlier patterns claim their span first, so "bouncing up and down" is a bounce,
# "moving in a circle" a motion (not a circle), "from left to right" one direction.
_MOTION_PATTERNS: tuple[tuple[str, str], ...] = (
    ("bouncing", r"\bbounc\w*(?: (?:back and forth|up and down|side to side|left and right|to and fro|around"
                 r"|(?:off|between|against) the (?:walls|edges|sides|borders)))?"),
    ("bouncing", r"\bricochet\w*(?: (?:off|between) the (?:walls|edges|sides|borders))?"),
    ("bouncing", r"\b(?:back and forth|to and fro|up and down|side to side|left and right|zig ?zag\w*)\b"),
    ("circling", r"\b(?:around |round )?in (?:a )?circles?\b|\bcircling(?: around)?\b|\bcircles around\b"
                 r"|\borbit\w*|\bround and round\b|\b(?:a )?circular (?:path|motion|orbit|trajectory)\b"),
    ("static", r"\b(?:stand|stay|sit|hold|keep|remain)\w* (?:still|put|in place|motionless)\b|\bnot moving\b"
               r"|\bdoes ?n[o']?t move\b|\bdoes not move\b|\bmotionless\b|\bstationary\b|\bstatic\b|\bstill\b"
               r"|\bat rest\b|\bunmoving\b|\bimmobile\b|\bin place\b|\bfrozen\b|\bresting\b"),
    ("right", r"\bfrom (?:the )?left (?:side |edge )?to (?:the )?right\b|\bleft to right\b"),
    ("left", r"\bfrom (?:the )?right (?:side |edge )?to (?:the )?left\b|\bright to left\b"),
    ("down", r"\bfrom (?:the )?top to (?:the )?bottom\b|\btop to bottom\b"),
    ("up", r"\bfrom (?:the )?bottom to (?:the )?top\b|\bbottom to top\b"),
    ("right", r"\b(?:to(?:wards?)? the |toward the )?right(?:wards?)?\b|\beastwards?\b"),
    ("left", r"\b(?:to(?:wards?)? the |toward the )?left(?:wards?)?\b|\bwestwards?\b"),
    ("up", r"\bup(?:wards?)?\b|\bris(?:e|es|ing)\b|\bascend\w*|\bclimb\w*|\blifts? off\b|\bnorthwards?\b"),
    ("down", r"\bdown(?:wards?)?\b|\bfall(?:s|ing)?\b|\bsink\w*|\bdrop\w*|\bdescend\w*|\bsouthwards?\b"),
)
_SHAPE_PATTERNS: tuple[tuple[str, str], ...] = (
    ("cross", r"\bplus(?: signs?| shapes?)\b|\bcross(?:es)?\b(?! (?:the|over|from|to|paths?)\b)"),
    ("circle", r"\bcircles?\b|\bdis[ck]s?\b|\bballs?\b|\bdots?\b|\bround shapes?\b"),
    ("square", r"\bsquares?\b|\bbox(?:es)?\b|\bblocks?\b|\bcubes?\b"),
    ("triangle", r"\btriangles?\b|\btriangular\b"),
    ("star", r"\b(?:five pointed )?stars?\b|\bpentagrams?\b"),
)
_COLOR_SYNONYMS = {
    "red": ("red", "crimson", "scarlet"), "orange": ("orange", "amber", "tangerine"),
    "yellow": ("yellow", "golden", "gold", "lemon"), "green": ("green", "lime", "emerald"),
    "cyan": ("cyan", "turquoise", "aqua", "teal"), "blue": ("blue", "azure", "cobalt"),
    "purple": ("purple", "violet", "magenta", "lilac", "lavender"), "white": ("white", "ivory", "snow white"),
}
_COLOR_PATTERNS = tuple((c, rf"\b(?:{_alternation(ws)})\b") for c, ws in _COLOR_SYNONYMS.items())
_SIZE_PATTERNS = (("small", r"\b(?:small|little|tiny|mini)\b"), ("medium", r"\bmedium(?: sized)?\b|\bmid sized\b"),
                  ("large", r"\b(?:large|big|huge|giant)\b"))
_BACKGROUND_SYNONYMS = {
    "black": ("black", "pitch black", "jet black"), "dark gray": ("dark gray", "charcoal", "dark grey"),
    "light gray": ("light gray", "gray", "silver", "pale gray"),
    "navy": ("navy", "navy blue", "dark blue", "midnight blue"),
    "dark green": ("dark green", "forest green", "forest"), "brown": ("brown", "dark brown", "chocolate"),
}
_BACKGROUND_NAMES = {syn: bg for bg, syns in _BACKGROUND_SYNONYMS.items() for syn in syns}
_BACKGROUND_NOUNS = {"background", "backgrounds", "backdrop"}
_BACKGROUND_VAGUE = {"plain", "solid", "uniform", "flat", "simple", "empty", "colored", "dark", "light", "bright",
                     "pale"}
_BACKGROUND_LEADS = ({"a", "an", "the"}, {"on", "against", "over", "with", "of"})


def _normalize(text: str) -> str:
    text = text.lower().replace("grey", "gray").replace("colour", "color")
    text = re.sub(r"[^a-z0-9,']+", " ", text).replace(",", " , ")
    return re.sub(r"\s+", " ", text).strip()


def _parse_background(text: str) -> tuple[str | None, str]:
    """(background or None, text with the background phrase removed).

    "on a plain dark green background" -> "dark green"; "on a dark background" -> None
    (vague), and either way the phrase is removed so its words are not read as objects.
    """
    words = text.split(" ")
    nouns = [j for j, w in enumerate(words) if w in _BACKGROUND_NOUNS]
    if not nouns:
        return None, text
    end = nouns[0]
    start, background = end, None
    for length in (3, 2, 1):  # the longest name right before the noun
        name = _BACKGROUND_NAMES.get(" ".join(words[max(0, end - length):end]))
        if end - length >= 0 and name is not None:
            start, background = end - length, name
            break
    while start > 0 and words[start - 1] in _BACKGROUND_VAGUE:
        start -= 1
    for lead in _BACKGROUND_LEADS:  # article, then preposition
        if start > 0 and words[start - 1] in lead:
            start -= 1
    if start >= 2 and words[start - 2:start] == ["in", "front"]:
        start -= 2
    return background, " ".join(words[:start] + words[end + 1:])


def _claim(text: str) -> list[tuple[int, int, str, str]]:
    """Non-overlapping (start, end, kind, value) mentions, earlier patterns first."""
    taken = np.zeros(len(text) + 1, dtype=bool)
    found: list[tuple[int, int, str, str]] = []
    for kind, patterns in (("motion", _MOTION_PATTERNS), ("shape", _SHAPE_PATTERNS), ("color", _COLOR_PATTERNS),
                           ("size", _SIZE_PATTERNS)):
        for value, pattern in patterns:
            for m in re.finditer(pattern, text):
                if not taken[m.start():m.end()].any():
                    taken[m.start():m.end()] = True
                    found.append((m.start(), m.end(), kind, value))
    return sorted(found)


_PREDICATE = re.compile(r"\b(?:is|are|colored|painted)\s*$")


def parse_prompt(text: str) -> ParsedPrompt:
    """Color / shape / motion (and size, background) per object, tolerant of paraphrase.

    Objects are noun phrases anchored at their shape word: colors and sizes before a
    shape belong to it, motions after it. A motion stated before any object ("moving
    right: a red circle") goes to the first object. Never raises on unknown text.
    """
    if not isinstance(text, str):
        raise ValueError(f"prompt must be a string, got {type(text).__name__}")
    background, rest = _parse_background(_normalize(text))
    objects: list[dict[str, str]] = []
    pending_motion: str | None = None
    last_end = 0
    for start, end, kind, value in _claim(rest):
        cur = objects[-1] if objects else None
        predicate = _PREDICATE.search(rest[last_end:start]) is not None  # "a circle that is red"
        last_end = end
        if kind in ("color", "size") and cur is not None and kind not in cur and predicate:
            cur[kind] = value
        elif kind in ("color", "size", "shape"):
            # a new noun phrase starts once the current one has its shape, or repeats this slot
            if cur is None or "shape" in cur or kind in cur or "motion" in cur:
                objects.append({kind: value})
            else:
                cur[kind] = value
        elif cur is None:
            pending_motion = pending_motion or value
        elif "motion" not in cur:
            cur["motion"] = value
    objects = objects[:MAX_OBJECTS]
    if pending_motion is not None:
        if not objects:
            objects.append({})
        objects[0].setdefault("motion", pending_motion)
    parsed = tuple(ParsedObject(**o) for o in objects) or (ParsedObject(),)
    return ParsedPrompt(text=text, objects=parsed, background=background)


# --------------------------------------------------------------------------------------
# 7. The held-out evaluation set
# --------------------------------------------------------------------------------------

_HELD_OUT_STREAM = 1  # dataset items draw from SeedSequence([seed, 0, i]); this set from [seed, 1]
_HELD_OUT_IMAGE_STREAM = 3  # [seed, 2, i] is the distillation's caption stream


@dataclass(frozen=True, slots=True)
class EvalPrompt:
    prompt: str
    scene: Scene


def eval_image_prompts(n: int = 128, seed: int = 0, *, two_object_prob: float = 0.25) -> list[EvalPrompt]:
    """``n`` seeded image prompts (one frame, no motion stated) with their static scenes.

    Every (color, shape) pair can come up, the held-out static ones included (the training
    images are static train-split scenes, so those few pairs are never seen as images).
    NOTE: not restricted to held-out scenes like ``held_out_prompts``: only ~6 of the 40
    (color, shape) pairs are held out as static, too few to score images by. Drawn from its
    own stream.
    """
    if n < 1 or seed < 0:
        raise ValueError(f"need n >= 1 and seed >= 0, got n={n}, seed={seed}")
    rng = np.random.default_rng([seed, _HELD_OUT_IMAGE_STREAM])
    out = []
    for _ in range(n):
        scene = sample_scene(rng, split="any", two_object_prob=two_object_prob, motions=("static",))
        out.append(EvalPrompt(describe(scene, rng, with_motion=False), scene))
    return out


def held_out_prompts(n: int = 200, seed: int = 0, *, two_object_prob: float = 0.25) -> list[EvalPrompt]:
    """A fixed, seeded set of ``n`` evaluation prompts with their scenes.

    Every scene contains at least one held-out (color, shape, motion) combination
    (``is_held_out``), which the training dataset never renders, so neither the prompt
    nor the scene was seen in training.
    """
    if n < 1 or seed < 0:
        raise ValueError(f"need n >= 1 and seed >= 0, got n={n}, seed={seed}")
    rng = np.random.default_rng([seed, _HELD_OUT_STREAM])
    out = []
    for _ in range(n):
        scene = sample_scene(rng, split="held_out", two_object_prob=two_object_prob)
        out.append(EvalPrompt(describe(scene, rng), scene))
    return out
