"""Output files named on the command line, checked before any work is done."""
from __future__ import annotations

import argparse
import os


def output_file(suffixes: tuple[str, ...] = ()):
    """An argparse type: a file that can be created or replaced, ending in one of `suffixes`
    (any name when none are given). Whether it can be is found by opening it (permissions
    alone do not tell on a pseudo-filesystem or for root); a file made for the test is removed."""
    def check(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError("needs a file name, got an empty one")
        if suffixes and not text.lower().endswith(suffixes):
            raise argparse.ArgumentTypeError(f"needs a file name ending in {' or '.join(suffixes)}, got {text!r}")
        folder = os.path.dirname(os.path.abspath(text))
        if not os.path.isdir(folder):
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: no folder {folder!r}")
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: it is a folder")
        existed = os.path.exists(text)
        try:
            with open(text, "a"):
                pass
            if not existed:
                os.remove(text)
        except OSError as error:
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: {error.strerror}") from None
        return text
    return check
