"""`splu query`: count queries answered from a publication, a running consumer or, with
Laplace noise, the raw data."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Collection, Iterator, Mapping
from dataclasses import replace
from typing import Any

from service.cli.client import ConsumerError, ask
from service.cli.commands.common import (
    FORMATTER,
    CommandError,
    Commands,
    add_delimiter_option,
    add_mechanism_options,
    column_names,
    mechanism_settings,
    read_input_table,
    report_rejections,
    write_atomically,
)
from service.core.batch_files import load_batch, personal_merge_map, published_cells
from service.core.config import load_config
from service.core.kafka_settings import KAFKA_ENV, kafka_from_env
from service.core.mechanisms.laplace import LaplaceCounts
from service.core.mechanisms.laplace import _canonical as laplace_query_key
from service.core.mechanisms.registry import (
    ALL_OPTIONS,
    CLIPPABLE,
    MECHANISMS,
    Evidence,
)
from service.core.merge import ValueMap
from service.core.prf import ServiceKey
from service.core.publication import flag_of, log, open_input
from service.core.reconstruct import (
    Answers,
    PublishedCells,
    Query,
    QueryError,
    Reconstruction,
    checked_query,
)
from service.core.table import csv_reader

# Where `splu query --topic` finds Kafka without --bootstrap, as every stream command does.
BOOTSTRAP_ENV = KAFKA_ENV["bootstrap"]


def _read_queries(
    path: str, reconstruction: Answers, domains: Mapping[str, Collection[str]] | None = None
) -> tuple[list[dict[str, Any]], list[Query | None]]:
    """Every non-blank line: its object (with "error" if unusable) and its parsed query.

    With `domains`, a sensitive value outside its column's domain is an error of its line.
    """
    objects: list[dict[str, Any]] = []
    parsed: list[Query | None] = []
    with open_input(path) as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                objects.append({"line": number, "error": f"not valid JSON: {err.msg}"})
                parsed.append(None)
                continue
            try:
                query = checked_query(obj, reconstruction, domains)
            except QueryError as err:
                shown = obj if isinstance(obj, dict) else {"line": number}
                objects.append({**shown, "error": str(err)})
                parsed.append(None)
                continue
            objects.append(obj)
            parsed.append(query)
    return objects, parsed


def _refuse_options(args: argparse.Namespace, source: str) -> None:
    """Mechanism options do not apply when the stream itself says how it was published."""
    given = [o for o in dict.fromkeys(["sensitive", *ALL_OPTIONS, "clip", "quasi", "bin", "schema",
             "seed"]) if getattr(args, o, None) is not None]  # fmt: skip
    if given:
        flag = flag_of(given[0])
        raise CommandError(f"{flag} does not apply with {source}")


def _query_lines(path: str) -> list[Any]:
    """Every non-blank line's JSON, or a `_BadLine` where it is not JSON."""
    lines: list[Any] = []
    with open_input(path) as stream:
        for number, line in enumerate(stream, start=1):
            if line.strip():
                try:
                    lines.append(json.loads(line))
                except json.JSONDecodeError as err:
                    lines.append(_BadLine(number, f"not valid JSON: {err.msg}"))
    return lines


