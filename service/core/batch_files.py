"""The files of a batch publication, written beside OUT.csv and read back: OUT.csv
itself, OUT.st.csv (a bucketing mechanism's sensitive table), OUT.params.json (the public
parameters, domains and checksums every batch-only mechanism writes) and OUT.merge.toml (the
merge map a personal publication fitted on its input). `write_batch` writes a `Batch`
(`service.core.publishers`); `load_batch` reads the files back, checked against each other,
as the mechanism's estimator (`service.core.mechanisms.registry`), and `published_cells`
reads any published CSV as cells.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from service.core.mechanisms.registry import MECHANISMS, Buckets, Evidence, MechanismSpec
from service.core.mechanisms.sdr import SUBTABLE_COLUMN, SubTable
from service.core.publication import PublicationError, flag_of, log, open_input, shown_option
from service.core.publishers import COUNT_COLUMN, Batch
from service.core.reconstruct import Answers, PublishedCells
from service.core.schema import Attribute
from service.core.table import RawRows, Table, read_columns, read_rows

# Files a batch-only publication writes beside OUT.csv (OUT = its name without .csv).
PARAMS_SUFFIX = "params.json"  # public parameters, domains and checksums: every batch-only one
ST_SUFFIX = "st.csv"  # the sensitive table ST of anatomy and fprivacy
# The merge map a personal publication grouped with, when `splu publish` fitted it on its
# input: `splu query` needs the same groups, or its intervals cover 50-85% (issue 15).
MERGE_SUFFIX = "merge.toml"


def check_reserved(table: Table, mechanism: str) -> None:
    """OUT.csv adds the mechanism's column to the public ones; ST holds it, the sensitive
    column and a count. A data column of the same name would make a header ambiguous."""
    extra = MECHANISMS[mechanism].extra_column
    if extra is None:
        return
    reserved = {extra, COUNT_COLUMN} if MECHANISMS[mechanism].bucketed else {extra}
    for attribute in table.schema.attributes:
        if attribute.name in (reserved if attribute.sensitive else {extra}):
            raise PublicationError(
                f"column {attribute.name!r}: --mechanism {mechanism} publishes a column of that "
                "name itself; rename it in the input"
            )


def personal_merge_map(settings: dict[str, Any], published: str) -> None:
    """Fill in the merge map of a personal publication read back from `published`: the
    one named, else the one `splu publish` wrote beside it; without either the groups are
    unknown, and estimates and intervals would be those of other groups: refuse."""
    if settings["merge_map"]:
        return
    fitted = beside(published, MERGE_SUFFIX)
    if published == "-" or not Path(fitted).exists():
        raise PublicationError(
            "--mechanism personal needs the merge map the publication grouped with: give "
            f"--merge-map FILE (`splu publish` writes OUT.{MERGE_SUFFIX} beside OUT.csv when "
            "it fitted one on its input); with other groups the intervals do not cover"
        )
    log(f"  merge map: {fitted}, written by splu publish beside {published}")
    settings["merge_map"] = fitted


def beside(path: str, suffix: str) -> str:
    """OUT.csv → OUT.<suffix> in the same directory (OUT.csv.gz too; other names keep theirs)."""
    target = Path(path)
    name = target.name
    for ending in (".csv.gz", ".csv"):
        if name.endswith(ending) and len(name) > len(ending):
            name = name[: -len(ending)]
            break
    return str(target.with_name(f"{name}.{suffix}"))


def _csv_text(header: Sequence[str], columns: Sequence[np.ndarray]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(zip(*columns, strict=True))
    return buffer.getvalue()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _write_files(files: Sequence[tuple[str, str]]) -> None:
    """Write every (path, text) to a temporary beside it, then rename them all, the first
    last: a failure leaves no partial file, and the first appears only with the others."""
    temporaries: list[str] = []
    try:
        for path, text in files:
            target = Path(path)
            if not target.parent.exists():
                raise PublicationError(
                    f"cannot write {path}: directory {target.parent} does not exist"
                )
            handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
            temporaries.append(temporary)
            # newline="": the bytes written are the text the checksum was taken of.
            with os.fdopen(handle, "w", encoding="utf-8", newline="") as stream:
                stream.write(text)
        for (path, _), temporary in reversed(list(zip(files, temporaries, strict=True))):
            Path(temporary).replace(path)
    except BaseException:
        for temporary in temporaries:
            Path(temporary).unlink(missing_ok=True)
        raise


def write_batch(
    output: str, mechanism: str, settings: dict[str, Any], table: Table, batch: Batch
) -> list[str]:
    """OUT.csv, OUT.st.csv (anatomy, fprivacy) and OUT.params.json; nothing from the trusted
    side: no ids, no source lines, no true values, no thresholds fitted on the data."""
    text = _csv_text(batch.header, batch.columns)
    files = [(output, text)]
    digests = {"published": _digest(text)}
    if batch.st_header is not None and batch.st_columns is not None:
        st_text = _csv_text(batch.st_header, batch.st_columns)
        files.append((beside(output, ST_SUFFIX), st_text))
        digests["st"] = _digest(st_text)
    sensitive = [a.name for a in table.schema.sensitive]
    params = {
        "mechanism": mechanism,
        "published": Path(output).name,
        "rows": len(batch.columns[0]),
        "quasi": [a.name for a in table.schema.public],
        "sensitive": sensitive,
        "domain": {name: list(table.schema[name].domain) for name in sensitive},
        "options": {o: shown_option(settings[o]) for o in MECHANISMS[mechanism].options},
        **batch.params,
        # Ties the files together: `splu query` refuses a stale or foreign OUT.st.csv.
        "sha256": digests,
    }
    document = json.dumps(params, indent=2, ensure_ascii=False) + "\n"
    files.append((beside(output, PARAMS_SUFFIX), document))
    _write_files(files)
    return [path for path, _ in files]


def _read_text(path: str) -> str:
    with open_input(path) as stream:
        return stream.read()


def _rows(text: str, path: str, delimiter: str | None = None) -> RawRows:
    raw = read_rows(io.StringIO(text, newline=""), delimiter)
    if raw.rejections:
        raise PublicationError(f"{path}: {raw.rejections[0]} (is it a published file?)")
    return raw


def published_cells(text: str, path: str, delimiter: str | None = None) -> PublishedCells:
    """A published CSV's rows aggregated into cells, each column's domain the values it
    shows in order of appearance (as `PublishedCells.from_rows`); split by Arrow where it
    splits as the csv module does (`read_columns`), so a malformed line is refused alike.
    Without a `delimiter`, the header line's is sniffed."""
    columns = read_columns(text, delimiter)
    if columns is None:
        raw = _rows(text, path, delimiter)
        return PublishedCells.from_rows(raw.header, raw.rows)
    if columns.rejections:
        raise PublicationError(f"{path}: {columns.rejections[0]} (is it a published file?)")
    if len(set(columns.header)) != len(columns.header):
        raise PublicationError(f"{path}: a column name appears twice in the header")
    domains = dict(zip(columns.header, columns.values, strict=True))
    return PublishedCells.from_codes(columns.header, domains, columns.indices)


