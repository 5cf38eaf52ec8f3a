"""lumen bench diagnose: the diagnosis scored like a classifier, on generated scenarios.

Each group is a model and a seeded base load; it runs its control (the base load alone) before
and after a few primitives (the same load with one provocation: bench.diagnose.scenarios), the
two controls' spread being the run's noise, each through a fresh `lumen serve` with a trace db
of its own. The client's measurements label each run and request (bench.diagnose.score);
`replay report` and `lumen trace why` of the run predict; the result is a confusion matrix per
cause, per run and per request, with 90% intervals, and the healthy controls' false alarms.
Every miss is printed with its group (seed, model, causes), so ``--group`` replays it exactly
and ``--out`` keeps its trace db.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import check_json_path, machine, write_json
from bench.diagnose.scenarios import (
    CAUSES,
    LORA_ADAPTERS,
    PROFILES,
    RANDOM_DRAFT,
    Group,
    Run,
    make_group,
)

DEFAULT_MODELS = "tiny:3,smollm2:1,gemma3:1"
MODEL_NAMES = {"smollm2": None, "gemma3": "gemma-3-270m"}  # for resolve_model


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("diagnose", help="score the diagnosis on generated scenarios")
    p.add_argument(
        "--runs-per-cause",
        type=int,
        default=30,
        help="primitive runs per cause (default %(default)s)",
    )
    p.add_argument(
        "--per-group",
        type=int,
        default=3,
        help="primitives sharing one base load and its control (default %(default)s)",
    )
    p.add_argument(
        "--causes", default=",".join(CAUSES), help="which causes (default: all of %(default)s)"
    )
    p.add_argument(
        "--models",
        default=DEFAULT_MODELS,
        help="models and their weights in the groups (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="the master seed (default %(default)s)")
    p.add_argument(
        "--group",
        action="append",
        default=[],
        metavar="SEED:MODEL:CAUSES",
        help="run this group alone (as a miss names it); repeatable",
    )
    p.add_argument(
        "--out", default=None, metavar="DIR", help="keep every run's trace db and server log here"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the matrix as JSON")
    p.add_argument(
        "--rescore",
        default=None,
        metavar="JSON",
        help="judge again the runs an earlier --json and its --out folder kept, with "
        "this tree's diagnosis (labels as they were measured)",
    )
    p.set_defaults(func=run)  # fmt: skip


def plan(args: argparse.Namespace) -> list[tuple[int, str, list[str]]]:
    """(seed, model, causes) per group: every cause ``--runs-per-cause`` times, shuffled by the
    master seed, ``--per-group`` to a group, models in proportion to their weights. The
    imbalance runs make groups of their own (a deployment of two engines: scenarios'
    two_engines), after the others."""
    if args.group:
        return [_parse_group(g) for g in args.group]
    causes = [c for c in args.causes.split(",") if c]
    if bad := set(causes) - set(CAUSES):
        raise ValueError(f"--causes: unknown {', '.join(sorted(bad))} (of {', '.join(CAUSES)})")
    models = _weights(args.models)
    if args.runs_per_cause < 1 or args.per_group < 1:
        raise ValueError("--runs-per-cause and --per-group must be at least 1")
    rng = np.random.default_rng(args.seed)
    pool = [c for c in causes for _ in range(args.runs_per_cause)]
    rng.shuffle(pool)
    cycle = itertools.cycle([m for m, w in models for _ in range(w)])
    chunks: list[list[str]] = []
    for kind in ([c for c in pool if c != "imbalance"], [c for c in pool if c == "imbalance"]):
        chunks += [kind[i : i + args.per_group] for i in range(0, len(kind), args.per_group)]
    return [(args.seed * 100_000 + g, next(cycle), chunk) for g, chunk in enumerate(chunks)]


def _weights(spec: str) -> list[tuple[str, int]]:
    out = []
    for item in filter(None, spec.split(",")):
        name, _, weight = item.partition(":")
        if name not in PROFILES:
            raise ValueError(f"--models: unknown model {name!r} (of {', '.join(PROFILES)})")
        out.append((name, int(weight or 1)))
    return out


def _parse_group(spec: str) -> tuple[int, str, list[str]]:
    try:
        seed, model, causes = spec.split(":")
        names = causes.split(",")
    except ValueError:
        raise ValueError(f"--group takes SEED:MODEL:CAUSE[,CAUSE], not {spec!r}") from None
    if model not in PROFILES or set(names) - set(CAUSES):
        raise ValueError(f"--group {spec!r}: unknown model or cause")
    return int(seed), model, names


def run(args: argparse.Namespace) -> int:
    from bench.diagnose.drive import record
    from bench.diagnose.score import Matrix, labels, verdict_of

    check_json_path(args.json)
    if args.rescore:
        return _rescore(args)
    groups = plan(args)
    tmp = Path(tempfile.mkdtemp(prefix="lumen-diagnose-"))
    out = Path(args.out) if args.out else tmp
    out.mkdir(parents=True, exist_ok=True)
    paths = _models(sorted({m for _, m, _ in groups}), tmp)
    draft = tmp / "random-draft"
    if any("speculation" in causes for _, _, causes in groups):
        from bench.tiny_model import build_tiny_llama
        from engine.model_files import resolve_model

        build_tiny_llama(draft, resolve_model(None), seed=1)
    matrix = Matrix()
    started = time.monotonic()
    details: list[dict[str, Any]] = []
    try:
        for n, (seed, model, causes) in enumerate(groups, 1):
            group = make_group(seed, model, causes)
            for r in group.primitives:  # the speculation primitive's draft, where it is
                r.flags = [f.replace(RANDOM_DRAFT, str(draft)) for f in r.flags]
                if r.cause == "lora_slots":  # the adapters of the group's model
                    folder = _lora_adapters(paths[model], tmp / f"lora-{model}")
                    r.flags = [f.replace(LORA_ADAPTERS, str(folder)) for f in r.flags]
            where = f"seed={seed} model={model} causes={','.join(causes)}"
            print(f"[{n}/{len(groups)}] group {seed}:{model}:{','.join(causes)} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
            details.append(_run_group(group, paths[model], out, matrix, where, record, labels,
                                      verdict_of))  # fmt: skip
            if n < len(groups):  # a matrix cut short keeps the groups it ran (--rescore reads it)
                _write(args.json, details, matrix, started, done=n, planned=len(groups),
                       quiet=True)  # fmt: skip
    finally:
        if not args.out:
            shutil.rmtree(tmp, ignore_errors=True)
    print(matrix.render())
    _write(args.json, details, matrix, started, done=len(groups), planned=len(groups))
    return 0


def _write(path: str | None, details: list[dict[str, Any]], matrix: Any, started: float,
           done: int, planned: int, quiet: bool = False) -> None:  # fmt: skip
    if path is None:
        return
    doc = {"machine": machine(), "groups": details, **matrix.to_json(),
           "seconds": round(time.monotonic() - started, 1), "groups_run": done,
           "groups_planned": planned}  # fmt: skip
    if quiet:
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    else:
        write_json(path, doc)


def _run_group(group: Group, model: Path, out: Path, matrix: Any, where: str, record: Any,
               labels: Any, verdict_of: Any) -> dict[str, Any]:  # fmt: skip
    """The control, each primitive, then the control again: its two runs bracket the
    primitives', so their spread holds the machine's drift over the group (the run's noise).
    Each primitive is labelled against both controls, at one speed (score.at_one_speed), then
    judged."""
    folder = out / f"{group.seed}-{group.model}"
    folder.mkdir(parents=True, exist_ok=True)
    said: dict[str, Any] = {**group.describe(), "runs": []}
    controls, speeds = [], []

    def control(name: str) -> bool:
        got = record(model, group.control, folder / f"{name}.db")
        if got.error:
            print(f"  {name}: {got.error}\n{got.log}")
            return False
        named = verdict_of(got.db)
        matrix.add_run(None, "neg", named, f"{where} run={name}", {}, _timed(got.seen))
        said["runs"].append(_said(name, "neg", named, got.seen, speed=got.speed_s))
        _print(name, "-", named)
        controls.append(got.seen)
        speeds.append(got.speed_s)
        return True

    if not control("control"):
        return said
    # Moments were drawn against the planned length of the load: the control measured it.
    took = max((s.end_s for s in controls[0]), default=group.duration_s)
    for run_ in group.primitives:
        rescale(run_, took / group.duration_s)
    recorded = []
    for i, run_ in enumerate(group.primitives):
        name = f"{i}-{run_.cause}"
        got = record(model, run_, folder / f"{name}.db")
        if got.error and not got.seen:
            print(f"  {name}: {got.error}\n{got.log}")
            continue
        recorded.append((name, run_, got))
    if not control("control-2"):
        return said
    for name, run_, got in recorded:
        label, per = labels(run_, controls, got.seen, speeds, got.speed_s)
        named = verdict_of(got.db)
        matrix.add_run(run_.cause, label, named, f"{where} run={name}", per, _timed(got.seen))
        said["runs"].append(_said(name, label, named, got.seen, run_, per, got.speed_s))
        _print(f"{name} ({label})", run_.magnitude, named)
    return said


def _timed(seen: list[Any]) -> set[str]:
    return {s.request_id for s in seen if s.request_id}


def rescale(run_: Run, factor: float) -> None:
    """Its moments (actions, its own requests' arrivals) stretched to the load as measured."""
    for action in run_.actions:
        action.at_s *= factor
    for ask in run_.asks:
        if ask.extra:
            ask.at_s *= factor


def _said(name: str, label: str, named: Any, seen: list[Any], run_: Run | None = None,
          per: dict[str, str] | None = None,
          speed: float | None = None) -> dict[str, Any]:  # fmt: skip
    per = per or {}
    return {"run": name, "label": label, "named": sorted(named.run), "probe_s": speed,
            "magnitude": run_.magnitude if run_ else {},
            "requests": [{**s.to_json(), "label": per.get(s.request_id),
                          "named": sorted(named.requests.get(s.request_id, ()))}
                         for s in seen]}  # fmt: skip


def _print(name: str, magnitude: Any, named: Any) -> None:
    print(f"  {name}: {json.dumps(magnitude)} -> named {sorted(named.run) or 'nothing'}",
          flush=True)  # fmt: skip


def _lora_adapters(model: Path, folder: Path) -> Path:
    """Four random rank-8 adapters of ``model`` (lora0..lora3), written once per run."""
    from bench.lora import write_adapter

    for i in range(4):
        if not (folder / f"lora{i}" / "adapter_config.json").is_file():
            write_adapter(model, folder / f"lora{i}", 8, 100 + i)
    return folder


def _models(names: list[str], tmp: Path) -> dict[str, Path]:
    from engine.model_files import resolve_model

    out = {}
    for name in names:
        if name == "tiny":
            from bench.tiny_model import build_tiny_llama

            out[name] = build_tiny_llama(tmp / "tiny-llama", resolve_model(None))
        else:
            out[name] = resolve_model(MODEL_NAMES[name])
    return out


def _rescore(args: argparse.Namespace) -> int:
    """The matrix of an earlier run's recordings, judged by this tree (its labels kept)."""
    from bench.diagnose.score import REFUSED, Matrix, verdict_of

    if not args.out:
        raise ValueError("--rescore needs --out: the folder that run kept its trace dbs in")
    earlier = json.loads(Path(args.rescore).read_text())
    matrix = Matrix()
    for g in earlier["groups"]:
        causes = [p["cause"] for p in g["primitives"]]
        where = f"seed={g['seed']} model={g['model']} causes={','.join(causes)}"
        for r in g["runs"]:
            db = Path(args.out) / f"{g['seed']}-{g['model']}" / f"{r['run']}.db"
            if not db.exists():
                continue
            cause = None if r["run"].startswith("control") else r["run"].split("-", 1)[1]
            # As score.labels judges now: a request the primitive made the server refuse (a
            # 400) is not labelled, and a run with none left is not scored.
            refused = {q["request_id"] for q in r["requests"] if q.get("code") == REFUSED}
            per = {q["request_id"]: q["label"] for q in r["requests"]
                   if q.get("label") and q["request_id"] not in refused}  # fmt: skip
            label = r["label"] if per or not refused else "gray"
            timed = {q["request_id"] for q in r["requests"] if q["request_id"]}
            matrix.add_run(cause, label, verdict_of(db), f"{where} run={r['run']}", per,
                           timed)  # fmt: skip
    print(matrix.render())
    write_json(args.json, {"machine": machine(), "rescored": args.rescore, **matrix.to_json()})
    return 0
