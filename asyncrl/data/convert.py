"""`asyncrl data convert`: GSM8K-style (or any question / answer) rows -> one parquet file in verl's layout.

    asyncrl data convert IN OUT [--source gsm8k|plain] [--question-key K] [--answer-key K]
                         [--instruction TEXT] [--split NAME] [--data-source NAME] [--force]

IN is what `asyncrl.data.datasets.read_rows` reads (a .jsonl or .parquet file, a `datasets` save_to_disk
folder of one split) or a .json file holding one array of rows. Each usable row becomes the row verl's
examples/data_preprocess/gsm8k.py writes:

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": QUESTION + " " + INSTRUCTION}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, "answer": ANSWER, "question": QUESTION}}

`--source gsm8k`: the ground truth is the text after the answer's last `####`, commas removed
(`... #### 1,000` -> `1000`). `--source plain`: the answer as given (a number becomes its text).
`extra_info.index` is the row's position in IN, so a skipped row leaves a gap there.

The trainer loads OUT unchanged (`asyncrl.data.tasks.load_prompts`): `prompt` rendered by the model's
chat template, `reward_model.ground_truth` the reference, `data_source` picks the reward
(`agents.rewards.DATA_SOURCES`: `openai/gsm8k` -> `gsm8k`; empty -> `math_answer`). This module knows
neither rewards nor config (it sits below both): a data source with no reward is the loader's error,
which names `agent.reward`.

Rows that cannot be used are skipped, counted by reason and printed once at the end:

    bad_json      a jsonl line that is not valid JSON (as the loader counts it)
    not_object    a row that is not an object (as the loader counts it)
    no_question   the question is absent, not a string, or blank
    no_answer     the answer is absent, blank, not a string or number, or (gsm8k) has nothing after `####`

A missing or unreadable IN, a column no row has, no usable row, or an existing OUT without `--force` is
one line and exit code 2. OUT is written beside itself under a temporary name and renamed, so nobody reads
half a file. Imports no torch (`asyncrl data` answers in well under a second).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.data.datasets import BadLine, MissingColumn, get_field, read_rows, resolve_column

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
"""verl's GSM8K instruction, appended to every question after one space."""
DEFAULT_DATA_SOURCE = {"gsm8k": "openai/gsm8k", "plain": ""}
"""`--source` -> the `data_source` written when `--data-source` is not given."""
SKIP_REASONS = ("bad_json", "not_object", "no_question", "no_answer")


class ConvertError(ValueError):
    """What the user must fix, in one line (exit code 2)."""


@dataclass
class Converted:
    rows: list[dict[str, Any]]
    """Rows in verl's layout, in input order."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Rows skipped, by reason (`SKIP_REASONS`); only reasons that occurred."""


def gsm8k_ground_truth(answer: str) -> str | None:
    """The text after the last `####`, commas removed, or None: `... #### 1,000` -> `1000`."""
    _, mark, tail = answer.rpartition("####")
    value = tail.strip().replace(",", "")
    return value if mark and value else None


