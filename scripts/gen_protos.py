"""Generates the Python stubs (with .pyi) for protos/ into metrale/: `python scripts/gen_protos.py [OUT]`."""

import pathlib
import sys

import grpc_tools
from google.rpc import status_pb2
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    googleapis = pathlib.Path(status_pb2.__file__).parents[2]     # google/rpc/status.proto, from googleapis
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"-I{googleapis}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *sources]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")
    return sorted(p for p in out_dir.rglob("*_pb2*") if p.is_file())


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out):
        print(path)