def _integers(values: Sequence[str], path: str, column: str) -> np.ndarray:
    out = np.empty(len(values), dtype=np.int64)
    for i, value in enumerate(values):
        try:
            out[i] = int(value)
        except ValueError:
            raise PublicationError(
                f"{path}: {column!r} holds {value!r}, not a whole number"
            ) from None
    return out


def _encoded(values: Sequence[str]) -> tuple[tuple[str, ...], np.ndarray]:
    """A column of labels as (its sorted distinct labels, codes into them)."""
    domain = tuple(sorted(set(values)))
    index = {v: i for i, v in enumerate(domain)}
    return domain, np.fromiter((index[v] for v in values), np.int64, len(values))


def _buckets(
    spec: MechanismSpec, params: dict[str, Any], qit: RawRows, st: RawRows, paths: tuple[str, str]
) -> Buckets:
    """A bucketing mechanism's QIT (OUT.csv) and ST (OUT.st.csv), checked."""
    extra, name = spec.extra_column, params["sensitive"][0]
    assert extra is not None
    quasi, domain = list(params["quasi"]), list(params["domain"][name])
    for path, raw, header in (
        (paths[0], qit, [*quasi, extra]),
        (paths[1], st, [extra, name, COUNT_COLUMN]),
    ):
        if raw.header != header:
            raise PublicationError(f"{path}: expected the columns {', '.join(header)}")
    public, codes = [], {}
    for i, column in enumerate(quasi):
        labels, codes[column] = _encoded([row[i] for row in qit.rows])
        public.append(Attribute(column, False, labels))
    index = {v: i for i, v in enumerate(domain)}
    unknown = [row[1] for row in st.rows if row[1] not in index]
    if unknown:
        raise PublicationError(f"{paths[1]}: {unknown[0]!r} is not in the domain of {name!r}")
    return Buckets(
        public=tuple(public),
        sensitive=Attribute(name, True, tuple(domain)),
        qit=codes,
        unit=_integers([row[-1] for row in qit.rows], paths[0], extra),
        st_unit=_integers([row[0] for row in st.rows], paths[1], extra),
        st_value=np.array([index[row[1]] for row in st.rows], dtype=np.int64),
        st_count=_integers([row[2] for row in st.rows], paths[1], COUNT_COLUMN),
    )


