"""Where quantkit's bundled files are, named once: the checkout that holds the package (calibration_data/,
recipes/, .cache/) and the package's own data (plan/configs/). Modules sit at different depths of the
package; none counts the parents of its own path.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CACHE_DIR", "CALIBRATION_DATA", "PACKAGE_DIR", "PLAN_CONFIGS", "REPO_DIR"]

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # quantkit/
REPO_DIR = PACKAGE_DIR.parent  # the checkout the package runs from
CALIBRATION_DATA = REPO_DIR / "calibration_data"  # the bundled calibration, held-out and tool-call data
CACHE_DIR = REPO_DIR / ".cache"  # trained tiny models, the engines' wheels, the eval venv
PLAN_CONFIGS = PACKAGE_DIR / "plan" / "configs"  # the released models' config.json files
