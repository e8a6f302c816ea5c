"""Timing records for local-steps modes of ``launch/bench_ttq.py`` that were not timed themselves.

An outer step sends the same bytes whatever H, so a ``sync: local_steps`` mode that differs from a timed one
only in H or in its outer optimizer (``outer_lr``) has that
mode's median local step and median outer-step overhead; its step time is ``local_ms + overhead / H``. For
each link, every quality record of such a mode without a timing record gets one, marked ``timing_from``
(the timed mode it borrows from: same density, exchange and communication dtype).

    python launch/bench/borrow_timing.py runs/ttq2000     # then: python launch/bench_ttq.py report --out ...
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path


def _local(rec: dict) -> dict | None:
    d = (rec.get("config") or {}).get("dragonn") or {}
    return d if d.get("sync") == "local_steps" else None


def _key(rec: dict, d: dict) -> tuple:
    return (d.get("density", 0.01), d.get("exchange", "allgather"), (rec.get("config") or {}).get("communication_data_type"))


def borrow(out: Path) -> list:
    """Write the borrowed timing records under ``out/records/timing``; returns their file names."""
    quality = [json.loads(p.read_text()) for p in sorted((out / "records" / "quality").glob("*.json"))]
    timing = [json.loads(p.read_text()) for p in sorted((out / "records" / "timing").glob("*.json"))]
    timed = {(t["mode"], t["link"]) for t in timing}
    written = []
    for q in quality:
        d = _local(q)
        if d is None:
            continue
        h = int(d.get("local_steps", 30))
        for src in timing:
            sd = _local(src)
            if (sd is None or (q["mode"], src["link"]) in timed or src.get("timing_from")
                    or src.get("outer_overhead_ms") is None or _key(src, sd) != _key(q, d)):
                continue
            rec = copy.deepcopy(src)
            scale = src["local_steps"] / h
            rec.update(mode=q["mode"], about=q.get("about", ""), local_steps=h, timing_from=src["mode"],
                       median_step_ms=src["local_step_ms"] + src["outer_overhead_ms"] / h,
                       bytes_per_step=src["bytes_per_step"] * scale,
                       tx_bytes_per_step=(src["tx_bytes_per_step"] * scale
                                          if src.get("tx_bytes_per_step") is not None else None))
            name = f"{q['mode']}@{src['link']}.json"
            (out / "records" / "timing" / name).write_text(json.dumps(rec, indent=1))
            timed.add((q["mode"], src["link"]))
            written.append(name)
    return written


if __name__ == "__main__":
    for name in borrow(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/bench_ttq")):
        print("wrote", name)