def convert_rows(rows: list[Any], *, source: str = "gsm8k", question_key: str = "question", answer_key: str = "answer",
                 instruction: str = GSM8K_INSTRUCTION, split: str = "train", data_source: str | None = None) -> Converted:
    """The usable `rows` in verl's layout; a column no row has is `MissingColumn` (dotted keys reach into objects)."""
    resolve_column(rows, "question", question_key, ())
    resolve_column(rows, "answer", answer_key, ())
    tag = DEFAULT_DATA_SOURCE[source] if data_source is None else data_source
    out, skipped = [], dict.fromkeys(SKIP_REASONS, 0)
    for i, row in enumerate(rows):
        if isinstance(row, BadLine) or not isinstance(row, dict):
            skipped["bad_json" if isinstance(row, BadLine) else "not_object"] += 1
            continue
        question, answer = get_field(row, question_key), get_field(row, answer_key)
        if not isinstance(question, str) or not question.strip():
            skipped["no_question"] += 1
            continue
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            truth = None
        else:
            answer = str(answer)
            truth = gsm8k_ground_truth(answer) if source == "gsm8k" else (answer if answer.strip() else None)
        if truth is None:
            skipped["no_answer"] += 1
            continue
        out.append({
            "data_source": tag,
            "prompt": [{"role": "user", "content": f"{question} {instruction}" if instruction else question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": i, "answer": answer, "question": question},
        })
    return Converted(out, {k: v for k, v in skipped.items() if v})


def _schema() -> Any:
    import pyarrow as pa

    text = pa.string()
    return pa.schema([
        ("data_source", text),
        ("prompt", pa.list_(pa.struct([("role", text), ("content", text)]))),
        ("ability", text),
        ("reward_model", pa.struct([("style", text), ("ground_truth", text)])),
        ("extra_info", pa.struct([("split", text), ("index", pa.int64()), ("answer", text), ("question", text)])),
    ])


def _read(path: Path) -> list[Any]:
    """`read_rows`, and a .json file holding one array of rows (a .json file of lines is jsonl to `read_rows`)."""
    if path.suffix == ".json" and path.is_file():
        try:
            value = json.loads(path.read_bytes())
        except ValueError:
            value = None
        if isinstance(value, list):
            return value
    return read_rows(path)


def convert(src: str, out: str, *, force: bool = False, **kw: Any) -> Converted:
    """Convert the rows of `src` and write them to the parquet file `out` (temporary name, then renamed);
    `kw` goes to `convert_rows`. Everything the user must fix is a `ConvertError`."""
    dest = Path(out).expanduser()
    if dest.suffix != ".parquet":
        raise ConvertError(f"OUT {out!r} must end in .parquet (the trainer reads a data file by its suffix)")
    if dest.exists() and not force:
        raise ConvertError(f"OUT {out!r} exists; give --force to replace it")
    try:
        rows = _read(Path(src).expanduser())
    except FileNotFoundError:
        raise ConvertError(f"IN {src!r} not found") from None
    except (ValueError, OSError) as e:
        raise ConvertError(f"IN {e}") from None
    try:
        done = convert_rows(rows, **kw)
    except MissingColumn as e:
        raise ConvertError(f"IN {src!r} has {e} (set --{e.role}-key)") from None
    if not done.rows:
        raise ConvertError(f"no usable row in IN {src!r} ({_counts(done.skipped) or 'it has no rows'})")
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(done.rows, schema=_schema()), tmp)
        os.replace(tmp, dest)
    except OSError as e:
        raise ConvertError(f"cannot write OUT {out!r}: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return done


def _counts(skipped: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in skipped.items())


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="asyncrl data", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Data files for `asyncrl train`.\n\n"
                    "  asyncrl data convert IN OUT [--source gsm8k|plain] [options]\n"
                    "      GSM8K-style (or any question / answer) rows of a .jsonl / .parquet / .json file or a datasets\n"
                    "      save_to_disk folder -> OUT.parquet in verl's layout (data_source, prompt as chat messages,\n"
                    "      reward_model.ground_truth, extra_info), which data.train_path / data.eval_path load as is.\n"
                    "      Options: asyncrl data convert --help. The road from the demo to a model and data of your\n"
                    "      own: docs/real_job.md.")
    verbs = top.add_subparsers(dest="verb", title="commands", metavar="COMMAND")
    c = verbs.add_parser("convert", help="question / answer rows -> verl's parquet layout",
                         description="Question / answer rows -> one parquet file in verl's layout (docs/real_job.md).")
    c.add_argument("input", metavar="IN",
                   help=".jsonl, .parquet or .json (an array) file, or a datasets save_to_disk folder")
    c.add_argument("output", metavar="OUT", help="the .parquet file to write (its folder is made)")
    c.add_argument("--source", choices=sorted(DEFAULT_DATA_SOURCE), default="gsm8k",
                   help="gsm8k (default): the ground truth is the text after the answer's `####`, commas removed; "
                        "plain: the answer as given")
    c.add_argument("--question-key", default="question",
                   help="the question's column (dotted reaches into objects; default: question)")
    c.add_argument("--answer-key", default="answer", help="the answer's column (default: answer)")
    c.add_argument("--instruction", default=GSM8K_INSTRUCTION,
                   help="appended to every question after a space; '' for none (default: verl's GSM8K one: %(default)s)")
    c.add_argument("--split", default="train", help="written to extra_info.split (default: train)")
    c.add_argument("--data-source", default=None,
                   help="the data_source column, which picks the reward (default: openai/gsm8k for --source gsm8k, "
                        "empty for plain: the math_answer reward)")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    return top


def main(argv: list[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) and usage errors (2) as return codes, as `asyncrl.cli.main` returns them
        return int(e.code or 0)
    if args.verb is None:
        parser.print_help()
        return 2
    try:
        done = convert(args.input, args.output, force=args.force, source=args.source, question_key=args.question_key,
                       answer_key=args.answer_key, instruction=args.instruction, split=args.split,
                       data_source=args.data_source)
    except ConvertError as e:
        print(f"asyncrl data: error: {e}", file=sys.stderr)
        return 2
    skipped = f" (skipped: {_counts(done.skipped)})" if done.skipped else ""
    print(f"asyncrl data: wrote {len(done.rows)} rows to {args.output}{skipped}")
    return 0
