#!/usr/bin/env python3
"""Checks that docs/torch_nn_coverage.md has exactly one row per module class `torch.nn` exports.

    python docs/check_torch_nn_coverage.py

Run it with the PyTorch the fixtures use (see fixtures/README.md) after adding a layer or
upgrading PyTorch: it lists the classes the table misses and the rows that name no class, and
exits with 1 if there are any.
"""

import inspect
import os
import re
import sys

import torch.nn as nn

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_nn_coverage.md")


def main():
    classes = {
        name
        for name in dir(nn)
        if inspect.isclass(getattr(nn, name)) and issubclass(getattr(nn, name), nn.Module)
    }
    with open(TABLE, encoding="utf-8") as f:
        rows = re.findall(r"^\| `(\w+)` \|", f.read(), flags=re.MULTILINE)
    duplicated = sorted({r for r in rows if rows.count(r) > 1})
    missing = sorted(classes - set(rows))
    unknown = sorted(set(rows) - classes)
    for what, names in [("missing", missing), ("not in torch.nn", unknown), ("listed twice", duplicated)]:
        if names:
            print(f"{what}: {', '.join(names)}")
    if missing or unknown or duplicated:
        sys.exit(1)
    print(f"all {len(classes)} torch.nn module classes are in the table, once each")


if __name__ == "__main__":
    main()
