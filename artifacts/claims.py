"""The claims registry: every experiment's claims (``artifacts/<experiment>/claims.py``), judged
on its result files, printed grouped by system with a one-line summary each; docs/claims.md's
tables and the README's summary lines are generated from here.

    python -m artifacts.claims [EXPERIMENT ...]     the table, this run's results (default)
    python -m artifacts.claims --against reference  the same on the committed reference
    python -m artifacts.claims --pins               regression pins: this run against the reference
    python -m artifacts.claims --write-readme       rewrite those (from the reference)

Three kinds (artifacts.verdicts): paper claims, judged against the paper's number by a written
rule, each saying whether ours is measured (on what) or predicted (by which model); bounds,
principled targets (holds / BROKEN, or within noise where a measured number's launches straddle
the target); numbers shown for context, never judged. Regression pins
compare this run with the committed reference and are never in a verdict. The command exits
non-zero if a bound is broken without a known cause, or (``--pins``) a pinned number moved; a
paper claim that does not reproduce is a finding, not a failure. A result file that cannot be
judged (unreadable, a value of the wrong type, a NaN or an infinity in a point) is one line and
exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

from measure.cli import OneLineParser
from measure.results import ResultFileError, Results, write_text_atomic

from .experiment import ARTIFACTS, given_once
from .verdicts import (
    DEPENDS,
    DIRECTION_ONLY,
    NOT_REPRODUCED,
    NOT_RUN,
    REPRODUCED,
    RULE,
    Bound,
    Claim,
    PaperClaim,
    Pin,
    Shown,
    Verdict,
    band_verdict,
    format_value,
    paper_verdict,
    read,
    verdict_class,
)

EXPERIMENTS = ("tempo_layer", "tempo_bert", "tempo_llama", "mist_vs_megatron", "cta_mlp")
SYSTEMS = ("Tempo", "Mist", "CTA-pipelining")
SOURCES = ("reference", "results")
HOLDS, BROKEN, KNOWN_BROKEN, SHOWN = "holds", "BROKEN", "BROKEN (known)", "shown, not judged"
WITHIN_NOISE = "within noise"  # a bound the measurement's launches straddle (Bound.noise): not judged
BUSY = "busy machine"  # a time broken only by points timed beside other work (Bound.quiet): not judged
NOT_RUN_VERDICT = Verdict(NOT_RUN)


def claims(experiments: tuple[str, ...] = EXPERIMENTS) -> tuple[Claim, ...]:
    """Every claim of ``experiments``, in their order."""
    return tuple(c for e in experiments for c in importlib.import_module(f"artifacts.{e}.claims").CLAIMS)


def pins(experiments: tuple[str, ...] = EXPERIMENTS) -> tuple[Pin, ...]:
    return tuple(p for e in experiments for p in importlib.import_module(f"artifacts.{e}.claims").PINS)


def _results(experiment: str, file: str, source: str) -> Results:
    return Results.load(ARTIFACTS / experiment / source / file)


@dataclass(frozen=True)
class Row:
    claim: Claim
    value: float | tuple[float, float] | None  # ours, from the source judged
    verdict: Verdict
    out_of: float | None = None  # a count's cases (Bound.out_of)

    @property
    def ours(self) -> str:
        """Our value as the tables show it: a count with its cases, "k of n"."""
        shown = format_value(self.value, self.claim.unit)
        return shown if self.out_of is None else f"{shown} of {self.out_of:.0f}"


def judge(claim: Claim, source: str) -> Row:
    """One claim's verdict on ``source``'s result file ("results": this run, or "reference")."""
    results = _results(claim.source.experiment, claim.source.file, source)
    if isinstance(claim, PaperClaim):
        if claim.band is not None:
            ours = read(claim.band, results)
            verdict = (
                NOT_RUN_VERDICT if ours is None else band_verdict(*ours, claim.paper.value, claim.neutral)
            )
        else:
            ours = read(claim.value, results)
            noise = read(claim.noise, results) if claim.noise is not None and ours is not None else None
            verdict = (
                NOT_RUN_VERDICT
                if ours is None
                else paper_verdict(ours, claim.paper.value, claim.neutral, noise or 0.0, bool(claim.analogue))
            )
        return Row(claim, ours, verdict)
    ours = read(claim.value, results)
    if ours is None:
        return Row(claim, None, NOT_RUN_VERDICT)
    if isinstance(claim, Shown):
        return Row(claim, ours, Verdict(SHOWN))
    row = _judge_bound(claim, results, ours)
    if claim.quiet is None or row.verdict.kind not in (BROKEN, KNOWN_BROKEN, WITHIN_NOISE):
        return row
    quiet = claim.quiet(results)
    if len(quiet) == len(results):
        return row
    mine = read(claim.value, quiet) if len(quiet) else None
    quiet_row = _judge_bound(claim, quiet, mine) if mine is not None else None
    if quiet_row is not None and quiet_row.verdict.kind in (BROKEN, KNOWN_BROKEN):
        return quiet_row  # broken where the machine was quiet: a busy one's points are not the cause
    busy = len(results) - len(quiet)
    rest = f"the quiet ones alone: {quiet_row.verdict.kind}" if quiet_row is not None else "none is quiet"
    why = (
        f"with {busy} of its {len(results)} points timed beside other work it is {row.verdict.kind}, "
        f"{rest}: not judged; rerun on a quiet machine"
    )
    return Row(claim, ours, Verdict(BUSY, f"{BUSY} ({why})"), row.out_of)


def _judge_bound(claim: Bound, results: Results, ours: float | tuple[float, float]) -> Row:
    """A bound's verdict on ``results`` whose value is ``ours``: by its noise band where it has one."""
    out_of = read(claim.out_of, results) if claim.out_of is not None else None
    broken = Verdict(KNOWN_BROKEN if claim.known_broken else BROKEN)
    band = read(claim.noise, results) if claim.noise is not None else None
    if band is None:  # no band, or none to read: the value alone is judged
        return Row(claim, ours, Verdict(HOLDS) if claim.check.ok(ours) else broken, out_of)
    # the band's ends, whichever way the check points: it holds at both, fails at both, or straddles
    ends = [claim.check.ok(x) for x in band]
    if all(ends):
        return Row(claim, ours, Verdict(HOLDS))
    if not any(ends):
        return Row(claim, ours, broken)
    spans = f"its launches give {format_value(band, claim.unit, signed=False)}"
    measured = read(claim.noise_as_measured, results) if claim.noise_as_measured is not None else None
    if measured is not None and measured != band:  # the band also spans the machine's drift: both said
        spans = (
            f"its launches give {format_value(measured, claim.unit, signed=False)} as measured, "
            f"{format_value(band, claim.unit, signed=False)} with the machine's drift since the fit "
            "by the probe"
        )
    return Row(
        claim,
        ours,
        Verdict(WITHIN_NOISE, f"{WITHIN_NOISE} ({spans}: not judged; rerun on a quieter machine)"),
    )