def _merged(lines: list[Any], answers: Iterator[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answers to the valid lines, in order, with an error for each bad line."""
    return [
        {"line": obj.number, "error": obj.error} if isinstance(obj, _BadLine) else next(answers)
        for obj in lines
    ]


def _query_service(args: argparse.Namespace) -> int:
    if not MECHANISMS[args.mechanism].stream:
        raise CommandError(
            f"--mechanism {args.mechanism} runs in batch only: query its files with --published"
        )
    _refuse_options(args, "--url: the stream's config decides")
    lines = _query_lines(args.queries)
    asked = [obj for obj in lines if not isinstance(obj, _BadLine)]
    try:
        answers = iter(ask(args.url, asked))
    except ConsumerError as err:
        raise CommandError(str(err)) from None
    return _write_answers(args, _merged(lines, answers), f"from {args.url}")


def _query_topic(args: argparse.Namespace) -> int:
    """Answers from a stream's manifest and published topic, read by `args.read_topic`
    (the `splu` entry point's Kafka reader, `streams.tools.reader`)."""
    _refuse_options(args, "--topic: the stream's manifest decides")
    if args.read_topic is None:
        raise CommandError("--topic reads Kafka: run it as `splu query`")
    if args.config is not None:
        kafka = load_config(args.config).kafka
    elif args.bootstrap or os.environ.get(BOOTSTRAP_ENV):
        kafka = kafka_from_env()
    else:
        raise CommandError(
            f"--topic: give --bootstrap HOST:PORT, set {BOOTSTRAP_ENV} or name the stream's "
            "--config"
        )
    if args.bootstrap:
        kafka = replace(kafka, bootstrap=args.bootstrap)
    # The stream's name, also when given as its published topic.
    stream = args.topic.removesuffix(".published")
    lines = _query_lines(args.queries)
    publication = args.read_topic(stream, kafka, args.confidence)
    answers = iter(publication.answer([obj for obj in lines if not isinstance(obj, _BadLine)]))
    held = f", {publication.held:,} more held until their unit is whole" if publication.held else ""
    source = (
        f"from {stream} at {kafka.bootstrap} ({publication.records:,} published records{held}, "
        f"{publication.manifest.mechanism})"
    )
    return _write_answers(args, _merged(lines, answers), source)


class _BadLine:
    def __init__(self, number: int, error: str) -> None:
        self.number, self.error = number, error


def _write_answers(args: argparse.Namespace, results: list[dict[str, Any]], source: str) -> int:
    write_atomically(
        args.output,
        lambda s: s.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in results),
    )
    failures = sum("error" in r for r in results)
    log(f"splu query: answered {len(results) - failures:,} queries {source} into {args.output}")
    if failures:
        log(f'  {failures:,} queries could not be answered; their lines carry an "error"')
        return 1
    return 0


def _query_laplace(args: argparse.Namespace, settings: dict[str, Any]) -> int:
    """Noisy counts on the raw data: trusted side. m = distinct queries naming a sensitive
    value (public-only ones are exact and outside the budget, as in LaplaceCounts)."""
    if args.input is None:
        raise CommandError(
            "--mechanism laplace answers from the raw data: give --input RAW.csv (trusted "
            "side), not --published"
        )
    table, rejections = read_input_table(args)
    log(f"splu query: read {len(table) + len(rejections):,} raw rows from {args.input}")
    report_rejections(rejections)
    sensitive = [a.name for a in table.schema.sensitive]
    checker = Reconstruction(PublishedCells.from_table(table), sensitive, args.confidence, False)
    domains = {a.name: frozenset(a.domain) for a in table.schema.sensitive}
    objects, parsed = _read_queries(args.queries, checker, domains)
    valid = [q for q in parsed if q is not None]
    budgeted = len({laplace_query_key(q) for q in valid if q.value})
    mechanism = LaplaceCounts(settings["epsilon"], max(budgeted, 1), args.confidence)
    key = ServiceKey.fresh() if args.seed is None else ServiceKey.from_seed(args.seed)
    answers = iter(mechanism.answer(table, valid, key))
    results = [
        obj if q is None else {**obj, **next(answers).answer()}
        for obj, q in zip(objects, parsed, strict=True)
    ]
    log(
        f"  {budgeted:,} distinct sensitive queries share ε = {mechanism.epsilon:g}: "
        f"noise Lap(b), b = m/ε = {mechanism.scale:g}"
    )
    return _write_answers(args, results, f"from {len(table):,} raw rows (laplace)")


def _check_published_columns(published: str, quasi: list[str], delimiter: str | None) -> None:
    if not quasi:
        return
    with open_input(published) as stream:
        header = csv_reader(stream, delimiter)[0]
    missing = [c for c in quasi if c not in header]
    if missing:
        raise CommandError(
            f"--quasi {missing[0]!r} is not a column of {published} (its columns: "
            f"{', '.join(header)}): was it published with other --quasi columns?"
        )


def command_query(args: argparse.Namespace) -> int:
    if sum(s is not None for s in (args.published, args.url, args.topic, args.input)) != 1:
        raise CommandError(
            "give --published FILE (a batch publication), --url URL (a running consumer) or "
            "--topic STREAM (a stream's topics); --mechanism laplace takes --input RAW.csv instead"
        )
    if args.topic is not None:
        return _query_topic(args)
    if args.bootstrap:
        raise CommandError("--bootstrap applies to --topic only")
    if args.config is not None:
        if args.published is None:
            raise CommandError("--config applies to --topic and --published only")
        return _query_stream_file(args)
    if args.url is not None:
        return _query_service(args)
    chosen, spec = args.mechanism, MECHANISMS[args.mechanism]
    if args.clip is not None and chosen not in CLIPPABLE:
        raise CommandError(
            f"--clip applies to --mechanism {', '.join(CLIPPABLE[:-1])} or {CLIPPABLE[-1]}, "
            f"not {chosen}"
        )
    # A mechanism that publishes nothing answers from the raw data (laplace).
    if spec.publish is not None:
        if args.input is not None:
            raise CommandError(f"--input applies to --mechanism laplace (raw data), not {chosen}")
        # The rest of `splu publish`'s options are welcome (SPEC §5: the same options):
        # --quasi must name columns the publication has; --bin, --schema and --seed shaped
        # the raw table before publication and change nothing in what is read here.
        _check_published_columns(args.published, column_names(args.quasi), args.delimiter)
    settings = mechanism_settings(args)
    if spec.publish is None:
        return _query_laplace(args, settings)
    if spec.batch_only:
        answerer, rows, domains = load_batch(
            chosen,
            args.published,
            column_names(args.sensitive),
            vars(args),
            settings,
            args.confidence,
            args.clip,
        )
    else:
        if not column_names(args.sensitive):
            raise CommandError(
                "name the sensitive column(s) of the published file with --sensitive"
            )
        with open_input(args.published) as stream:
            cells = published_cells(stream.read(), args.published, args.delimiter)
        if "merge_map" in spec.options:
            personal_merge_map(settings, args.published)
            path = settings["merge_map"]
            settings["value_map"] = ValueMap.load(path) if path else None
        assert spec.reconstruct is not None
        evidence = Evidence(
            settings, column_names(args.sensitive), cells, confidence=args.confidence,
            clip=args.clip,
        )  # fmt: skip
        answerer = spec.reconstruct(evidence)
        rows, domains = cells.total, None
    return _answer_queries(args, answerer, domains, f"over {rows:,} published rows ({chosen})")


def _answer_queries(
    args: argparse.Namespace,
    answerer: Answers,
    domains: Mapping[str, Collection[str]] | None,
    source: str,
) -> int:
    objects, parsed = _read_queries(args.queries, answerer, domains)
    valid = [q for q in parsed if q is not None]
    answers = iter(answerer.estimate_many(valid))
    results = [
        obj if q is None else {**obj, **next(answers).answer()}
        for obj, q in zip(objects, parsed, strict=True)
    ]
    return _write_answers(args, results, source)


def _query_stream_file(args: argparse.Namespace) -> int:
    """A stream's published records written as CSV (`splu run --published-out`), answered
    as its consumer answers them: its config decides the mechanism and its options."""
    _refuse_options(args, "--config: the stream's config decides")
    config = load_config(args.config)
    if config.windowed is not None:
        raise CommandError(
            f"{args.config} is a windowed stream: its answers need its side messages too, "
            f"query its topics with --topic {config.name}"
        )
    with open_input(args.published) as stream:
        cells = published_cells(stream.read(), args.published, args.delimiter)
    answerer = config.reconstruction(cells, args.confidence)
    source = f"over {cells.total:,} published rows of stream {config.name!r} ({config.mechanism})"
    return _answer_queries(args, answerer, None, source)


def register(commands: Commands) -> None:
    """Add `splu query`."""
    query = commands.add_parser(
        "query", formatter_class=FORMATTER,
        help="answer count queries (JSONL) from a published CSV or a running consumer",
        description=(
            'Each input line is {"where": {"col": "val", ...}, "value": {"sacol": "val"}};\n'
            "a where value may also be a list (any of). Each output line is the same\n"
            'object plus "estimate" and, where defined, an interval "low"/"high".\n'
            "Give the same mechanism options as `splu publish`.\n\n"
            "Large counts come back accurately; small counts deliberately do not.\n\n"
            "example:\n"
            "  echo '{\"where\": {\"sex\": \"Female\"},' \\\n"
            "       '\"value\": {\"occupation\": \"Sales\"}}' > q.jsonl\n"
            "  splu query --published published.csv --mechanism decoy --gamma 5 \\\n"
            "      --sensitive occupation --queries q.jsonl --output answers.jsonl\n"
            "  splu query --published published.csv --config my-stream.toml \\\n"
            "      --queries q.jsonl --output -        # from `splu run --published-out`\n"
            "  splu query --url http://127.0.0.1:6066 --queries q.jsonl --output -\n"
            "  splu query --topic adult --bootstrap kafka:9092 --queries q.jsonl --output -\n"
            "  splu query --published sdr.csv --mechanism sdr --queries q.jsonl --output a.jsonl\n"
            "  splu query --mechanism laplace --input adult.csv --epsilon 0.05 \\\n"
            "      --sensitive occupation --quasi age,sex --queries q.jsonl --output a.jsonl\n\n"
            "Batch-only mechanisms (sdr, fprivacy, anatomy, dbr, global) read OUT.params.json\n"
            "and, for anatomy and fprivacy, OUT.st.csv beside --published OUT.csv (see\n"
            "`splu publish --help`); --sensitive and their options may be left out, and must\n"
            "match the publication if given. low/high is a normal interval for sdr and\n"
            "global, exact (Clopper–Pearson) for a dbr value's total and absent for its\n"
            "conjunctions, the range of counts consistent with the buckets for fprivacy (not\n"
            "a confidence interval), and absent for anatomy (its estimator has no error model).\n\n"
            "--mechanism laplace publishes nothing and RUNS ON THE TRUSTED SIDE: it answers\n"
            "from the raw data (--input RAW.csv, columns as for publish), each count plus\n"
            "Laplace noise of scale m/ε, m = the number of distinct queries in the file that\n"
            "name a sensitive value (public-only queries are exact and outside the budget).\n"
            "A run with a fresh key spends ε again; --seed repeats a run's noise."
        ),
    )  # fmt: skip
    source = query.add_mutually_exclusive_group()
    source.add_argument("--published", help="CSV written by `splu publish`")
    source.add_argument(
        "--url",
        help="instead, ask a running consumer (`splu consumer`), e.g. http://127.0.0.1:6066; "
        "its stream's config decides mechanism and options",
    )
    source.add_argument(
        "--topic",
        metavar="STREAM",
        help="instead, read a stream's manifest and published records from Kafka (STREAM: "
        "its name, e.g. adult, or adult.published): the stream consumer's answers, with no "
        "config file, key or Redis",
    )
    source.add_argument(
        "--input",
        metavar="RAW.csv",
        help="laplace: the raw data (trusted side), with --sensitive and --quasi as for publish",
    )
    query.add_argument(
        "--sensitive",
        action="append",
        metavar="COL",
        help="the randomized column(s) of the published file (laplace: of the raw data)",
    )
    query.add_argument(
        "--bootstrap", metavar="HOST:PORT",
        help=f"--topic: the Kafka bootstrap (default: {BOOTSTRAP_ENV}, else --config's)",
    )  # fmt: skip
    query.add_argument(
        "--config", metavar="FILE",
        help="--published: the stream config the CSV was published with (`splu run "
        "--published-out`), which decides mechanism and options; --topic: take the Kafka "
        "settings from its [kafka] (default: the KAFKA_* variables: KAFKA_BOOTSTRAP, "
        "KAFKA_SECURITY_PROTOCOL, KAFKA_CA_FILE, KAFKA_SASL_MECHANISM, KAFKA_USERNAME, "
        "KAFKA_PASSWORD...)",
    )  # fmt: skip
    add_delimiter_option(query)
    query.add_argument("--queries", required=True, help="JSONL file of queries (- for stdin)")
    query.add_argument("--output", required=True, help="JSONL answers (- for stdout)")
    add_mechanism_options(query, reconstruction=True)
    query.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        help="coverage of the [low, high] interval (default 0.95)",
    )
    query.add_argument(
        "--clip",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep answers in [0, |P|]; decoy clips by default, personal, sdr and global "
        "do not (their raw estimates are unbiased)",
    )
    laplace = query.add_argument_group("laplace (answers from the raw data: trusted side)")
    laplace.add_argument(
        "--epsilon",
        type=float,
        help="laplace: privacy budget ε > 0 shared by the file's queries (required)",
    )
    laplace.add_argument(
        "--quasi", action="append", metavar="COL,COL",
        help="laplace: public columns of --input; other mechanisms: as given to `splu publish`, "
        "checked against the published file's columns",
    )  # fmt: skip
    laplace.add_argument(
        "--bin", action="append", metavar="COL=SPEC",
        help="as for `splu publish` (laplace bins --input; otherwise accepted and unused)",
    )  # fmt: skip
    laplace.add_argument(
        "--schema", help="as for `splu publish` (laplace reads --input with it; otherwise unused)"
    )
    laplace.add_argument(
        "--seed",
        type=int,
        help="laplace: derive the noise from this seed (experiments only: anyone with the "
        "seed can remove it; default: a fresh random key); otherwise accepted and unused",
    )
    # `read_topic(stream, kafka, confidence)` -> `service.core.manifest.Publication`: Kafka
    # lives above this layer, so the `splu` entry point supplies it (`streams/cli.py`).
    query.set_defaults(run=command_query, read_topic=None)
