"""Storage records torch never reads (issue 24, item 1): a DCP whose byte item also has a record
under ``MetadataIndex(fqn, ())`` -- the key a 0-d tensor is read under -- pointing at another
checkpoint's record of the same name, copied into this one. torch reads a byte item under offset
None only; a reader that folds the two keys shows, converts and verifies the decoy's bytes."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

from tests.reliability.attacks import Attack, _dcp, edit_metadata


def folded_keys(work: Path, rng: random.Random) -> Attack:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    foreign = _dcp(work / "foreign", secret=True)
    ckpt = _dcp(work / "ckpt")
    shutil.copy(foreign / "__0_0.distcp", ckpt / "__9_0.distcp")  # inside: no traversal to refuse
    theirs: dict[str, Any] = {}
    edit_metadata(foreign, lambda md: theirs.update({k.fqn: v for k, v in md.storage_data.items() if k.offset is None}))
    decoy_first = rng.random() < 0.5

    def edit(md: Any) -> None:
        items = list(md.storage_data.items())
        for fqn, info in theirs.items():  # the byte items: step, cfg.name
            info.relative_path = "__9_0.distcp"
            decoy = (MetadataIndex(fqn, ()), info)
            items.insert(0 if decoy_first else len(items), decoy)
        md.storage_data = dict(items)

    edit_metadata(ckpt, edit)
    return Attack(ckpt, frozenset(), note=f"decoy {'before' if decoy_first else 'after'} the real records")


ATTACKS_METADATA = {"folded-keys": folded_keys}
