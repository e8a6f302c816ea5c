"""The throttled link of the benchmarks, written once: two network namespaces joined by a veth pair
(``launch/netns.sh`` holds the set-up; the shell benchmarks source it, the Python ones call it), the veth's own
byte counter, and tc's rate units.

Addresses come from 198.51.100.0/24 (a documentation range) and exist only inside the namespaces, so rank
traffic never leaves the machine. Creating namespaces needs root.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Optional, Sequence

NETNS_SH = Path(__file__).resolve().parents[1] / "netns.sh"


def _netns(function: str, ns: Sequence[str], ifs: Sequence[str], addrs: Sequence[str], *args: str) -> None:
    """Run one of ``netns.sh``'s functions with the namespaces, veth ends and addresses given."""
    arrays = " ".join(f"{name}=({' '.join(values)})" for name, values in (("NS", ns), ("IF", ifs), ("ADDR", addrs)))
    subprocess.run(["bash", "-c", f'{arrays}; . "{NETNS_SH}"; {function} "$@"', "netns", *args], check=True)


def netns_up(link: str, ns: Sequence[str], ifs: Sequence[str], addrs: Sequence[str]) -> None:
    """Two namespaces joined by a veth pair, both ends throttled to ``link`` (a tc rate, or ``unthrottled``);
    any earlier ones of the same names are deleted first."""
    _netns("netns_up", ns, ifs, addrs, link)


def netns_down(ns: Sequence[str], ifs: Sequence[str], addrs: Sequence[str]) -> None:
    """Delete the namespaces (and with them the veth pair) and DeepSpeed's shm files of their addresses."""
    _netns("netns_down", ns, ifs, addrs)
    _netns("remove_all_shm", ns, ifs, addrs)


def tx_bytes(iface: Optional[str], netns: Optional[str] = None) -> Optional[int]:
    """Bytes the interface ``iface`` transmitted (its own counter; None when unknown). ``netns``: read it inside
    that namespace (from outside it); None: in this process's namespace."""
    if not iface:
        return None
    counter = f"/sys/class/net/{iface}/statistics/tx_bytes"
    if netns is not None:
        out = subprocess.run(["ip", "netns", "exec", netns, "cat", counter], check=True, capture_output=True, text=True)
        return int(out.stdout)
    path = Path(counter)
    return int(path.read_text()) if path.exists() else None


def link_mbit(link: Optional[str]) -> Optional[float]:
    """'100mbit' -> 100, '1gbit' -> 1000, 'unthrottled' or None -> None (tc's rate units, bits per second)."""
    m = re.fullmatch(r"([\d.]+)([kmg]?)bit", (link or "").lower())
    return float(m.group(1)) * {"": 1e-6, "k": 1e-3, "m": 1.0, "g": 1e3}[m.group(2)] if m else None


def link_gbit(link: Optional[str]) -> Optional[float]:
    """'1gbit' -> 1, '500mbit' -> 0.5, 'unthrottled' -> None (an int where whole)."""
    mbit = link_mbit(link)
    if mbit is None:
        return None
    gbit = mbit / 1e3
    return int(gbit) if gbit == int(gbit) else gbit