def _subtables(params: dict[str, Any], domain: Sequence[str]) -> list[SubTable]:
    """SDR's sub-tables as OUT.params.json records them: SA_i, |T_i|, ρ_1i and γ_i."""
    index = {v: i for i, v in enumerate(domain)}
    return [
        SubTable(
            tuple(sorted(index[v] for v in sub["values"])), int(sub["rows"]),
            Fraction(sub["rho1"]), Fraction(sub["gamma"]),
        )
        for sub in params["subtables"]
    ]  # fmt: skip


def load_batch(
    mechanism: str,
    published: str,
    named: Sequence[str],
    given: Mapping[str, Any],
    settings: dict[str, Any],
    confidence: float,
    clip: bool | None,
) -> tuple[Answers, int, dict[str, frozenset[str]]]:
    """The estimator of a batch-only publication from OUT.csv (`published`) and the files
    beside it, checked against each other (checksums) and against the options given (which
    must agree): `named` the sensitive columns named, if any, `given` the options by name as
    given (None where not), `settings` the same checked and completed with the defaults."""
    if published == "-":
        raise PublicationError(
            f"--published -: --mechanism {mechanism} reads OUT.{PARAMS_SUFFIX} beside OUT.csv, "
            "so give the file name"
        )
    params_path = beside(published, PARAMS_SUFFIX)
    if not Path(params_path).exists():
        raise PublicationError(
            f"cannot read {params_path}: `splu publish --mechanism {mechanism}` writes it beside "
            f"{published}; query the files it wrote together"
        )
    try:
        params = json.loads(_read_text(params_path))
    except json.JSONDecodeError as err:
        raise PublicationError(f"{params_path}: not valid JSON ({err.msg})") from None
    try:
        if params["mechanism"] != mechanism:
            raise PublicationError(
                f"{published} was published with --mechanism {params['mechanism']}, "
                f"not {mechanism} (says {params_path})"
            )
        text = _read_text(published)
        if _digest(text) != params["sha256"]["published"]:
            raise PublicationError(
                f"{params_path} belongs to another publication than {published} (checksums "
                "differ): query the files one `splu publish` wrote together"
            )
        sensitive = list(params["sensitive"])
        if named and list(named) != sensitive:
            raise PublicationError(
                f"--sensitive {','.join(named)}: {published} protects {', '.join(sensitive)}"
            )
        for option, recorded in params["options"].items():
            if given.get(option) is not None and shown_option(settings[option]) != recorded:
                raise PublicationError(
                    f"{flag_of(option)} {given[option]} does not match the publication's "
                    f"{recorded} (from {params_path})"
                )
        domains = {name: frozenset(params["domain"][name]) for name in sensitive}
        spec = MECHANISMS[mechanism]
        evidence = Evidence(
            params["options"], sensitive, None, {n: params["domain"][n] for n in sensitive},
            confidence, clip,
        )  # fmt: skip
        if spec.bucketed:
            raw = _rows(text, published)
            st_path = beside(published, ST_SUFFIX)
            st_text = _read_text(st_path)
            if _digest(st_text) != params["sha256"]["st"]:
                raise PublicationError(
                    f"{st_path} belongs to another publication than {published} "
                    "(checksums differ): query the files one `splu publish` wrote together"
                )
            paths = (published, st_path)
            buckets = _buckets(spec, params, raw, _rows(st_text, st_path), paths)
            return _reconstruct(spec, replace(evidence, buckets=buckets)), len(raw.rows), domains
        extra = [] if spec.extra_column is None else [spec.extra_column]
        header = [*params["quasi"], *sensitive, *extra]
        cells = published_cells(text, published)
        if cells.columns != header:
            raise PublicationError(f"{published}: expected the columns {', '.join(header)}")
        subtables = (
            _subtables(params, evidence.domain(sensitive[0])) if extra == [SUBTABLE_COLUMN] else []
        )
        answers = _reconstruct(spec, replace(evidence, cells=cells, subtables=subtables))
        return answers, cells.total, domains
    except (KeyError, TypeError, IndexError) as err:
        raise PublicationError(
            f"{params_path}: not the parameters `splu publish` writes (at {err!r})"
        ) from None


def _reconstruct(spec: MechanismSpec, evidence: Evidence) -> Answers:
    assert spec.reconstruct is not None, "every batch-only mechanism reconstructs"
    return spec.reconstruct(evidence)
