"""Writes the sample data under data/runs/ (committed; rerun after changing this script).

Three small batches that exercise every rule: one already filtered by the earlier script (a legacy
kept.jsonl, so it counts as history), and two new ones with retried tasks, every failure reason, a
backend_ok failure, duplicates within and across runs, and a site that hits its cap; and a labels.jsonl of
human labels for judge calibration.

    python scripts/make_sample_data.py [DATA_ROOT]
"""

import json
import random
import shutil
import sys
from pathlib import Path

_MACROS = {
    "add_to_cart": ("#add-to-cart", ["blue mug", "red kettle", "tea towel", "oak shelf", "desk lamp", "wool rug"]),
    "send_email": ("#compose-send", ["alice@corp.test", "bob@corp.test", "carol@corp.test", "dan@corp.test"]),
    "search_place": ("input[name=q]", ["Lisbon", "Porto", "Faro", "Braga", "Coimbra", "Évora"]),
}
_SITE_MACRO = {
    "shop.example": "add_to_cart",
    "market.example": "add_to_cart",
    "mail.example": "send_email",
    "webmail.example": "send_email",
    "maps.example": "search_place",
    "atlas.example": "search_place",
}
SITES = {site: (macro, *_MACROS[macro]) for site, macro in _SITE_MACRO.items()}
ERRORS = [
    "policy violation: clicked an element outside the task scope",
    "backend check failed: cart has 0 items, expected 1",
    "assertion failed: confirmation banner not shown",
    "action refused: element #add-to-cart is disabled",
    "TimeoutError: page did not settle within 30s",
    None,
]


def trajectory(instruction: str, site: str, element: str, argument: str, ok: bool) -> tuple[list, dict]:
    steps = [
        {"action": "goto", "url": f"https://{site}/"},
        {"action": "type" if "input" in element else "click", "selector": element, "text": argument},
    ]
    if ok:
        steps.append({"action": "click", "selector": "button[type=submit]"})
    final = {
        "url": f"https://{site}/{'done' if ok else 'error'}",
        "observation": (f"Success: {argument} handled." if ok else "Something went wrong.") + " " + "Lorem ipsum " * 20,
    }
    return steps, {"instruction": instruction, "steps": steps, "final": final}


def write_batch(data: Path, run_id: str, tasks: list[dict], rng: random.Random, legacy_kept: bool = False) -> None:
    run = data / "runs" / run_id
    executions = []
    for task in tasks:
        site, (_, element, _) = task["site"], SITES[task["site"]]
        n_attempts = task.pop("_attempts")
        for attempt in range(1, n_attempts + 1):
            ok = attempt == n_attempts and rng.random() > 0.15
            error = None if ok else rng.choice(ERRORS)
            rel = f"runs/{run_id}/traj/{task['task_id']}/{attempt}"
            steps, traj = trajectory(task["instruction"], site, element, task["dedup_key"][2], ok)
            (data / rel).mkdir(parents=True, exist_ok=True)
            (data / rel / "trajectory.json").write_text(json.dumps(traj, indent=2))
            backend = {"ok": ok or (error or "").startswith("assertion"), "detail": "row present" if ok else "no row"}
            record = {"task_id": task["task_id"], "attempt": attempt, "ok": ok, "dir": rel, "steps": steps}
            if error is not None:
                record["error"] = error
            record["backend"] = backend if (ok or rng.random() > 0.3) else None
            executions.append(record)
    rng.shuffle(executions)  # the harness writes attempts as they finish, interleaved
    run.mkdir(parents=True, exist_ok=True)
    (run / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    (run / "executions.jsonl").write_text("".join(json.dumps(e) + "\n" for e in executions))
    if legacy_kept:
        ok_tasks = {e["task_id"] for e in executions if e["ok"]}
        kept = {json.dumps(t["dedup_key"]): t for t in reversed(tasks) if t["task_id"] in ok_tasks}
        (run / "kept.jsonl").write_text("".join(json.dumps(t) + "\n" for t in reversed(kept.values())))
    (run / "_SUCCESS").write_text("")


def make_tasks(run_id: str, rng: random.Random, n: int) -> list[dict]:
    tasks = []
    for i in range(n):
        site = rng.choice(sorted(SITES))
        macro, element, arguments = SITES[site]
        argument = rng.choice(arguments)
        tasks.append(
            {
                "task_id": f"{run_id}-t{i:03d}",
                "macro": macro,
                "site": site,
                "instruction": f"On {site}, {macro.replace('_', ' ')} for '{argument}'.",
                "dedup_key": [site, element, argument],
                "start": {"kind": rng.choice(["url", "login"]), "url": f"https://{site}/"},
                "_attempts": rng.choice([1, 1, 2, 3]),
            }
        )
    return tasks


def write_labels(data: Path, run_id: str, rng: random.Random) -> None:
    """labels.jsonl: a human's verdict on some attempts of one run (mostly agreeing with the harness)."""
    labels = []
    for line in (data / "runs" / run_id / "executions.jsonl").read_text().splitlines()[:16]:
        record = json.loads(line)
        success = record["ok"] if rng.random() > 0.2 else not record["ok"]
        labels.append({"dir": record["dir"], "success": success})
    (data / "labels.jsonl").write_text("".join(json.dumps(label) + "\n" for label in labels))


def main(data: Path) -> None:
    rng = random.Random(20261130)
    if (data / "runs").exists():
        shutil.rmtree(data / "runs")
    write_batch(data, "2026-11-27", make_tasks("2026-11-27", rng, 8), rng, legacy_kept=True)
    for run_id in ("2026-11-28", "2026-11-29"):
        write_batch(data, run_id, make_tasks(run_id, rng, 14), rng)
    write_labels(data, "2026-11-28", rng)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "data")
