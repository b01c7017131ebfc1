"""Build hook: generate twinkle_client/_proto before setuptools looks for packages.

All metadata lives in pyproject.toml. The generated package is git-ignored, so a build from
the repository produces it here from ../../proto; a build from an sdist, which carries the
generated files and no proto/ tree, uses them as they are.
"""

import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate_protos import ensure_generated

ensure_generated()
setup()
