"""Command lines that answer bad input in one line."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """Bad input: one line on stderr (no usage block; ``--help`` shows it), exit status 2. Its
    subcommands' parsers are of this class too (argparse makes them of their parent's)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")
