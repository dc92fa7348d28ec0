"""Regenerate the committed protobuf/gRPC modules from ``v1/kvray.proto``.

Run from the repository root: ``python -m cluster.api.regenerate`` (needs grpcio-tools).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = "cluster/api/v1/kvray.proto"


def main() -> int:
    from grpc_tools import protoc

    return protoc.main(
        [
            "protoc",
            f"-I{ROOT}",
            f"--python_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            f"--pyi_out={ROOT}",
            str(ROOT / PROTO),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
