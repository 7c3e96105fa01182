"""The packaged catalog as tests read it (fuser_core/catalog, the one the package ships): its
folder, its specs as raw dicts and its benchmark suites. tests/conftest.py removes a user's
$FOLDWISE_CATALOG_DIR before any test runs, so what tests see never depends on the machine."""

from __future__ import annotations

import json

from fuser_core.catalog import PACKAGED_DIR, catalog_entries, load_suites

CATALOG_DIR = PACKAGED_DIR


def load_catalog() -> dict[str, dict]:
    """{spec name: raw dict} for every spec of the packaged catalog."""
    return {e.name: json.loads(e.path.read_bytes()) for e in catalog_entries([CATALOG_DIR])}


def load_catalog_suites() -> dict[str, list[dict]]:
    """The packaged catalog's benchmark suites (suite name -> cases)."""
    return load_suites([CATALOG_DIR])


# Catalog specs the derivation does not fuse into one loop, and why (they run in every strategy all the
# same: row_resident holds the row). rmsnorm_fp8_per_block's amax over a block reads the norm, a sum over
# the blocks g of sums over c, only through the factor rsqrt(ms + eps) applied at the end, which a loop
# over c cannot know yet; deriving "max now, factor once the other axis is done" is open (issue 36).
NOT_FUSED = {"rmsnorm_fp8_per_block": ("amax", "a reduction over g that itself needs the final ssq")}