def evaluate(chosen: tuple[Claim, ...] | None = None, source: str = "results") -> list[Row]:
    return [judge(c, source) for c in (claims() if chosen is None else chosen)]


def summary(rows: list[Row], system: str) -> str:
    """One line for ``system``: its paper claims by verdict, measured against predicted, and its bounds."""
    mine = [r for r in rows if r.claim.system == system]
    paper = [r for r in mine if isinstance(r.claim, PaperClaim)]
    counts: dict[str, int] = {}
    for r in paper:
        counts[verdict_class(r.verdict)] = counts.get(verdict_class(r.verdict), 0) + 1
    order = (REPRODUCED, DIRECTION_ONLY, DEPENDS, NOT_REPRODUCED, NOT_RUN)
    judged = ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k))
    ran = [r for r in paper if r.verdict.kind != NOT_RUN]
    measured = sum(r.claim.source.evidence == "measured" for r in ran)
    bounds = [r for r in mine if isinstance(r.claim, Bound)]
    held = sum(r.verdict.kind == HOLDS for r in bounds)
    broken = sum(r.verdict.kind in (BROKEN, KNOWN_BROKEN) for r in bounds)
    noisy = sum(r.verdict.kind == WITHIN_NOISE for r in bounds)
    busy = sum(r.verdict.kind == BUSY for r in bounds)
    within = f"{noisy} within noise, " if noisy else ""
    within += f"{busy} on a busy machine, " if busy else ""
    return (
        f"{system}: {len(paper)} paper claims ({judged or 'none'}; {measured} of those run measured, "
        f"{len(ran) - measured} predicted); {len(bounds)} bounds ({held} hold, {broken} broken, "
        f"{within}{len(bounds) - held - broken - noisy - busy} not yet run)"
    )


