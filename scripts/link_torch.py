#!/usr/bin/env python3
"""Link the main venv's torch stack into another venv, so it is not downloaded twice.

The tinker-cookbook venv (scripts/setup.sh, scripts/requirements-cookbook.txt) needs torch
but must not share the main venv's transformers. Its torch is the main venv's torch==2.11.0:
the distributions torch, triton, nvidia-* and cuda-* (about 5 GB, most of it CUDA libraries
that PyPI's Linux wheel depends on, and no CPU-only index is reachable from this machine) are
symlinked, top-level entry by top-level entry (packages, modules and *.dist-info), into the
target's site-packages. pip then sees them installed at the pinned versions and leaves them
alone; the small pure-Python dependencies of torch (sympy, networkx, ...) are installed into
the target normally. Console scripts (bin/torchrun) are not linked.

Usage: python link_torch.py TARGET_VENV   (run with the main venv's python)
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
import sysconfig
from pathlib import Path

LINKED = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")


def linked_entries(site: Path) -> set[str]:
    """Top-level names in site-packages that belong to the linked distributions."""
    names: set[str] = set()
    for dist in metadata.distributions(path=[str(site)]):
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if not LINKED.match(name):
            continue
        for file in dist.files or []:
            top = file.parts[0]
            if top != ".." and top != "__pycache__":
                names.add(top)
    return names


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    target = Path(sys.argv[1])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    target_site = target / "lib" / version / "site-packages"
    if not target_site.is_dir():
        print(f"{target_site}: not a venv of {version}", file=sys.stderr)
        return 1
    # Resolved: the main venv is reached through the checkout's .venv link, and a link made
    # through it would dangle once that checkout (a worktree, a CI clone) is gone.
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    entries = sorted(linked_entries(site))
    if not any(e.startswith("torch-") and e.endswith(".dist-info") for e in entries):
        print(f"no torch in {site}", file=sys.stderr)
        return 1
    for entry in entries:
        link = target_site / entry
        if not link.exists() and not link.is_symlink():
            link.symlink_to(site / entry)
    print(f"   linked {len(entries)} entries of torch/triton/nvidia/cuda from {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
