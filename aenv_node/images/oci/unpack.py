"""``python -m aenv_node.images.oci.unpack --blob B --media-type T --diff-id D ROOT``: one pulled layer blob,
decompressed, checked against its diff id and applied onto ROOT, in a process of its own.

The node converts layers onto a filesystem its own FUSE server serves: decompressing and untarring a
multi-GiB layer in the node would hold its interpreter against the very threads serving those writes. Here
the whole layer (zstd/gzip, hashing, the untar) runs apart; the node waits for one JSON line of statistics
(``ApplyStats``) or a non-zero exit with a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..errors import ImageError
from .apply import apply_layer
from .layers import OciLayer, open_layer_tar


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aenv_node.images.oci.unpack")
    p.add_argument("--blob", required=True, type=Path)
    p.add_argument("--media-type", required=True)
    p.add_argument("--diff-id", required=True)
    p.add_argument("root", type=Path)
    args = p.parse_args(argv)
    layer = OciLayer(digest="", diff_id=args.diff_id, media_type=args.media_type,
                     size=args.blob.stat().st_size, path=args.blob)
    try:
        with open_layer_tar(layer) as stream:
            stats = apply_layer(stream, args.root)
            while stream.read(1 << 20):  # the tar's zero padding: the diff id covers every byte
                pass
    except (ImageError, OSError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(dataclasses.asdict(stats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
