"""Typos on the command line: an unknown flag is refused by the subcommand it was given to
(its usage, not the top-level one) with the closest flag it has; a mistyped subcommand or
choice gets the closest name too."""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn


def closest(word: str, names: list[str]) -> str | None:
    """The name nearest ``word`` (difflib's ratio, at least 0.6), or None."""
    found = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return found[0] if found else None


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser whose "invalid choice" errors name the closest choice (checked on the
    value and the action's choices, not on argparse's message)."""

    def _check_value(self, action: argparse.Action, value: object) -> None:
        choices = action.choices
        if choices is not None and value not in choices:
            names = [str(c) for c in choices]
            guess = closest(str(value), names)
            hint = f"; did you mean {guess!r}?" if guess is not None else ""
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from "
                                         f"{', '.join(repr(n) for n in names)}){hint}")
        super()._check_value(action, value)


def selected_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser the command line chose: ``omniloop eval adherence ...`` -> adherence's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = vars(args).get(action.dest)
            if name in action.choices:
                return selected_parser(action.choices[name], args)
    return parser


def refuse_unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> NoReturn:
    """Exit 2 with the chosen subcommand's usage: ``unrecognized arguments: --heigth 30; did you
    mean --height?`` (one suggestion per unknown flag that has a close one)."""
    sub = selected_parser(parser, args)
    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    unknown = [t.split("=", 1)[0] for t in extras if t.startswith("-")]
    guesses = {flag: closest(flag, flags) for flag in unknown}
    hints = [f"{guess} (for {flag})" if len(unknown) > 1 else guess for flag, guess in guesses.items() if guess]
    hint = f"; did you mean {', '.join(hints)}?" if hints else ""
    sub.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