def _evidence(c: Claim) -> str:
    return f"{c.source.evidence}: {c.source.basis}"


def print_table(rows: list[Row], file=None) -> None:
    file = file or sys.stdout
    for system in SYSTEMS:
        mine = [r for r in rows if r.claim.system == system]
        if not mine:
            continue
        print(f"\n== {system}", file=file)
        w = max(len(r.claim.id) for r in mine)
        for r in mine:
            c = r.claim
            ours = r.ours
            if isinstance(c, PaperClaim):
                print(
                    f"  {c.id:<{w}}  paper {c.paper.text:<24} ours {ours:>16} "
                    f"({c.source.evidence})  {r.verdict}",
                    file=file,
                )
            elif isinstance(c, Bound):
                print(
                    f"  {c.id:<{w}}  bound {c.check.describe(c.unit):<24} ours {ours:>16} "
                    f"({c.source.evidence})  {r.verdict}",
                    file=file,
                )
            else:
                print(
                    f"  {c.id:<{w}}  {'':<30} ours {ours:>16} ({c.source.evidence})  {r.verdict}", file=file
                )
        print(f"  -> {summary(rows, system)}", file=file)
    print(f"\nrule for paper claims: {RULE}", file=file)
    for r in rows:
        if r.verdict.kind == KNOWN_BROKEN:
            print(f"{r.claim.id}: broken, known: {r.claim.known_broken}", file=file)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table (cells escaped), followed by a blank line."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return [*lines, ""]


def markdown(rows: list[Row] | None = None) -> str:
    """docs/claims.md's generated section: per system its summary line and three tables (paper claims,
    bounds, numbers shown), from the committed reference."""
    rows = evaluate(source="reference") if rows is None else rows
    out = [f"Rule for paper claims: {RULE}.", ""]
    for system in SYSTEMS:
        mine = [r for r in rows if r.claim.system == system]
        out += [f"#### {system}", "", f"**{summary(rows, system)}.**", ""]

        def ours(r: Row) -> str:
            return f"**{r.ours}** ({r.claim.measure})"

        paper = [
            [
                f"`{r.claim.id}`: {r.claim.claim}",
                r.claim.paper.text,
                r.claim.paper.where,
                ours(r),
                _evidence(r.claim),
                str(r.verdict),
                f"`{r.claim.source.command}`",
            ]
            for r in mine
            if isinstance(r.claim, PaperClaim)
        ]
        bounds = [
            [
                f"`{r.claim.id}`: {r.claim.claim}",
                ours(r),
                r.claim.check.describe(r.claim.unit),
                r.claim.why,
                _evidence(r.claim),
                str(r.verdict) + (f": {r.claim.known_broken}" if r.verdict.kind == KNOWN_BROKEN else ""),
                f"`{r.claim.source.command}`",
            ]
            for r in mine
            if isinstance(r.claim, Bound)
        ]
        shown = [
            [f"`{r.claim.id}`: {r.claim.claim}", ours(r), _evidence(r.claim), f"`{r.claim.source.command}`"]
            for r in mine
            if isinstance(r.claim, Shown)
        ]
        if paper:
            out += _table(
                ["claim", "the paper", "where", "ours", "measured or predicted", "verdict", "command"], paper
            )
        if bounds:
            out += _table(
                ["bound", "ours", "target", "why this target", "measured or predicted", "verdict", "command"],
                bounds,
            )
        if shown:
            out += _table(["shown, not judged", "ours", "measured or predicted", "command"], shown)
    return "\n".join(out)


@dataclass(frozen=True)
class PinRow:
    pin: Pin
    reference: float | None
    this_run: float | None
    moved: bool | None  # None: not run here or no reference


def check_pins(chosen: tuple[Pin, ...] | None = None) -> list[PinRow]:
    out = []
    for p in pins() if chosen is None else chosen:
        ref = read(p.value, _results(p.experiment, p.file, "reference"))
        now = read(p.value, _results(p.experiment, p.file, "results"))
        moved = None if ref is None or now is None else not p.near.ok(now, ref)
        out.append(PinRow(p, ref, now, moved))
    return out


README = ARTIFACTS.parent / "README.md"
CLAIMS_DOC = ARTIFACTS.parent / "docs" / "claims.md"
# the generated parts: every table in docs/claims.md, each system's summary line on the front page
TABLE = (
    "<!-- claims table: generated by `python -m artifacts.claims --write-readme` -->",
    "<!-- end of claims table -->",
)
SUMMARY = (
    "<!-- claims summary: generated by `python -m artifacts.claims --write-readme` -->",
    "<!-- end of claims summary -->",
)


def summary_markdown(rows: list[Row] | None = None) -> str:
    """The front page's claims: each system's summary line, linked to its tables."""
    rows = evaluate(source="reference") if rows is None else rows
    return "".join(
        f"- **{summary(rows, system)}** ([tables](docs/claims.md#{_anchor(system)}))\n" for system in SYSTEMS
    )


def _anchor(heading: str) -> str:
    """A markdown heading's anchor as GitHub makes it: lower case, spaces as hyphens, other
    punctuation dropped."""
    return "".join(c for c in heading.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def _span(text: str, markers: tuple[str, str]) -> tuple[int, int]:
    """Where the generated part between ``markers`` starts and stops in ``text``."""
    return text.index(markers[0]) + len(markers[0]) + 1, text.index(markers[1])


def generated(path: Path, markers: tuple[str, str]) -> str:
    """What ``path`` holds between ``markers`` (the generated part)."""
    text = path.read_text()
    start, stop = _span(text, markers)
    return text[start:stop]


def _write_generated(path: Path, markers: tuple[str, str], content: str) -> None:
    """``path`` with its generated part replaced, whole or not at all (a tracked file: a kill
    mid-write would leave it cut short)."""
    text = path.read_text()
    start, stop = _span(text, markers)
    write_text_atomic(path, text[:start] + content + text[stop:])


def write_readme() -> None:
    """Regenerate docs/claims.md's tables and the front page's summary from the reference."""
    rows = evaluate(source="reference")
    _write_generated(CLAIMS_DOC, TABLE, markdown(rows))
    _write_generated(README, SUMMARY, summary_markdown(rows))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked (exit 2 on bad input): what a mode does not take is refused."""
    ap = OneLineParser(
        prog="python -m artifacts.claims",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "experiments",
        nargs="*",
        metavar="EXPERIMENT",
        help=f"only these ({', '.join(EXPERIMENTS)}); default: all",
    )
    ap.add_argument(
        "--against", choices=SOURCES, help="judge this run's results (default) or the committed reference"
    )
    mode = ap.add_mutually_exclusive_group()  # each is its own job; none: judge the claims
    mode.add_argument("--pins", action="store_true", help="regression pins: this run against the reference")
    mode.add_argument("--markdown", action="store_true", help="print docs/claims.md's generated tables")
    mode.add_argument(
        "--write-readme",
        action="store_true",
        help="rewrite docs/claims.md's tables and the README's claims summary",
    )
    args = ap.parse_args(argv)
    given_once(ap, "EXPERIMENT", args.experiments)
    if unknown := sorted(set(args.experiments) - set(EXPERIMENTS)):
        ap.error(f"unknown experiment {', '.join(unknown)}; accepted: {', '.join(EXPERIMENTS)}")
    # what the other modes do not take is refused, not ignored: the generated tables are every
    # experiment's, judged against the reference; pins always compare this run with the reference
    if (args.markdown or args.write_readme) and (args.experiments or args.against):
        ap.error(
            "--markdown and --write-readme cover every experiment against the reference; "
            "drop EXPERIMENT and --against"
        )
    if args.pins and args.against:
        ap.error("--pins compares this run with the reference; drop --against")
    return args


def _report_pins(experiments: tuple[str, ...]) -> int:
    """Print each regression pin of ``experiments``, this run against the reference; 1 where one
    moved, 2 on a broken result file."""
    try:
        rows = check_pins(pins(experiments))
    except ResultFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in rows:
        state = {None: "not compared", True: "MOVED", False: "as the reference"}[r.moved]
        print(
            f"  {r.pin.id:<36} reference {format_value(r.reference, r.pin.unit):>10}  this run "
            f"{format_value(r.this_run, r.pin.unit):>10}  "
            f"({r.pin.near.describe(r.pin.unit)})  {state}"
        )
    moved = [r.pin.id for r in rows if r.moved]
    compared = sum(r.moved is not None for r in rows)
    print(
        f"\n{len(rows)} regression pins: {compared} compared, {len(moved)} moved"
        + (f" ({', '.join(moved)}): a deliberate change updates the reference" if moved else "")
    )
    if rows and not compared:  # "0 moved" would read as a pass: nothing was checked
        print(
            "note: no pin was compared: this run has none of the results they read (run the "
            "experiment's parts first, e.g. nox -s <experiment>)"
        )
    return 1 if moved else 0


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    experiments = tuple(args.experiments) or EXPERIMENTS
    if args.markdown or args.write_readme:
        try:  # the reference, read as the table reads it: a broken file or a NaN in it is one line
            if args.markdown:
                print(markdown(), end="")
            else:
                write_readme()
                print(f"claims written to {CLAIMS_DOC} and {README}")
        except ResultFileError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.pins:
        return _report_pins(experiments)
    try:
        rows = evaluate(claims(experiments), args.against or "results")
    except ResultFileError as e:  # names the file and what to do
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(rows)
    broken = [r.claim.id for r in rows if r.verdict.kind == BROKEN]
    if broken:
        print(f"\nbroken without a known cause: {', '.join(broken)}")
    noisy = [r.claim.id for r in rows if r.verdict.kind == WITHIN_NOISE]
    if noisy:  # not a failure, not a pass: said where the exit status cannot say it
        print(
            f"\nnot judged, the measurement's noise straddles the bound: {', '.join(noisy)} (the machine "
            "was too noisy for these, or drifted between a fit and its launches; rerun the experiment "
            "on a quieter one)"
        )
    busy = [r.claim.id for r in rows if r.verdict.kind == BUSY]
    if busy:
        print(
            f"\nnot judged, timed while other work shared the cores: {', '.join(busy)} (rerun the "
            "experiment with nothing else running)"
        )
    return 1 if broken else 0


if __name__ == "__main__":
    from measure.parallel import interrupted_in_one_line

    with interrupted_in_one_line("python -m artifacts.claims", "nothing is written but by --write-readme"):
        sys.exit(main())
